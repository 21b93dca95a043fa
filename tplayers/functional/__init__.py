"""The functional layer: autograd-aware collectives, the overlap engine and the linear Functions.

    comm.py           the collectives every layer issues (one place to count bytes sent)
    collectives.py    Megatron's f / g Functions: copy / reduce / scatter / gather, sequence gather / scatter
    sequence.py       the open sequence split (any length over any group): sequence_split
    overlap.py        the overlap engine: all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce
    auto_overlap.py   overlap="auto": the per-shape choice of ring or plain path, agreed by every rank
    cost_model.py     the constants and predictions behind it (defaults, the calibrated costs file)
    linear.py         column / row-parallel linear Functions (forward, dgrad, wgrad)
    swiglu.py         the column-parallel gate|up GEMM with SwiGLU in its epilogue
    cross_entropy.py  vocab_parallel_cross_entropy
    linear_cross_entropy.py  the LM head's GEMM fused with (vocab-parallel) cross-entropy, no logits held
    rng.py            dropout in the sharded region: each rank's own stream, derived from the shared generator

May import: tplayers.kernels (lazily: `import tplayers` must not import triton) and the
foundations (backend, distributed, placement); never tplayers.nn or anything above it.
"""

from tplayers.functional.auto_overlap import OverlapDisagreement, overlap_choices, set_overlap_measuring
from tplayers.functional.collectives import (
    all_gather_sequence,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_sequence,
    scatter_to_tp_region,
    sum_over_tp_region,
)
from tplayers.functional.comm import count_bytes
from tplayers.functional.cross_entropy import vocab_parallel_cross_entropy
from tplayers.functional.linear import column_parallel_linear, row_parallel_linear
from tplayers.functional.overlap import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from tplayers.functional.sequence import sequence_split

__all__ = [
    "all_gather_matmul",
    "all_gather_sequence",
    "column_parallel_linear",
    "copy_to_tp_region",
    "count_bytes",
    "gather_from_tp_region",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "overlap_choices",
    "OverlapDisagreement",
    "reduce_from_tp_region",
    "reduce_scatter_sequence",
    "row_parallel_linear",
    "scatter_to_tp_region",
    "sequence_split",
    "set_overlap_measuring",
    "sum_over_tp_region",
    "vocab_parallel_cross_entropy",
]
