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

Blocks and selections never span two parameters: a DDP bucket holds tensor-parallel shards and
weights replicated over the TP ranks side by side, and a replicated weight must get the same
mean on every TP rank, which it does only when its compression depends on its own entries.

Error feedback: what a replica did not send (gradient + old residual - what it sent) is added to
its next gradient. It is kept only where the reduced bucket is finite (the same bucket on every
replica): a step the loss scaler skips leaves every residual as it was. The residuals live in
`Compressor.residuals`, one flat tensor per parameter (DDP regroups its buckets after the first
step); checkpoints do not save them (a resumed run starts from zero residuals, which costs one
step's worth of unsent gradient, not correctness).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tplayers.functional import comm

KINDS = ("bf16", "int8", "topk")
BLOCK = 64  # int8 entries per absmax scale


@dataclass(frozen=True)
class Compression:
    """What `data_parallel(compress=...)` takes: `Compression.parse("topk:0.01")` or the fields."""

    kind: str
    fraction: float | None = None  # topk
    error_feedback: bool = True  # int8, topk

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"data_parallel: compress must be one of 'bf16', 'int8', 'topk:<fraction>', got {self!r}")
        if self.kind == "topk" and not (isinstance(self.fraction, float) and 0 < self.fraction <= 1):
            raise ValueError(f"data_parallel: compress 'topk' needs a fraction in (0, 1], got {self.fraction!r}")

    @classmethod
    def parse(cls, spec) -> Compression | None:
        if spec is None or isinstance(spec, Compression):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"data_parallel: compress must be a string or a Compression, got {spec!r}")
        kind, _, arg = spec.partition(":")
        if kind not in KINDS:
            raise ValueError(f"data_parallel: compress must be one of 'bf16', 'int8', 'topk:<fraction>', got {spec!r}")
        if kind == "topk":
            try:
                return cls("topk", float(arg))
            except ValueError:
                raise ValueError(f"data_parallel: compress 'topk:<fraction>' needs a number, got {spec!r}") from None
        if arg:
            raise ValueError(f"data_parallel: compress {kind!r} takes no argument, got {spec!r}")
        return cls(kind)

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


def simulate(compression: Compression, values: list[torch.Tensor], sizes: list[int]):
    """The compressor on one process, for checks and benchmarks: `values` each replica's flat
    bucket (gradient + residual), parameters of `sizes`; returns (the mean every replica gets,
    what each replica sent). Sums in the same order as the distributed path: bit for bit."""
    n = len(values)
    if compression.kind == "bf16":
        mean = (torch.stack([v.to(torch.bfloat16) for v in values]).float().sum(0) / n).to(torch.bfloat16)
        return mean.float(), [v.to(torch.bfloat16).float() for v in values]
    if compression.kind == "int8":
        q = [quantize(to_blocks(v, sizes, n)) for v in values]
        summed = torch.stack([dequantize(*qs) for qs in q]).sum(0) / n
        mean = from_blocks(dequantize(*quantize(summed)), sizes)
        return mean, [from_blocks(dequantize(*qs), sizes) for qs in q]
    mean, sent = torch.zeros_like(values[0]), []
    for v in values:
        index = topk_indices(v, sizes, compression.fraction).long()
        sent.append(torch.zeros_like(v).index_put_((index,), v[index]))
        mean.index_add_(0, index, v[index])
    return mean / n, sent


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
    """DDP's comm hook for one `Compression` over `group` (see the module docstring)."""

    def __init__(self, compression: Compression, group):
        self.compression, self.group = compression, group
        # per parameter (DDP regroups its buckets after the first step: a residual follows its
        # parameter, not a bucket's position)
        self.residuals: dict[torch.nn.Parameter, torch.Tensor] = {}

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
        if c.kind == "bf16":
            mean, sent = self._bf16(value), None
        elif c.kind == "int8":
            mean, sent = self._int8(value, sizes)
        else:
            mean, sent = self._topk(value, sizes)
        if feedback and bool(torch.isfinite(mean).all()):
            unsent = value - sent
            for offset, numel, param in spans:
                self.residuals[param] = unsent[offset : offset + numel].clone()
        flat.copy_(mean)
        done = torch.futures.Future()
        done.set_result(flat)
        return done

    def _bf16(self, value):
        n = dist.get_world_size(self.group)
        chunk = math.ceil(value.numel() / n)
        send = value.new_zeros(n * chunk, dtype=torch.bfloat16)
        send[: value.numel()] = value
        received = self._all_to_all(send)
        mean = (received.view(n, chunk).float().sum(0) / n).to(torch.bfloat16)
        return self._all_gather(mean)[: value.numel()].float()

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
