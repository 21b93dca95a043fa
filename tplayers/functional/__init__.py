"""The functional layer: autograd-aware collectives, the overlap engine and the linear Functions."""

from tplayers.functional.collectives import (
    all_gather_sequence,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_sequence,
    scatter_to_tp_region,
)
from tplayers.functional.comm import count_bytes
from tplayers.functional.cross_entropy import vocab_parallel_cross_entropy
from tplayers.functional.linear import column_parallel_linear, row_parallel_linear
from tplayers.functional.overlap import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

__all__ = [
    "all_gather_matmul",
    "all_gather_sequence",
    "column_parallel_linear",
    "copy_to_tp_region",
    "count_bytes",
    "gather_from_tp_region",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "reduce_from_tp_region",
    "reduce_scatter_sequence",
    "row_parallel_linear",
    "scatter_to_tp_region",
    "vocab_parallel_cross_entropy",
]
