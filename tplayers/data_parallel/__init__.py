"""Data parallelism and ZeRO stages 0-3 over the data-parallel group, composed with the
tensor-parallel layers, on torch.distributed's own engines (composable DDP, ZeroRedundancyOptimizer,
FSDP2).

    wrap.py       data_parallel, ZeRO3, data_parallel_optimizer
    compress.py   Compression: bf16, int8 and top-k gradients with error feedback
    guards.py     torch's own DDP / FSDP1 refuse a group across tensor-parallel shards

May import: tplayers.nn, tplayers.functional and the foundations (backend, distributed,
placement); never tplayers.hf or anything above it.
"""

from tplayers.data_parallel import guards
from tplayers.data_parallel.compress import Compression
from tplayers.data_parallel.wrap import ZeRO3, data_parallel, data_parallel_optimizer, shard_optimizer_state

guards.install()

__all__ = ["Compression", "ZeRO3", "data_parallel", "data_parallel_optimizer", "shard_optimizer_state"]
