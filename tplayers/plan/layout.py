"""What one estimate chooses and assumes: the parallel `Layout` (tp x pp x dp, ZeRO stage,
micro-batching, recomputation, pipeline schedule, rank order) and the cost model's `Assumptions`."""

from __future__ import annotations

from dataclasses import dataclass

from tplayers.data_parallel.compress import Compression
from tplayers.plan.specs import (
    IMPLEMENTATION_CHOICES,
    RANK_ORDER_CHOICES,
    RECOMPUTE_CHOICES,
    SCHEDULE_CHOICES,
    ZERO_STAGES,
    _choice,
    _fraction,
    _positive_int,
    _positive_number,
)


@dataclass(frozen=True)
class Layout:
    """One parallel layout: tp x pp x dp GPUs, ZeRO stage, micro-batching, recomputation.

    `tp` is the tensor-parallel degree, or an (r, c) grid (`tplayers.init_mesh(tp=(r, c))`, 2-D
    tensor parallelism, `tplayers.plan.grid`): `Layout(tp=(4, 4))` keeps `tp` = 16 and
    `tp_grid` = (4, 4). `micro_batch` is sequences per micro-batch per DP replica; `num_microbatches` micro-batches
    per step (gradient accumulation / pipeline), so the global batch is
    dp * micro_batch * num_microbatches sequences. `virtual_stages` (model chunks per GPU)
    only with `schedule="interleaved"`. `ep` spreads a mixture of experts' experts whole over ep of
    the dp replicas (`tplayers.init_mesh(dp=..., ep=...)`): ep divides dp, and each expert's
    gradients are reduced over its dp / ep replicas (`tplayers.plan.experts`).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    num_microbatches: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    rank_order: str = "tp-dp-pp"
    compress: str | None = None  # data_parallel(compress=...): "bf16", "int8", "topk:<f>", "powersgd:rank=<r>"
    tp_grid: tuple[int, int] | None = None  # (tp_r, tp_c) of a 2-D tensor-parallel grid; tp = r * c
    ep: int = 1  # expert parallelism, folded over the dp replicas (init_mesh(dp=, ep=)): ep divides dp
    cp: int = 1  # context parallelism: each sequence split over cp ranks through attention (tplayers.plan.context)

    def __post_init__(self):
        if isinstance(self.tp, (tuple, list)):
            if self.tp_grid is not None and tuple(self.tp_grid) != tuple(self.tp):
                raise ValueError(f"Layout: tp={self.tp!r} and tp_grid={self.tp_grid!r} disagree")
            object.__setattr__(self, "tp_grid", self.tp)
            object.__setattr__(self, "tp", None)
        if self.tp_grid is not None:
            grid = tuple(self.tp_grid)
            if len(grid) != 2:
                raise ValueError(f"Layout: a tensor-parallel grid is (tp_r, tp_c), got {self.tp_grid!r}")
            for name, value in zip(("tp_r", "tp_c"), grid, strict=True):
                _positive_int("Layout", name, value)
            if self.tp not in (None, 1, grid[0] * grid[1]):
                raise ValueError(f"Layout: tp={self.tp} is not tp_grid {grid[0]} x {grid[1]}")
            object.__setattr__(self, "tp_grid", grid)
            object.__setattr__(self, "tp", grid[0] * grid[1])
        for name in ("tp", "pp", "dp", "micro_batch", "num_microbatches", "virtual_stages", "ep", "cp"):
            _positive_int("Layout", name, getattr(self, name))
        if self.cp > 1 and (self.tp_grid or self.ep > 1):
            raise ValueError("Layout: cp with a 2-D tensor-parallel grid or with ep is not supported")
        if self.dp % self.ep:
            raise ValueError(
                f"Layout: ep ({self.ep}) must divide dp ({self.dp}): expert parallelism folds over the replicas"
            )
        if isinstance(self.zero_stage, bool) or self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"unknown zero_stage {self.zero_stage!r}; valid: 0, 1, 2, 3")
        _choice(self.recompute, RECOMPUTE_CHOICES, "recompute")
        _choice(self.schedule, SCHEDULE_CHOICES, "schedule")
        _choice(self.rank_order, RANK_ORDER_CHOICES, "rank_order")
        if self.compress is not None:
            compression = Compression.parse(self.compress)  # a clear error for a bad spec
            compression.check_stage(self.zero_stage)
            if isinstance(self.compress, Compression):  # kept as its spec: reports, CSV
                object.__setattr__(self, "compress", compression.spec())

    @property
    def compression(self) -> Compression | None:
        return Compression.parse(self.compress)

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.dp * self.micro_batch * self.num_microbatches

    def describe(self) -> str:
        tp = f"{self.tp_grid[0]}x{self.tp_grid[1]}" if self.tp_grid else self.tp
        parts = [f"tp={tp}", f"pp={self.pp}", f"dp={self.dp}", f"zero={self.zero_stage}"]
        if self.ep > 1:
            parts.insert(3, f"ep={self.ep}")
        if self.cp > 1:
            parts.insert(2, f"cp={self.cp}")
        parts.append(f"mb={self.micro_batch}x{self.num_microbatches}")
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(f"recompute={self.recompute}")
        if self.compress:
            parts.append(f"compress={self.compress}")
        if self.pp > 1:
            v = f"(v={self.virtual_stages})" if self.schedule == "interleaved" else ""
            parts.append(f"{self.schedule}{v}")
        return " ".join(parts)


@dataclass(frozen=True)
class Assumptions:
    """Knobs of the time and memory model that are assumptions, not measurements.

    compute_efficiency: achieved / peak FLOP/s of the matmuls (0.5: Megatron-LM reaches 44-52%
        of A100 peak on 1.7B-1T GPT models, Narayanan et al. 2021 Table 1).
    tp_comm_overlap, pp_comm_overlap: fraction of TP / PP communication time hidden behind
        compute (0: exposed, Megatron's behaviour without its overlap options).
    overlap_dp_comm: DP gradient reduction overlaps the backward pass, except the last bucket
        (`DP_BUCKET_PARAMS`) and whatever does not fit behind the backward of the last
        micro-batch (ZeRO 0/1) or behind all compute (ZeRO 2/3, reduced every micro-batch).
    hbm_reserve_fraction: HBM kept out of reach for the CUDA context, NCCL buffers and
        allocator fragmentation; `fits` means total <= hbm_bytes * (1 - reserve).
    vocab_divisible_by: Megatron's vocabulary padding multiple (times tp); implementation
        "tplayers" pads nothing (it splits the vocabulary unevenly).
    implementation: whose layers the model's edges follow; the transformer layers are priced
        alike. "megatron" (Megatron-LM, the published accounting): the cross-entropy
        all-reduces three s*b fp32 vectors and keeps fp32 logits; under sequence parallelism the
        embedding reduce-scatters and the LM head all-gathers. "tplayers" (what
        `tplayers.parallelize` + `vocab_parallel_cross_entropy` do, checked by
        `tplayers.plan.validate`): the cross-entropy all-gathers 5 fp32 values per row (4
        statistics and the target id) and keeps the logits in the activation dtype; under
        sequence parallelism the embedding all-reduces, the first block keeps its sequence
        slice (an all-gather in backward), the last block's output is all-gathered (the final
        norm and LM head see the whole sequence), and column-parallel layers keep their
        all-gathered input for the weight gradient instead of re-gathering it.
    routing_imbalance: the most loaded expert-parallel rank's (token, expert) pairs over the mean
        rank's, for a mixture of experts (1.0: uniform routing; `bench/moe.py` measured 1.17 on
        a small Qwen3-MoE with its auxiliary loss). Its grouped GEMM, received rows and
        all-to-all bytes scale by it; the step waits for it.
    grouped_gemm_efficiency: achieved / peak FLOP/s of the experts' grouped GEMM (None: the
        same as `compute_efficiency`); lower where each expert gets few rows.
    """

    compute_efficiency: float = 0.5
    tp_comm_overlap: float = 0.0
    pp_comm_overlap: float = 0.0
    overlap_dp_comm: bool = True
    hbm_reserve_fraction: float = 0.1
    vocab_divisible_by: int = 128
    implementation: str = "megatron"
    routing_imbalance: float = 1.0
    grouped_gemm_efficiency: float | None = None

    def __post_init__(self):
        _positive_number("Assumptions", "compute_efficiency", self.compute_efficiency)
        if self.compute_efficiency > 1:
            raise ValueError(f"Assumptions.compute_efficiency must be in (0, 1], got {self.compute_efficiency!r}")
        for name in ("tp_comm_overlap", "pp_comm_overlap", "hbm_reserve_fraction"):
            _fraction("Assumptions", name, getattr(self, name))
        _positive_int("Assumptions", "vocab_divisible_by", self.vocab_divisible_by)
        _choice(self.implementation, IMPLEMENTATION_CHOICES, "implementation")
        _positive_number("Assumptions", "routing_imbalance", self.routing_imbalance)
        if self.routing_imbalance < 1:
            raise ValueError(
                f"Assumptions.routing_imbalance (the most loaded rank over the mean) must be >= 1, got "
                f"{self.routing_imbalance!r}"
            )
        if self.grouped_gemm_efficiency is not None:
            _positive_number("Assumptions", "grouped_gemm_efficiency", self.grouped_gemm_efficiency)
            if self.grouped_gemm_efficiency > 1:
                raise ValueError(
                    f"Assumptions.grouped_gemm_efficiency must be in (0, 1], got {self.grouped_gemm_efficiency!r}"
                )
