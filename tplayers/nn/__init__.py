"""Tensor-parallel modules: column / row-parallel linear layers, attention (head split, GQA /
MQA), the gated MLP with its fused SwiGLU epilogue, and the vocabulary-parallel embedding.

    linear.py     ColumnParallelLinear, RowParallelLinear (and their shared base)
    lm_head.py    ParallelLMHead: the vocabulary-parallel LM head whose logits a fused loss may skip
    attention.py  ParallelAttention, RoPE, ReplicatedLinear
    mlp.py        ParallelMLP (one gate|up GEMM + SwiGLU), fuse / unfuse the gate|up layout
    embedding.py  VocabParallelEmbedding
    norm.py       ParallelRMSNorm (over a dimension split across the group), RMSNorm (HF's, fused kernels)
    grid.py       GridLinear: 2-D tensor parallelism, the weight split over a tp_r x tp_c grid
    grid_attention.py  GridAttention: attention on the grid (heads over tp_r, features over tp_c)

The 1-D classes refuse a 2-D mesh, naming the grid class to build; ParallelMLP, ParallelRMSNorm
and VocabParallelEmbedding take either.

May import: tplayers.functional and the foundations (backend, distributed, placement); never
anything that composes modules (train, data_parallel, pipeline, hf, checkpoint, plan, tools).
"""

from tplayers.nn.attention import ParallelAttention
from tplayers.nn.embedding import VocabParallelEmbedding
from tplayers.nn.grid import GridLinear
from tplayers.nn.grid_attention import GridAttention
from tplayers.nn.linear import ColumnParallelLinear, RowParallelLinear
from tplayers.nn.lm_head import ParallelLMHead
from tplayers.nn.mlp import ParallelMLP
from tplayers.nn.norm import ParallelRMSNorm, RMSNorm

__all__ = [
    "ColumnParallelLinear",
    "GridAttention",
    "GridLinear",
    "ParallelAttention",
    "ParallelLMHead",
    "ParallelMLP",
    "ParallelRMSNorm",
    "RMSNorm",
    "RowParallelLinear",
    "VocabParallelEmbedding",
]
