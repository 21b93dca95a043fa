"""What `estimate` returns: the memory of one GPU (`MemoryBreakdown`), each pipeline stage
(`StageEstimate`) and the whole layout (`Estimate`)."""

from __future__ import annotations

from dataclasses import dataclass

from tplayers.plan.layout import Layout


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on pipeline stage `stage`.

    `activations` is None when the model is given by its parameter count only; `total` then
    counts the model states alone. `buffers`: ZeRO-3's gathered copy of the largest unit
    (a layer, or the embedding / LM head) during its forward / backward; ZeRO-2's (FSDP2's)
    gathered copy of every parameter, held from forward through backward (its `params` are the
    shards kept between steps). With the model's dimensions the model states are counted tensor
    by tensor as tplayers' engines hold them (`zero_state_bytes_per_rank`: padding, ZeRO-1's
    whole-tensor partition), for the most loaded replica.
    """

    params: float
    grads: float
    optimizer: float
    activations: float | None
    buffers: float = 0.0
    stage: int = 0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + (self.activations or 0.0) + self.buffers


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline stage, per GPU: memory, parameters, per-step comm bytes and time parts."""

    stage: int
    num_params: float  # parameters held by one GPU before ZeRO sharding (after TP)
    memory: MemoryBreakdown
    hardware_flops: float | None  # per GPU per step
    comm_bytes_by_group: dict[str, float | None]  # "tp" | "pp" | "dp" -> bytes per GPU per step
    time_breakdown: dict[str, float] | None  # seconds: compute, bubble, tp, pp, dp, optimizer
    comm_bytes_by_axis: dict[str, float] | None = None  # a grid's "tp" bytes split: "tp_r", "tp_c"

    @property
    def step_time_s(self) -> float | None:
        return None if self.time_breakdown is None else sum(self.time_breakdown.values())


@dataclass(frozen=True)
class Estimate:
    """The estimate of one layout; see the `tplayers.plan` docstring for per-GPU / per-job conventions.

    Invalid layouts (`valid` False) carry their `reasons` and None for every number.
    """

    layout: Layout
    num_gpus: int
    num_params: float
    usable_hbm_bytes: float
    reasons: tuple[str, ...]
    valid: bool
    memory: MemoryBreakdown | None = None
    stages: tuple[StageEstimate, ...] = ()
    model_flops: float | None = None  # per step, whole job, no recompute
    hardware_flops: float | None = None  # per step, whole job, with recompute and padded vocab
    bubble_fraction: float | None = None  # bubble / ideal time
    comm_bytes: dict[str, float] | None = None  # link class -> bytes sent per GPU per step
    comm_bytes_by_group: dict[str, float | None] | None = None  # "tp" | "pp" | "dp" -> bytes
    comm_links: dict[str, str] | None = None  # "tp" | "pp" | "dp" (and a grid's "tp_r", "tp_c") -> link class
    comm_bytes_by_axis: dict[str, float] | None = None  # a grid's "tp" bytes per axis: "tp_r", "tp_c"
    critical_stage: int | None = None
    time_breakdown: dict[str, float] | None = None
    step_time_s: float | None = None
    mfu: float | None = None
    tokens_per_step: int | None = None
    notes: tuple[str, ...] = ()
    # the most loaded TP rank's layer parameters over the mean rank's (1.0: every split divides)
    tp_imbalance: float | None = None

    @property
    def fits(self) -> bool:
        """Valid and memory.total <= usable HBM (capacity * (1 - reserve))."""
        return self.valid and self.memory is not None and self.memory.total <= self.usable_hbm_bytes

    @property
    def tokens_per_s(self) -> float | None:
        if self.step_time_s is None or self.tokens_per_step is None:
            return None
        return self.tokens_per_step / self.step_time_s
