"""Gradient compression over the data-parallel replicas, in DDP's comm hook (ZeRO stages 0-1;
bf16 also at 2-3, through FSDP2's reduce dtype). Every compressor keeps the sum in fp32 and
gives every replica the same bits.

    bf16          each replica sends chunk j of its bucket, in bf16, to replica j (an
                  all-to-all), which sums the chunks in fp32 and sends the mean back in bf16 (an
                  all-gather): half the bytes of the fp32 all-reduce
    int8          the same path with int8 and one fp32 absmax scale per block of `BLOCK`
                  entries (the owner of a chunk requantizes the mean): about a quarter, plus the
                  scales; error feedback
    topk:<f>      each replica keeps the largest-magnitude fraction f of every parameter's
                  entries (values and int32 indices, all-gathered), the rest is zero; error
                  feedback
    powersgd:rank=<r>[,start=<s>]
                  PowerSGD (Vogels et al. 2019, torch's algorithm: one power iteration, warm-
                  started, QR-orthogonalized): each matrix gradient M (rows, columns) is sent as
                  the means of P = M Q (rows, r) and of Q = M^T P (columns, r), fp32; vectors and
                  matrices the factors would not halve (torch's minimum compression rate 2) go
                  whole in the first round; the first s reductions of a parameter go whole;
                  error feedback

Blocks and selections never span two parameters: a DDP bucket holds tensor-parallel shards and
weights replicated over the TP ranks side by side, and a replicated weight must get the same
mean on every TP rank, which it does only when its compression depends on its own entries.

Error feedback: what a replica did not send (gradient + old residual - what it sent) is added to
its next gradient. It is kept only where the reduced bucket is finite (the same bucket on every
replica): a step the loss scaler skips leaves every residual as it was. The residuals live in
`Compressor.residuals`, one flat tensor per parameter (DDP regroups its buckets after the first
step); checkpoints do not save them, nor PowerSGD's warm-start Q: a residual is one replica's
own (the replicas' residuals differ; only their sum means anything), so it has no place in a
checkpoint that is resumed at another data-parallel size; a resumed run starts from zero
residuals and a fresh Q, which costs one step's worth of unsent gradient, not correctness.

PowerSGD is ours, not torch's `powerSGD_hook` around a guard, for three reasons found in its
source (torch 2.13): it keys the residual and the warm-start memory by bucket index, which DDP's
bucket rebuild after the first step reassigns (torch refuses `start_powerSGD_iter` < 2 for it);
it draws the initial Q per bucket from one random stream, so the same replicated weight in
differently bucketed TP ranks (uneven splits) gets different Qs and drifts apart; and its
all-reduces run where `count_bytes()` cannot see them. Here the state is per parameter, the
initial Q is seeded by the parameter's position in the module, and the means go through the
same counted, rank-ordered fp32 sum as the other compressors.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tplayers.functional import comm

KINDS = ("bf16", "int8", "topk", "powersgd")
BLOCK = 64  # int8 entries per absmax scale
SPECS = "'bf16', 'int8', 'topk:<fraction>', 'powersgd:rank=<r>[,start=<step>]'"


@dataclass(frozen=True)
class Compression:
    """What `data_parallel(compress=...)` takes: `Compression.parse("topk:0.01")` or the fields."""

    kind: str
    fraction: float | None = None  # topk
    error_feedback: bool = True  # int8, topk, powersgd
    rank: int | None = None  # powersgd: the rank of the approximation
    start: int = 0  # powersgd: a parameter's reductions sent whole before the first compressed one

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"data_parallel: compress must be one of {SPECS}, got {self!r}")
        if self.kind == "topk" and not (isinstance(self.fraction, float) and 0 < self.fraction <= 1):
            raise ValueError(f"data_parallel: compress 'topk' needs a fraction in (0, 1], got {self.fraction!r}")
        if self.kind == "powersgd":
            if not (type(self.rank) is int and self.rank >= 1):
                raise ValueError(f"data_parallel: compress 'powersgd' needs rank=<int >= 1>, got {self.rank!r}")
            if not (type(self.start) is int and self.start >= 0):
                raise ValueError(f"data_parallel: compress 'powersgd' needs start=<int >= 0>, got {self.start!r}")

    @classmethod
    def parse(cls, spec) -> Compression | None:
        if spec is None or isinstance(spec, Compression):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"data_parallel: compress must be a string or a Compression, got {spec!r}")
        kind, _, arg = spec.partition(":")
        if kind not in KINDS:
            raise ValueError(f"data_parallel: compress must be one of {SPECS}, got {spec!r}")
        if kind == "powersgd":
            return cls._parse_powersgd(spec, arg)
        if kind == "topk":
            try:
                return cls("topk", float(arg))
            except ValueError:
                raise ValueError(f"data_parallel: compress 'topk:<fraction>' needs a number, got {spec!r}") from None
        if arg:
            raise ValueError(f"data_parallel: compress {kind!r} takes no argument, got {spec!r}")
        return cls(kind)

    @classmethod
    def _parse_powersgd(cls, spec: str, arg: str) -> Compression:
        fields = {}
        for item in arg.split(",") if arg else ():
            key, _, value = item.partition("=")
            if key not in ("rank", "start") or key in fields or not value.strip().isdigit():
                raise ValueError(
                    f"data_parallel: compress 'powersgd:rank=<r>[,start=<step>]' takes integers rank and start, "
                    f"got {spec!r}"
                )
            fields[key] = int(value)
        if "rank" not in fields:
            raise ValueError(f"data_parallel: compress 'powersgd' needs rank=<r>, got {spec!r}")
        return cls("powersgd", **fields)

    def spec(self) -> str:
        """The string `parse` reads back (error_feedback=False has none: kept only on the object)."""
        if self.kind == "topk":
            return f"topk:{self.fraction}"
        if self.kind == "powersgd":
            return f"powersgd:rank={self.rank}" + (f",start={self.start}" if self.start else "")
        return self.kind

    def check_stage(self, zero_stage: int) -> None:
        if self.kind != "bf16" and zero_stage >= 2:
            raise ValueError(
                f"data_parallel: compress {self.kind!r} needs the whole gradient of each bucket (ZeRO stage 0 or 1), "
                f"not FSDP2's reduce-scatter at zero_stage {zero_stage}; use zero_stage=1 (the optimizer state still "
                "sharded) or compress='bf16'"
            )


# -- the math, shared by the hook and by any single-process simulation of it --------------------
def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 entries and fp32 scales of `x` (blocks, BLOCK): absmax / 127 per block."""
    scale = x.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1), 0).round().clamp(-127, 127)
    return q.to(torch.int8), scale.squeeze(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


def blocked(sizes: list[int], n: int) -> tuple[list[int], int]:
    """Each parameter's offset in the blocked layout (its entries padded to whole blocks), and
    the blocks per replica's chunk (the layout padded to n equal chunks)."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += math.ceil(size / BLOCK) * BLOCK
    return offsets, math.ceil(total / BLOCK / n)


def to_blocks(flat: torch.Tensor, sizes: list[int], n: int) -> torch.Tensor:
    """(n * chunk, BLOCK): the parameters of `flat` in whole blocks, zero-padded."""
    offsets, chunk = blocked(sizes, n)
    out = flat.new_zeros(n * chunk * BLOCK)
    start = 0
    for size, offset in zip(sizes, offsets, strict=True):
        out[offset : offset + size] = flat[start : start + size]
        start += size
    return out.view(-1, BLOCK)


def from_blocks(blocks: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    offsets, _ = blocked(sizes, 1)
    flat = blocks.reshape(-1)
    return torch.cat([flat[offset : offset + size] for size, offset in zip(sizes, offsets, strict=True)])


def topk_indices(x: torch.Tensor, sizes: list[int], fraction: float) -> torch.Tensor:
    """The largest-magnitude `fraction` of each parameter's entries (at least one), as indices
    into `x`, parameter by parameter."""
    out, start = [], 0
    for size in sizes:
        k = min(size, max(1, math.ceil(fraction * size)))
        out.append(start + x[start : start + size].abs().topk(k, sorted=False).indices.sort().values)
        start += size
    return torch.cat(out).to(torch.int32)


MIN_COMPRESSION_RATE = 2  # torch's default: factors at most half the matrix's entries


def low_rank(shape, rank: int) -> tuple[int, int, int] | None:
    """(rows, columns, r) of a gradient of `shape` that PowerSGD sends as rank-r factors (rows
    the first dimension, columns the others), or None for one it sends whole."""
    if len(shape) < 2:
        return None
    rows, columns = shape[0], math.prod(shape[1:])
    r = min(rank, rows, columns)
    return (rows, columns, r) if MIN_COMPRESSION_RATE * (rows + columns) * r <= rows * columns else None


def orthonormal(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(x).Q


def initial_q(index: int, columns: int, r: int) -> torch.Tensor:
    """The first Q of the module's `index`-th parameter: the same on every replica and TP rank."""
    return orthonormal(torch.randn(columns, r, generator=torch.Generator().manual_seed(index)))


@dataclass
class PowerSGDState:
    """Per parameter (or, in `simulate`, per position): the last mean Q (the warm start) and the
    reductions seen (against `start`)."""

    q: dict = field(default_factory=dict)
    reductions: dict = field(default_factory=dict)

    def plan(self, key, shape, compression: Compression):
        """The parameter's factor shape this reduction (None: sent whole), counting it."""
        seen = self.reductions.get(key, 0)
        self.reductions[key] = seen + 1
        return low_rank(shape, compression.rank) if seen >= compression.start else None


def _split(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [part.view(shape) for part, shape in zip(flat.split([a * b for a, b in shapes]), shapes, strict=True)]


def simulate(compression: Compression, values: list[torch.Tensor], shapes: list, state: PowerSGDState | None = None):
    """The compressor on one process, for checks and benchmarks: `values` each replica's flat
    bucket (gradient + residual) of parameters of `shapes` (an int: a vector of that many);
    `state` PowerSGD's across calls (updated). Returns (the mean every replica gets, what each
    replica sent). Sums in the same order as the distributed path: bit for bit."""
    n = len(values)
    shapes = [(s,) if isinstance(s, int) else tuple(s) for s in shapes]
    sizes = [math.prod(s) for s in shapes]
    if compression.kind == "bf16":
        mean = (torch.stack([v.to(torch.bfloat16) for v in values]).float().sum(0) / n).to(torch.bfloat16)
        return mean.float(), [v.to(torch.bfloat16).float() for v in values]
    if compression.kind == "int8":
        q = [quantize(to_blocks(v, sizes, n)) for v in values]
        summed = torch.stack([dequantize(*qs) for qs in q]).sum(0) / n
        mean = from_blocks(dequantize(*quantize(summed)), sizes)
        return mean, [from_blocks(dequantize(*qs), sizes) for qs in q]
    if compression.kind == "powersgd":
        return _simulate_powersgd(compression, values, shapes, state if state is not None else PowerSGDState())
    mean, sent = torch.zeros_like(values[0]), []
    for v in values:
        index = topk_indices(v, sizes, compression.fraction).long()
        sent.append(torch.zeros_like(v).index_put_((index,), v[index]))
        mean.index_add_(0, index, v[index])
    return mean / n, sent


def _simulate_powersgd(compression, values, shapes, state):
    n, offsets = len(values), [0, *itertools.accumulate(math.prod(s) for s in shapes)]
    low = {i: f for i, s in enumerate(shapes) if (f := state.plan(i, s, compression))}
    whole = [i for i in range(len(shapes)) if i not in low]

    def mean_of(parts):  # each replica's concatenation, summed in rank order
        return torch.stack([torch.cat(p) if p else values[0].new_zeros(0) for p in parts]).sum(0) / n

    def part(v, i):
        return v[offsets[i] : offsets[i + 1]]

    ms = [{i: part(v, i).view(rows, cols) for i, (rows, cols, _) in low.items()} for v in values]
    qs = {i: state.q.get(i, initial_q(i, cols, r)) for i, (_, cols, r) in low.items()}
    first = mean_of([[(m[i] @ qs[i]).reshape(-1) for i in low] + [part(v, i) for i in whole]
                     for m, v in zip(ms, values, strict=True)])  # fmt: skip
    p_sizes = [(rows, r) for rows, _, r in low.values()]
    ps = dict(zip(low, (orthonormal(p) for p in _split(first[: sum(a * b for a, b in p_sizes)], p_sizes)),
                  strict=True))  # fmt: skip
    q_mean = mean_of([[(m[i].T @ ps[i]).reshape(-1) for i in low] for m in ms])
    new_q = dict(zip(low, _split(q_mean, [(cols, r) for _, cols, r in low.values()]), strict=True))
    mean = torch.empty_like(values[0])
    for i in low:
        part(mean, i).copy_((ps[i] @ new_q[i].T).reshape(-1))
    whole_mean = first[sum(a * b for a, b in p_sizes) :]
    start = 0
    for i in whole:
        size = offsets[i + 1] - offsets[i]
        part(mean, i).copy_(whole_mean[start : start + size])
        start += size
    if bool(torch.isfinite(mean).all()):
        state.q.update(new_q)
    sent = []
    for v in values:
        s = mean.clone()
        for i in whole:
            part(s, i).copy_(part(v, i))
        sent.append(s)
    return mean, sent


# -- the hook -----------------------------------------------------------------------------------
def _layout(flat: torch.Tensor, params, grads) -> list[tuple]:
    """(offset, size, parameter) of each gradient in the order it lies in the bucket's buffer
    (not the order DDP lists them in), refusing a bucket they do not tile exactly."""
    base, size = flat.data_ptr(), flat.element_size()
    spans = sorted((((g.data_ptr() - base) // size, g.numel(), p) for p, g in zip(params, grads, strict=True)),
                   key=lambda span: span[0])  # fmt: skip
    start = 0
    for offset, numel, _ in spans:
        if offset != start:
            raise RuntimeError(f"gradient compression: DDP's bucket has a gap or overlap at entry {start}")
        start += numel
    if start != flat.numel():
        raise RuntimeError(f"gradient compression: a bucket of {flat.numel()} entries holds gradients of {start}")
    return spans


class Compressor:
    """DDP's comm hook for one `Compression` over `group` (see the module docstring);
    `parameters` the module's, in order (PowerSGD's initial Q is seeded by the position)."""

    def __init__(self, compression: Compression, group, parameters=()):
        self.compression, self.group = compression, group
        # per parameter (DDP regroups its buckets after the first step: a residual follows its
        # parameter, not a bucket's position)
        self.residuals: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.powersgd = PowerSGDState()
        self.index = {p: i for i, p in enumerate(parameters)}

    def reduce(self, bucket):
        """The mean of a DDP bucket over the replicas, compressed; a completed future of it."""
        flat = bucket.buffer()
        spans = _layout(flat, bucket.parameters(), bucket.gradients())
        sizes = [numel for _, numel, _ in spans]
        c = self.compression
        feedback = c.kind != "bf16" and c.error_feedback
        value = flat.float().clone()
        for offset, numel, param in spans if feedback else ():
            if param in self.residuals:
                value[offset : offset + numel] += self.residuals[param]
        new_q = {}
        if c.kind == "bf16":
            mean, sent = self._mean(value, torch.bfloat16), None
        elif c.kind == "int8":
            mean, sent = self._int8(value, sizes)
        elif c.kind == "topk":
            mean, sent = self._topk(value, sizes)
        else:
            mean, sent, new_q = self._powersgd(value, spans)
        if bool(torch.isfinite(mean).all()):  # the same on every replica: the reduced bucket
            self.powersgd.q.update(new_q)
            if feedback:
                unsent = value - sent
                for offset, numel, param in spans:
                    self.residuals[param] = unsent[offset : offset + numel].clone()
        flat.copy_(mean)
        done = torch.futures.Future()
        done.set_result(flat)
        return done

    def _mean(self, value, dtype):
        """The mean over the replicas, summed in fp32 in rank order (bit for bit what `simulate`
        computes): chunk j of every replica's `value`, in `dtype`, to replica j (an all-to-all),
        which sums them and sends the mean back (an all-gather): an all-reduce's bytes."""
        n = dist.get_world_size(self.group)
        chunk = math.ceil(value.numel() / n)
        send = value.new_zeros(n * chunk, dtype=dtype)
        send[: value.numel()] = value
        received = self._all_to_all(send)
        mean = (received.view(n, chunk).float().sum(0) / n).to(dtype)
        return self._all_gather(mean)[: value.numel()].float()

    def _powersgd(self, value, spans):
        """(mean, sent, the new Qs): two rounds, [P of every factored matrix, every whole
        gradient] then [Q of every factored matrix]; what a replica sent is the mean's
        approximation where factored, its own gradient where whole."""
        low, whole = [], []
        for offset, numel, param in spans:
            factors = self.powersgd.plan(param, param.shape, self.compression)
            (low if factors else whole).append((offset, numel, param, factors))
        ms = [value[o : o + n].view(rows, cols) for o, n, _, (rows, cols, _) in low]
        qs = [self.powersgd.q.get(p) for _, _, p, _ in low]
        qs = [initial_q(self.index.get(p, 0), cols, r) if q is None else q
              for q, (_, _, p, (_, cols, r)) in zip(qs, low, strict=True)]  # fmt: skip
        p_sizes = [(rows, r) for _, _, _, (rows, _, r) in low]
        first = self._mean(torch.cat([(m @ q).reshape(-1) for m, q in zip(ms, qs, strict=True)]
                                     + [value[o : o + n] for o, n, _, _ in whole]), torch.float32)  # fmt: skip
        p_numel = sum(a * b for a, b in p_sizes)
        ps = [orthonormal(p) for p in _split(first[:p_numel], p_sizes)]
        mean, sent, new_q = value.clone(), value.clone(), {}
        if low:
            q_mean = self._mean(torch.cat([(m.T @ p).reshape(-1) for m, p in zip(ms, ps, strict=True)]), torch.float32)
            q_sizes = [(cols, r) for _, _, _, (_, cols, r) in low]
            for (o, n, param, _), p, q in zip(low, ps, _split(q_mean, q_sizes), strict=True):
                mean[o : o + n] = sent[o : o + n] = (p @ q.T).reshape(-1)
                new_q[param] = q
        start = p_numel
        for o, n, _, _ in whole:
            mean[o : o + n] = first[start : start + n]
            start += n
        return mean, sent, new_q

    def _int8(self, value, sizes):
        n = dist.get_world_size(self.group)
        q, scale = quantize(to_blocks(value, sizes, n))
        sent = from_blocks(dequantize(q, scale), sizes)
        q_in, scale_in = self._all_to_all(q.reshape(-1)), self._all_to_all(scale)
        chunk = scale.numel() // n
        summed = dequantize(q_in.view(n * chunk, -1), scale_in).view(n, chunk, -1).sum(0) / n
        q_mean, scale_mean = quantize(summed)
        q_all, scale_all = self._all_gather(q_mean.reshape(-1)), self._all_gather(scale_mean)
        return from_blocks(dequantize(q_all.view(-1, BLOCK), scale_all), sizes), sent

    def _topk(self, value, sizes):
        n = dist.get_world_size(self.group)
        index = topk_indices(value, sizes, self.compression.fraction)
        values = value[index.long()]
        sent = torch.zeros_like(value).index_put_((index.long(),), values)
        all_values, all_index = self._all_gather(values), self._all_gather(index)
        summed = torch.zeros_like(value)
        for r in range(n):  # in rank order, the same on every replica
            k = index.numel()
            summed.index_add_(0, all_index[r * k : (r + 1) * k].long(), all_values[r * k : (r + 1) * k])
        return summed / n, sent

    def _all_to_all(self, send):
        received = torch.empty_like(send)
        comm.record("all_to_all", send, self.group, "dp")
        dist.all_to_all_single(received, send, group=self.group)
        return received

    def _all_gather(self, t):
        out = t.new_empty(dist.get_world_size(self.group) * t.numel())
        comm.record("all_gather", out, self.group, "dp")
        comm.all_gather_single(out, t.contiguous(), group=self.group)
        return out


def compressed_mean(compressor: Compressor, bucket):
    """DDP's comm hook (state, bucket) -> future: `compressor.reduce(bucket)`."""
    return compressor.reduce(bucket)
