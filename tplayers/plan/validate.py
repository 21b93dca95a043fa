"""`tplayers plan --validate`: the planner's per-GPU numbers checked against a real training step.

For a few small layouts on local CPU ranks (gloo), `validate` builds a Llama-style HuggingFace
model, shards it with `tplayers.parallelize` (and, for ZeRO 1-3, `tplayers.data_parallel`),
runs one training step (forward, vocab-parallel cross-entropy, backward, the data-parallel
gradient reduction when dp > 1, Adam step) and compares what every rank measured with
`tplayers.plan.estimate` for the same `ModelSpec`, `Layout` and `Precision` (model states per
replica: `model_state_bytes_per_rank`, padding and ZeRO-1's whole-tensor partition included):

    quantity     measured on each rank                                          check
    comm tp, dp  bytes this rank sends in the step (`tplayers.count_bytes`,      exact
                 ring formulas); dp: the gradient all-reduce over the dp group
                 (plain DDP, ZeRO stage 0), tp: everything else
    params       sum of numel * element_size over the model's parameters at the  exact
                 step (ZeRO 2-3: the storages of the local shards, padded)
    grads        the gradients held at `optimizer.step()`, where they live: fp32  exact
                 on the masters with MixedPrecisionOptimizer, else on the params
                 (ZeRO 2-3: the reduce-scatter buffers the shards live in)
    optimizer    what the optimizer owns: the fp32 master copies and every        exact
                 per-element state tensor (Adam's exp_avg, exp_avg_sq); Adam's
                 scalar `step` counters (4 bytes per tensor) are left out
    activations  bytes of the distinct storages autograd holds for backward at    band, and
                 the end of forward + loss (`saved_tensors_hooks` on the saved     exact once
                 tensors, parameters excluded): the activation memory between      itemised
                 forward and backward, independent of the allocator

Precision mapping. tplayers' mixed precision is not Megatron's 2 + 2 + 12 bytes per parameter:
`MixedPrecisionOptimizer` moves each bf16 gradient into its fp32 master's `.grad` as soon as it
is produced and drops the bf16 one, so what lives at the step is bf16 params (2), fp32 grads (4)
and fp32 master + exp_avg + exp_avg_sq (12): `TPLAYERS_PRECISIONS["bf16"]` =
`Precision(2, 4, 12, activation_bytes=2)`; the data-parallel all-reduce runs on those fp32
gradients (the plan prices it at grad_bytes). fp32 training with Adam is the plan's "fp32-adam"
preset (4 + 4 + 8). The predictions use `Assumptions(implementation="tplayers")`: the
collectives and stored tensors of tplayers at the model's edges (the transformer layers are
priced alike for Megatron and tplayers; see `tplayers.plan.Assumptions`).

Activations. The plan's accounting is Korthikanti et al.'s analysis of Megatron's layers. The
attention runs in SDPA's fused kernel, which keeps no s x s matrix, so the prediction is the
plan's estimate less the attention core's softmax term (Korthikanti's selective-recompute
storage, which FlashAttention matches). Every layer term of the plan (norm input, QKV and MLP
inputs, Q, K, V, attention output, gate|up output and SwiGLU product, logits) is kept by the
HF model sharded by tplayers; beyond them it keeps what `hf_llama_extra_activations` lists,
mostly HF's LlamaRMSNorm, which keeps an fp32 copy of its input besides the normalised input
(4h + 4 bytes per row per norm more than a fused norm keeping its input). Those norms sit outside
the TP region, so measured / plan grows with tp: 1.26 (tp=2 fp32) to 1.67 (tp=4 bf16) on the
default cases. Two checks follow: "activations", measured / plan within
[1, 1 + activation_rtol] (default 0.75: the plan's analysis is a lower bound of what a real
model keeps, and these HF terms are the whole gap), and "activations+hf", measured equal to the
plan plus the itemised HF terms, byte for byte, on every rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from tplayers.plan.estimate import estimate, model_state_bytes_per_rank
from tplayers.plan.layout import Assumptions, Layout
from tplayers.plan.memory import layer_activation_bytes
from tplayers.plan.specs import ClusterSpec, ModelSpec, Precision, padded_vocab

__all__ = [
    "DEFAULT_CASES",
    "TPLAYERS_PRECISIONS",
    "VALIDATION_ASSUMPTIONS",
    "VALIDATION_MODEL",
    "Check",
    "Measurement",
    "ValidationCase",
    "ValidationRow",
    "all_ok",
    "compare",
    "format_validation",
    "hf_llama_extra_activations",
    "measure",
    "predicted_activations",
    "validate",
]

# The model every default case trains: Llama-style (RMSNorm, SwiGLU, RoPE, no biases, no
# dropout), grouped-query attention with 2 kv heads, so tp = 4 replicates each kv head on two
# ranks. A true vocabulary of 250 padded to 256 = a multiple of 64 * tp for tp in 1, 2, 4: the
# HF model is built with the padded size, the targets stay in [0, 250).
VALIDATION_MODEL = ModelSpec(
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    ffn_hidden=128,
    vocab=250,
    seq_len=32,
    gated_mlp=True,
    dropout=False,
    name="tiny-llama",
)
VALIDATION_ASSUMPTIONS = Assumptions(vocab_divisible_by=64, implementation="tplayers")
MICRO_BATCH = 2

# Bytes per parameter of what tplayers keeps, per training dtype (see the module docstring).
TPLAYERS_PRECISIONS = {
    "bf16": Precision(param_bytes=2, grad_bytes=4, optimizer_bytes=12, activation_bytes=2),
    "fp32": Precision.preset("fp32-adam"),
}
# Measured / plan activations of the default cases lie in [1.26, 1.67], the gap being HF's
# RMSNorm storage (see the module docstring): the one-sided band allows up to 1.75.
DEFAULT_ACTIVATION_RTOL = 0.75


@dataclass(frozen=True)
class ValidationCase:
    """One layout to train and check: `dtype` "bf16" (bf16 model, MixedPrecisionOptimizer over
    Adam) or "fp32" (fp32 model, Adam). pp must be 1 and recompute "none" (tplayers has no
    pipeline stages or recomputation yet); ZeRO 1-3 (`tplayers.data_parallel`) trains in fp32."""

    layout: Layout
    dtype: str = "bf16"

    def __post_init__(self):
        if self.dtype not in TPLAYERS_PRECISIONS:
            raise ValueError(f"ValidationCase.dtype must be one of {list(TPLAYERS_PRECISIONS)}, got {self.dtype!r}")
        lay = self.layout
        if lay.pp != 1 or lay.recompute != "none":
            raise ValueError(
                f"tplayers has no pipeline stages or recomputation yet: validation needs pp=1, recompute='none', "
                f"got {lay.describe()}"
            )
        if lay.zero_stage and self.dtype != "fp32":
            raise ValueError(f"ZeRO cases train in fp32 (FSDP2's bf16 copies are not itemised), got {self.dtype}")

    @property
    def precision(self) -> Precision:
        return TPLAYERS_PRECISIONS[self.dtype]

    @property
    def name(self) -> str:
        lay = self.layout
        parts = [f"tp{lay.tp}"] + ([f"dp{lay.dp}"] if lay.dp > 1 else []) + (["sp"] if lay.sequence_parallel else [])
        parts += [f"zero{lay.zero_stage}"] if lay.zero_stage else []
        if lay.num_microbatches > 1:
            parts.append(f"m{lay.num_microbatches}")
        return " ".join(parts + [self.dtype])


def _case(dtype="bf16", **layout) -> ValidationCase:
    return ValidationCase(Layout(micro_batch=MICRO_BATCH, **layout), dtype)


DEFAULT_CASES = (
    _case(tp=1),
    _case(tp=2),
    _case(tp=2, sequence_parallel=True),
    _case(tp=2, num_microbatches=2),  # gradient accumulation: TP traffic twice, one DP reduction
    _case("fp32", tp=2),
    _case(tp=4),  # 4 ranks > 2 kv heads: k / v replicated, their gradients all-reduced
    _case(tp=4, sequence_parallel=True),
    _case(tp=2, dp=2, sequence_parallel=True),
    # ZeRO on tplayers.data_parallel: optimizer state partitioned (1), gradients (2), parameters (3)
    _case("fp32", tp=2, dp=2, zero_stage=1),
    _case("fp32", tp=2, dp=2, zero_stage=2),
    _case("fp32", tp=2, dp=2, zero_stage=3, sequence_parallel=True),  # norms whole, outside FSDP2
)


# ---------------------------------------------------------------------------------------------
# Measurement (on the ranks)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank measured in one training step, in bytes."""

    comm: int  # sent in the whole step
    comm_dp: int  # sent by the data-parallel gradient all-reduce
    comm_by_kind: dict[str, int]  # all_reduce / all_gather / reduce_scatter / send
    params: int
    grads: int
    optimizer: int
    activations: int  # the largest of the micro-batches

    QUANTITIES = ("comm", "comm_tp", "comm_dp", "params", "grads", "optimizer", "activations")

    @property
    def comm_tp(self) -> int:
        return self.comm - self.comm_dp


