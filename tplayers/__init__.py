"""tplayers: tensor-parallel transformer layers on fused Triton GEMMs with overlapped communication."""

from tplayers.backend import get_backend, set_backend
from tplayers.distributed import RankError, init_mesh, launch
from tplayers.functional.comm import count_bytes
from tplayers.layers import ColumnParallelLinear, RowParallelLinear
from tplayers.mlp import ParallelMLP
from tplayers.placement import ParamPlacement, get_placement

__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "ParamPlacement",
    "RankError",
    "RowParallelLinear",
    "count_bytes",
    "get_backend",
    "get_placement",
    "init_mesh",
    "launch",
    "set_backend",
]
