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

Pipeline cases (`PIPELINE_CASES`, pp > 1): `tplayers.pipeline_split` stages of a wider 4-layer
Llama (inside each, tensor parallelism when tp > 1) run schedule steps under
`tplayers.pipeline.trace`, which times the stages' own forward, backward and loss calls:

    in flight    most micro-batches whose activations a rank held at once, in       exact
                 units of its layers, against `microbatches_in_flight` of its stage
    bubble       (tp = 1) the ranks' mean idle share of the step (1 - compute /     [0.75, 2] x
                 step time) against the formula's share b / (1 + b), b =           (see
                 `bubble_fraction`                                                   DEFAULT_BUBBLE_RTOL)

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
from dataclasses import dataclass, field

from tplayers.plan.estimate import activation_bytes_per_rank, dp_bytes_per_rank, estimate, model_state_bytes_per_rank
from tplayers.plan.layout import Assumptions, Layout
from tplayers.plan.measure import (
    DEFAULT_ACTIVATION_RTOL,
    DEFAULT_BUBBLE_RTOL,
    DEFAULT_CASES,
    PIPELINE_CASES,
    STEP_CASES,
    TPLAYERS_PRECISIONS,
    VALIDATION_ASSUMPTIONS,
    VALIDATION_MODEL,
    Measurement,
    RankMeasurement,
    ValidationCase,
    measure,
)
from tplayers.plan.memory import layer_activation_bytes
from tplayers.plan.schedule import bubble_fraction, microbatches_in_flight
from tplayers.plan.specs import ClusterSpec, ModelSpec, Precision, head_share

