"""The placement every tplayers parameter carries: one record read by clipping, the loss
scaler, ZeRO-3 and checkpointing.

The placement types are DTensor's (`Shard(dim)` / `Replicate()`), paired with the process
group over which the parameter is sharded or replicated.
"""

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

_ATTR = "_tplayers_placement"


@dataclass(frozen=True)
class ParamPlacement:
    """`placement` of a parameter over `group`: Shard(dim) (rank r holds the r-th contiguous
    slice along dim) or Replicate() (every rank holds the whole tensor, with the whole grad)."""

    group: dist.ProcessGroup
    placement: Shard | Replicate

    @property
    def is_sharded(self) -> bool:
        return isinstance(self.placement, Shard)

    def __deepcopy__(self, memo):
        return self  # immutable, and a process group is shared, never copied


def set_placement(param, group, placement) -> None:
    setattr(param, _ATTR, ParamPlacement(group, placement))


def get_placement(param) -> ParamPlacement | None:
    """The placement of a tplayers parameter, or None for a parameter tplayers does not manage."""
    return getattr(param, _ATTR, None)