@dataclass(frozen=True)
class Measurement:
    """One case's measurements on each of its ranks (rank order: tp fastest, then dp)."""

    case: ValidationCase
    ranks: tuple[RankMeasurement, ...]
    seconds: float  # wall time of the slowest rank: build, parallelize, one step
    model: ModelSpec = VALIDATION_MODEL  # the model trained
    assumptions: Assumptions = VALIDATION_ASSUMPTIONS  # its vocabulary padding


def _hf_llama(spec: ModelSpec, vocab: int):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise ImportError("tplayers plan --validate trains a HuggingFace model: pip install 'tplayers[hf]'") from e
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn_hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.seq_len, tie_word_embeddings=spec.tied_embeddings,
        attention_bias=spec.linear_bias, mlp_bias=spec.linear_bias, attention_dropout=0.0,
        attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _check_model(spec: ModelSpec) -> None:
    """The measured model is an HF Llama: the ModelSpec must describe one."""
    llama = (
        spec.has_dims
        and spec.gated_mlp
        and spec.norm == "rmsnorm"
        and spec.position_embedding == "rope"
        and not spec.dropout
    )
    if not llama:
        raise ValueError(
            "validation trains a HuggingFace Llama: the ModelSpec needs dimensions, gated_mlp=True, "
            "norm='rmsnorm', position_embedding='rope' and dropout=False"
        )


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