__all__ = [
    "DEFAULT_CASES",
    "PIPELINE_CASES",
    "STEP_CASES",
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
    # two-sided checks: predicted * (1 - below) <= measured as the lower bound
    below: float = 0.0
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
        return self.predicted * (1 - self.below) <= self.measured <= self.predicted * (1 + self.rtol)


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


def predicted_activations(
    model: ModelSpec, layout: Layout, precision: Precision, assumptions: Assumptions, tp_rank: int = 0
) -> float:
    """The plan's activations on TP rank `tp_rank` (0: the most loaded) for `layout` (one stage)
    without the attention core's s x s softmax (SDPA's fused kernel keeps none): the planned
    activations minus, per layer, the difference between no and selective recomputation
    (Korthikanti Table 2)."""
    _estimate(model, layout, precision, assumptions)  # ValueError if invalid
    planned = activation_bytes_per_rank(model, layout, precision, assumptions=assumptions, tp_rank=tp_rank)
    kw = dict(
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        activation_bytes=precision.activation_bytes,
        implementation=assumptions.implementation,
        tp_rank=tp_rank,
    )
    none, selective = (
        layer_activation_bytes(model, layout.micro_batch, recompute=r, **kw) for r in ("none", "selective")
    )
    return planned - model.layers * (none - selective)


def hf_llama_extra_activations(model: ModelSpec, layout: Layout, precision: Precision, tp_rank: int = 0) -> float:
    """Bytes an HF Llama sharded by tplayers keeps for backward beyond the plan's accounting, per
    GPU per micro-batch (read off transformers' LlamaRMSNorm and torch's fused CPU SDPA):

    - each RMSNorm keeps an fp32 copy of its input (4h per row; for fp32 models the input
      itself), the fp32 1/rms (4 per row) and the normalised input in the model's dtype (d*h)
      (HF's ops: what `tplayers.nn.RMSNorm` runs on the torch backend, which validation uses),
      where the plan counts its input (d*h): 4h + 4 bytes per row more. Rows: s*b, /t for the
      blocks' norms under sequence parallelism (the final norm sees the whole sequence);
    - RoPE's cos and sin, (s, head_dim) each in the model's dtype, shared by the layers;
    - SDPA's fp32 log-sum-exp per local head and row;
    - the embedding's token ids (int64) and, at TP > 1, its out-of-shard mask (bool; at TP 1 it is
      nn.Embedding's own lookup);
    - the cross-entropy's targets (int64), per-row log-sum-exp (fp32), valid mask (bool) and
      count (one int64).
    """
    s, b, h, t = model.seq_len, layout.micro_batch, model.hidden, layout.tp
    d = precision.activation_bytes
    rows = s * b
    block_rows = rows / (t if layout.sequence_parallel else 1)
    norms = (2 * model.layers * block_rows + rows) * (4 * h + 4)
    rope = 2 * s * model.head_dim * d
    log_sum_exp = model.layers * b * head_share(model.heads, t, tp_rank) * s * 4
    embedding_ids = rows * (8 + (1 if t > 1 else 0))
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
    bubble_rtol: float = DEFAULT_BUBBLE_RTOL,
) -> ValidationRow:
    """Check `measurement` against the plan's estimate for its layout. `precision` defaults to
    the case's (`TPLAYERS_PRECISIONS`), `model` / `assumptions` to the measurement's; passing
    others is how a wrong prediction is shown to fail (the negative control).

    Checks: "comm tp", "comm dp", "comm total" (the last two not for ZeRO 1-3, whose engines
    send outside `tplayers.count_bytes`), "params", "grads", "optimizer" exact on every rank (each
    replica its own prediction); "activations" measured / plan in [1, 1 + activation_rtol]; "activations+hf" exact
    against the plan plus `hf_llama_extra_activations` (every byte accounted for)."""
    case = measurement.case
    if case.layout.pp > 1:
        return _compare_pipeline(measurement, bubble_rtol)
    spec = measurement.model if model is None else model
    precision = case.precision if precision is None else precision
    assumptions = measurement.assumptions if assumptions is None else assumptions
    est = _estimate(spec, case.layout, precision, assumptions)
    by_group, mem, ranks = est.comm_bytes_by_group, est.memory, measurement.ranks
    activations = predicted_activations(spec, case.layout, precision, assumptions)
    measured = {name: tuple(getattr(r, name) for r in ranks) for name in RankMeasurement.QUANTITIES}
    layout = case.layout
    # Each rank's model states, its replica's (ranks: tp fastest, then dp)
    # Each rank's model states and activations: its TP rank's shares (uneven splits), its replica's
    # (ZeRO); ranks run tp fastest, then dp
    per_tp = [model_state_bytes_per_rank(spec, layout, precision, assumptions=assumptions, tp_rank=t)
              for t in range(layout.tp)]  # fmt: skip
    states = [tuple(per_tp[r % layout.tp][r // layout.tp][i] for r in range(len(ranks))) for i in range(3)]
    hf_activations = tuple(
        predicted_activations(spec, layout, precision, assumptions, r % layout.tp)
        + hf_llama_extra_activations(spec, layout, precision, r % layout.tp)
        for r in range(len(ranks))
    )
    # each TP rank's tensors, FSDP2 padding their rows: its own dp bytes (uneven splits differ)
    dp_bytes = tuple(dp_bytes_per_rank(spec, layout, precision, assumptions=assumptions, tp_rank=r % layout.tp)
                     for r in range(len(ranks)))  # fmt: skip
    comm = [
        Check("comm tp", measured["comm_tp"], by_group["tp"]),
        Check("comm dp", measured["comm_dp"], by_group["dp"], predicted_per_rank=dp_bytes),
        Check("comm total", measured["comm"], sum(by_group.values()),
              predicted_per_rank=tuple(by_group["tp"] + by_group["pp"] + b for b in dp_bytes)),
    ]  # fmt: skip
    checks = (
        *comm,
        Check("params", measured["params"], mem.params, predicted_per_rank=states[0]),
        Check("grads", measured["grads"], mem.grads, predicted_per_rank=states[1]),
        Check("optimizer", measured["optimizer"], mem.optimizer, predicted_per_rank=states[2]),
        Check("activations", measured["activations"], activations, activation_rtol),
    )
    if not layout.tp_grid:  # HF's own norms' storage; a grid's blocks run tplayers' ParallelRMSNorm
        checks += (Check("activations+hf", measured["activations"], max(hf_activations),
                         predicted_per_rank=hf_activations),)  # fmt: skip
    busiest = max(ranks, key=lambda r: r.comm)
    return ValidationRow(case, checks, dict(busiest.comm_by_kind), measurement.seconds)


def _compare_pipeline(measurement: Measurement, bubble_rtol: float) -> ValidationRow:
    """A pipeline case: "in flight" exact on every rank (`microbatches_in_flight` of its stage);
    at tp = 1 (with TP, a stage's compute includes its waits for TP peers: measured 0.6-0.95 of
    the formula on 4 ranks over 2 cores), "bubble" the ranks' mean idle share in
    [1 - min(bubble_rtol, 0.25), 1 + bubble_rtol] x the formula's share of the step, b / (1 + b)
    with b = `bubble_fraction` (see DEFAULT_BUBBLE_RTOL)."""
    lay = measurement.case.layout
    v = lay.virtual_stages if lay.schedule == "interleaved" else 1
    ranks = measurement.ranks
    in_flight = tuple(
        microbatches_in_flight(lay.schedule, r // lay.tp, lay.pp, lay.num_microbatches, v) for r in range(len(ranks))
    )
    b = bubble_fraction(lay.pp, lay.num_microbatches, lay.schedule, v)
    bubble = sum(r.bubble for r in ranks) / len(ranks)
    checks = (Check("in flight", tuple(r.in_flight for r in ranks), max(in_flight), predicted_per_rank=in_flight),)
    if lay.tp == 1:  # with TP, a stage's compute includes waiting for its TP peers: no clean idle share
        checks += (Check("bubble", (bubble,), b / (1 + b), bubble_rtol, below=min(bubble_rtol, 0.25)),)
    return ValidationRow(measurement.case, checks, {}, measurement.seconds)


def validate(
    layouts=None,
    *,
    model: ModelSpec | None = None,
    nprocs_max: int = 4,
    activation_rtol: float = DEFAULT_ACTIVATION_RTOL,
    bubble_rtol: float = DEFAULT_BUBBLE_RTOL,
    seed: int = 0,
    pool=None,
) -> list[ValidationRow]:
    """Measure each case (`measure`) and check it against the plan (`compare`); one row per case.
    `all_ok(rows)` (or `row.ok`) tells whether every check passed; `format_validation(rows)`
    prints them."""
    measurements = measure(layouts, model=model, nprocs_max=nprocs_max, seed=seed, pool=pool)
    return [compare(m, activation_rtol=activation_rtol, bubble_rtol=bubble_rtol) for m in measurements]


def all_ok(rows) -> bool:
    """True when every check of every row passed (and there was at least one row)."""
    rows = list(rows)
    return bool(rows) and all(row.ok for row in rows)


def _fmt_tol(check: Check) -> str:
    return "exact" if check.rtol is None else f"[{1 - check.below:g}, {1 + check.rtol:g}]"


def format_validation(rows) -> str:
    """A table: per case and quantity, measured (most loaded rank) vs predicted bytes per GPU."""
    header = f"{'case':<23}{'quantity':<15}{'measured':>12}{'predicted':>14}{'ratio':>8}  {'allowed':<11}{'':>4}"
    lines = [header, "-" * len(header)]
    for row in rows:
        for i, c in enumerate(row.checks):
            name = row.case.name if i == 0 else ""
            fmt = ",.0f" if isinstance(c.measured, int) else ".3f"
            lines.append(
                f"{name:<23}{c.quantity:<15}{c.measured:>12{fmt}}{c.predicted:>14{fmt}}{c.ratio:>8.3f}  "
                f"{_fmt_tol(c):<11}{'ok' if c.ok else 'FAIL':>4}"
            )
        kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(row.comm_by_kind.items())) or "none"
        lines.append(f"{'':<23}sent by kind: {kinds}; {row.seconds:.1f} s")
    passed = sum(row.ok for row in rows)
    lines.append(f"{passed}/{len(rows)} layouts agree with the plan" + ("" if passed == len(rows) else " -- FAILED"))
    return "\n".join(lines)
