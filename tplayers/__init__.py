"""tplayers: tensor-parallel transformer layers on fused Triton GEMMs with overlapped communication."""

from tplayers.amp import DynamicLossScaler
from tplayers.attention import ParallelAttention
from tplayers.backend import get_backend, set_backend
from tplayers.clip import clip_grad_norm_
from tplayers.distributed import RankError, init_mesh, launch
from tplayers.embedding import VocabParallelEmbedding
from tplayers.functional.comm import count_bytes
from tplayers.functional.cross_entropy import vocab_parallel_cross_entropy
from tplayers.layers import ColumnParallelLinear, RowParallelLinear
from tplayers.master import MixedPrecisionOptimizer
from tplayers.mlp import ParallelMLP
from tplayers.parallelize import gather_state_dict, load_full_state_dict, parallelize
from tplayers.placement import ParamPlacement, get_placement
from tplayers.train import StepResult, train_step

__all__ = [
    "ColumnParallelLinear",
    "DynamicLossScaler",
    "MixedPrecisionOptimizer",
    "ParallelAttention",
    "ParallelMLP",
    "ParamPlacement",
    "RankError",
    "RowParallelLinear",
    "StepResult",
    "VocabParallelEmbedding",
    "clip_grad_norm_",
    "count_bytes",
    "gather_state_dict",
    "get_backend",
    "get_placement",
    "init_mesh",
    "launch",
    "load_full_state_dict",
    "parallelize",
    "set_backend",
    "train_step",
    "vocab_parallel_cross_entropy",
]