class _SavedStorages:
    """saved_tensors_hooks that add up the distinct storages saved for backward, skipping the
    parameters' (the model's `parameters()` as they are when a tensor is saved: under ZeRO 2-3,
    FSDP2's gathered copies during forward): the activation memory held between forward and
    backward."""

    def __init__(self, model):
        self.model = model
        self.sizes: dict[int, int] = {}

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in {local_tensor(p).untyped_storage().data_ptr() for p in self.model.parameters()}:
            self.sizes[key] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def _new_groups(rank: int, layout: Layout):
    """Every rank of the world creates every TP and DP group of `layout` (ranks tp fastest, then
    dp), in the same order; returns this rank's (tp_group, dp_group), or None if it is idle."""
    import torch.distributed as dist

    tp, dp = layout.tp, layout.dp
    mine = None, None
    tp_groups = [dist.new_group([d * tp + i for i in range(tp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * tp + i for d in range(dp)]) for i in range(tp)]
    if rank < tp * dp:
        mine = tp_groups[rank // tp], dp_groups[rank % tp]
    return mine


def _measure_step(case: ValidationCase, spec: ModelSpec, assumptions: Assumptions, seed: int, tp_group, dp_group):
    """Build, shard and train one step on this rank; returns its RankMeasurement."""
    import torch
    import torch.distributed as dist

    import tplayers
    from tplayers.functional import comm

    layout = case.layout
    vocab = padded_vocab(spec.vocab, layout.tp, assumptions.vocab_divisible_by)
    torch.manual_seed(seed)  # the same weights on every rank
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[case.dtype]
    model = _hf_llama(spec, vocab).to(dtype)
    tplayers.parallelize(model, group=tp_group, sequence_parallel=layout.sequence_parallel, vocab_parallel_logits=True)
    zero = layout.zero_stage
    if zero:  # the engines reduce the gradients themselves, outside tplayers.count_bytes
        tplayers.data_parallel(model, group=dp_group, zero_stage=zero)
    params = list(model.parameters())
    opt = tplayers.data_parallel_optimizer(model, torch.optim.Adam, lr=1e-3)
    if case.dtype != "fp32":
        opt = tplayers.MixedPrecisionOptimizer(opt)
    # Each DP replica its own batch, the same on the ranks of a TP group; tokens of the true
    # vocabulary, inputs and targets shifted by one (s positions each, as Megatron's data loader).
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank(dp_group))
    shape = (layout.num_microbatches, layout.micro_batch, spec.seq_len + 1)
    tokens = torch.randint(0, spec.vocab, shape, generator=gen)
    activations = 0
    with tplayers.count_bytes() as sent:
        for batch in tokens:
            saved = _SavedStorages(model)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                logits = model(batch[:, :-1]).logits  # (b, s, V/tp)
                loss = tplayers.vocab_parallel_cross_entropy(logits, batch[:, 1:], group=tp_group)
            activations = max(activations, saved.total)
            (loss / layout.num_microbatches).backward()
        stepped = [p for group in opt.param_groups for p in group["params"]]  # the masters, if any
        with tplayers.count_bytes() as sent_dp:  # plain DDP: one all-reduce of every gradient
            for p in stepped if layout.dp > 1 and not zero else ():
                if p.grad is not None:
                    comm.all_reduce(p.grad, dp_group)
                    p.grad.div_(layout.dp)
        held = {id(p): p for p in [*params, *stepped]}.values()
        grads = _held_bytes([p.grad for p in held if p.grad is not None], padded=zero >= 2)
        params_bytes = _held_bytes(params, padded=zero >= 2)
        opt.step()
    model_ids = {id(p) for p in params}
    owned = sum(_nbytes(p) for p in stepped if id(p) not in model_ids)  # fp32 masters
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer: this replica's own optimizer
    states = [v for state in inner.state.values() for v in state.values() if _is_per_element(v)]
    owned += sum(_nbytes(local_tensor(v)) for v in states)
    opt.zero_grad(set_to_none=True)
    return RankMeasurement(
        comm=sent.total(),
        comm_dp=sent_dp.total(),
        comm_by_kind=dict(sent),
        params=params_bytes,
        grads=grads,
        optimizer=owned,
        activations=activations,
    )


def _held_bytes(tensors, *, padded: bool) -> int:
    """Bytes of `tensors`; `padded` (ZeRO 2-3 on FSDP2): of the distinct storages their local
    shards live in, which hold each shard padded to ceil(rows / dp) rows (the gradients of one
    unit share one reduce-scatter buffer)."""
    if not padded:
        return sum(_nbytes(t) for t in tensors)
    storages = {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def local_tensor(t):
    from tplayers.placement import local_tensor as local

    return local(t)


def _is_per_element(value) -> bool:
    import torch

    return torch.is_tensor(value) and value.dim() > 0


def _measure_cases(rank, world_size, cases, spec, assumptions, seed):
    """On every rank of the world: each case on its first tp*dp ranks; None where idle."""
    import torch.distributed as dist

    out = []
    for case in cases:
        start = time.perf_counter()
        groups = _new_groups(rank, case.layout)
        result = None
        if groups[0] is not None:
            result = (_measure_step(case, spec, assumptions, seed, *groups), time.perf_counter() - start)
        dist.barrier()  # every rank is done with this case's groups before any is destroyed
        if result is not None:
            for g in {id(g): g for g in groups}.values():
                dist.destroy_process_group(g)
        out.append(result)
    return out


def _pool_entry(rank, world_size, group, cases, spec, assumptions, seed):
    """`WorkerPool.run` calls fn(rank, n, group, *args)."""
    return _measure_cases(rank, world_size, cases, spec, assumptions, seed)


def _resolve_cases(layouts, nprocs_max):
    if layouts is None:
        return [c for c in DEFAULT_CASES if c.layout.num_gpus <= nprocs_max]
    cases = [c if isinstance(c, ValidationCase) else ValidationCase(c) for c in layouts]
    too_big = [c.name for c in cases if c.layout.num_gpus > nprocs_max]
    if too_big:
        raise ValueError(f"layouts {too_big} need more than nprocs_max={nprocs_max} ranks")
    return cases


def measure(layouts=None, *, model=None, assumptions=None, nprocs_max=4, seed=0, pool=None) -> list[Measurement]:
    """Train one step of each case on local CPU ranks and return what each rank measured.

    `layouts`: ValidationCase or Layout (bf16) items, default `DEFAULT_CASES` up to `nprocs_max`
    ranks. One launch runs every case (case by case, each on the first tp*dp ranks); `pool`, a
    `tplayers.testing.WorkerPool`, runs them on its ranks instead of starting new ones.
    """
    import tplayers

    spec = VALIDATION_MODEL if model is None else model
    _check_model(spec)
    assumptions = VALIDATION_ASSUMPTIONS if assumptions is None else assumptions
    cases = _resolve_cases(layouts, nprocs_max)
    if not cases:
        return []
    nprocs = max(c.layout.num_gpus for c in cases)
    if pool is not None:
        if pool.world_size < nprocs:
            raise ValueError(f"the pool has {pool.world_size} ranks; the cases need {nprocs}")
        per_rank = pool.run(_pool_entry, pool.world_size, cases, spec, assumptions, seed)
    else:
        per_rank = tplayers.launch(_measure_cases, nprocs, cases, spec, assumptions, seed)
    out = []
    for i, case in enumerate(cases):
        results = [per_rank[r][i] for r in range(case.layout.num_gpus)]
        ranks, seconds = tuple(m for m, _ in results), max(s for _, s in results)
        out.append(Measurement(case, ranks, seconds, spec, assumptions))
    return out


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One quantity: `measured` on each rank against `predicted` (bytes per GPU).

    rtol None: every rank must equal the prediction exactly (up to float rounding of the
    prediction). Otherwise one-sided: predicted <= measured <= predicted * (1 + rtol) on the most
    loaded rank (the plan's accounting is a lower bound of what a real model keeps)."""

    quantity: str
    per_rank: tuple[int, ...]
    predicted: float
    rtol: float | None = None
    # exact checks only: each rank's own prediction (ZeRO: replicas hold different shares);
    # `predicted` is then the most loaded rank's
    predicted_per_rank: tuple[float, ...] | None = None

    @property
    def measured(self) -> int:
        """The most loaded rank's value."""
        return max(self.per_rank)

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else (1.0 if self.measured == 0 else math.inf)

    @property
    def ok(self) -> bool:
        if self.rtol is None:
            expected = self.predicted_per_rank or (self.predicted,) * len(self.per_rank)
            return len(expected) == len(self.per_rank) and all(
                math.isclose(m, e, rel_tol=1e-12, abs_tol=1e-6) for m, e in zip(self.per_rank, expected, strict=True)
            )
        return self.predicted <= self.measured <= self.predicted * (1 + self.rtol)


@dataclass(frozen=True)
class ValidationRow:
    """One case: its checks, the bytes sent per collective kind (most loaded rank) and time."""

    case: ValidationCase
    checks: tuple[Check, ...]
    comm_by_kind: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[str]:
        return [c.quantity for c in self.checks if not c.ok]

    def check(self, quantity: str) -> Check:
        return next(c for c in self.checks if c.quantity == quantity)


def predicted_activations(model: ModelSpec, layout: Layout, precision: Precision, assumptions: Assumptions) -> float:
    """The plan's per-GPU activations for `layout` without the attention core's s x s softmax
    (SDPA's fused kernel keeps none): estimate(...).memory.activations minus, per layer, the
    difference between no and selective recomputation (Korthikanti Table 2)."""
    est = _estimate(model, layout, precision, assumptions)
    kw = dict(
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        activation_bytes=precision.activation_bytes,
        implementation=assumptions.implementation,
    )
    none, selective = (
        layer_activation_bytes(model, layout.micro_batch, recompute=r, **kw) for r in ("none", "selective")
    )
    return est.memory.activations - model.layers * (none - selective)


def hf_llama_extra_activations(model: ModelSpec, layout: Layout, precision: Precision) -> float:
    """Bytes an HF Llama sharded by tplayers keeps for backward beyond the plan's accounting, per
    GPU per micro-batch (read off transformers' LlamaRMSNorm and torch's fused CPU SDPA):

    - each RMSNorm keeps an fp32 copy of its input (4h per row; for fp32 models the input
      itself), the fp32 1/rms (4 per row) and the normalised input in the model's dtype (d*h),
      where the plan counts its input (d*h): 4h + 4 bytes per row more. Rows: s*b, /t for the
      blocks' norms under sequence parallelism (the final norm sees the whole sequence);
    - RoPE's cos and sin, (s, head_dim) each in the model's dtype, shared by the layers;
    - SDPA's fp32 log-sum-exp per local head and row;
    - the embedding's local token ids (int64) and out-of-shard mask (bool);
    - the cross-entropy's targets (int64), per-row log-sum-exp (fp32), valid mask (bool) and
      count (one int64).
    """
    s, b, h, t = model.seq_len, layout.micro_batch, model.hidden, layout.tp
    d = precision.activation_bytes
    rows = s * b
    block_rows = rows / (t if layout.sequence_parallel else 1)
    norms = (2 * model.layers * block_rows + rows) * (4 * h + 4)
    rope = 2 * s * model.head_dim * d
    log_sum_exp = model.layers * b * (model.heads // t) * s * 4
    embedding_ids = rows * (8 + 1)
    cross_entropy = rows * (8 + 4 + 1) + 8
    return norms + rope + log_sum_exp + embedding_ids + cross_entropy


def _estimate(model, layout, precision, assumptions):
    cluster = ClusterSpec.preset("h100-80gb", num_gpus=layout.num_gpus)
    return estimate(model, cluster, layout, precision, assumptions=assumptions)  # ValueError if invalid


def compare(
    measurement: Measurement,
    *,
    model: ModelSpec | None = None,
    precision: Precision | None = None,
    assumptions: Assumptions | None = None,
    activation_rtol: float = DEFAULT_ACTIVATION_RTOL,
) -> ValidationRow:
    """Check `measurement` against the plan's estimate for its layout. `precision` defaults to
    the case's (`TPLAYERS_PRECISIONS`), `model` / `assumptions` to the measurement's; passing
    others is how a wrong prediction is shown to fail (the negative control).

    Checks: "comm tp", "comm dp", "comm total" (the last two not for ZeRO 1-3, whose engines
    send outside `tplayers.count_bytes`), "params", "grads", "optimizer" exact on every rank (each
    replica its own prediction); "activations" measured / plan in [1, 1 + activation_rtol]; "activations+hf" exact
    against the plan plus `hf_llama_extra_activations` (every byte accounted for)."""
    case = measurement.case
    spec = measurement.model if model is None else model
    precision = case.precision if precision is None else precision
    assumptions = measurement.assumptions if assumptions is None else assumptions
    est = _estimate(spec, case.layout, precision, assumptions)
    by_group, mem, ranks = est.comm_bytes_by_group, est.memory, measurement.ranks
    activations = predicted_activations(spec, case.layout, precision, assumptions)
    measured = {name: tuple(getattr(r, name) for r in ranks) for name in RankMeasurement.QUANTITIES}
    layout = case.layout
    # Each rank's model states, its replica's (ranks: tp fastest, then dp)
    per_dp = model_state_bytes_per_rank(spec, layout, precision, assumptions=assumptions)
    states = [tuple(per_dp[r // layout.tp][i] for r in range(len(ranks))) for i in range(3)]
    comm = [Check("comm tp", measured["comm_tp"], by_group["tp"])]
    if not layout.zero_stage:  # ZeRO's engines send outside tplayers.count_bytes: not measured
        comm += [
            Check("comm dp", measured["comm_dp"], by_group["dp"]),
            Check("comm total", measured["comm"], sum(by_group.values())),
        ]
    checks = (
        *comm,
        Check("params", measured["params"], mem.params, predicted_per_rank=states[0]),
        Check("grads", measured["grads"], mem.grads, predicted_per_rank=states[1]),
        Check("optimizer", measured["optimizer"], mem.optimizer, predicted_per_rank=states[2]),
        Check("activations", measured["activations"], activations, activation_rtol),
        Check(
            "activations+hf",
            measured["activations"],
            activations + hf_llama_extra_activations(spec, case.layout, precision),
        ),
    )
    busiest = max(ranks, key=lambda r: r.comm)
    return ValidationRow(case, checks, dict(busiest.comm_by_kind), measurement.seconds)


def validate(
    layouts=None,
    *,
    model: ModelSpec | None = None,
    nprocs_max: int = 4,
    activation_rtol: float = DEFAULT_ACTIVATION_RTOL,
    seed: int = 0,
    pool=None,
) -> list[ValidationRow]:
    """Measure each case (`measure`) and check it against the plan (`compare`); one row per case.
    `all_ok(rows)` (or `row.ok`) tells whether every check passed; `format_validation(rows)`
    prints them."""
    measurements = measure(layouts, model=model, nprocs_max=nprocs_max, seed=seed, pool=pool)
    return [compare(m, activation_rtol=activation_rtol) for m in measurements]


def all_ok(rows) -> bool:
    """True when every check of every row passed (and there was at least one row)."""
    rows = list(rows)
    return bool(rows) and all(row.ok for row in rows)


def _fmt_tol(check: Check) -> str:
    return "exact" if check.rtol is None else f"[1, {1 + check.rtol:g}]"


def format_validation(rows) -> str:
    """A table: per case and quantity, measured (most loaded rank) vs predicted bytes per GPU."""
    header = f"{'case':<23}{'quantity':<15}{'measured':>12}{'predicted':>14}{'ratio':>8}  {'allowed':<11}{'':>4}"
    lines = [header, "-" * len(header)]
    for row in rows:
        for i, c in enumerate(row.checks):
            name = row.case.name if i == 0 else ""
            lines.append(
                f"{name:<23}{c.quantity:<15}{c.measured:>12,}{c.predicted:>14,.0f}{c.ratio:>8.3f}  "
                f"{_fmt_tol(c):<11}{'ok' if c.ok else 'FAIL':>4}"
            )
        kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(row.comm_by_kind.items())) or "none"
        lines.append(f"{'':<23}sent by kind: {kinds}; {row.seconds:.1f} s")
    passed = sum(row.ok for row in rows)
    lines.append(f"{passed}/{len(rows)} layouts agree with the plan" + ("" if passed == len(rows) else " -- FAILED"))
    return "\n".join(lines)
