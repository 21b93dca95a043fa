"""The placement every tplayers parameter carries: one record read by clipping, the loss
scaler, ZeRO-3 and checkpointing.

The placement types are DTensor's (`Shard(dim)` / `Replicate()`), paired with the process
group over which the parameter is sharded or replicated.
"""

from copy import deepcopy
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
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


class PlacedModule(nn.Module):
    """A module whose parameters carry placements over `self.group`, as listed in `_placements`
    ({parameter name: Shard(dim) | Replicate()}). They stay attached when the parameters are
    replaced (load_state_dict(assign=True)) or the module is deep-copied (the copy shares the
    process group: groups are never copied)."""

    _placements: dict

    def _tag_parameters(self, *_):
        for name, placement in self._placements.items():
            param = getattr(self, name, None)
            if param is not None:
                set_placement(param, self.group, placement)

    def _keep_placements(self):
        """Tag the parameters now and after every load_state_dict."""
        self._tag_parameters()
        self.register_load_state_dict_post_hook(self._tag_parameters)

    def __deepcopy__(self, memo):
        memo[id(self.group)] = self.group
        copy = self.__class__.__new__(self.__class__)
        memo[id(self)] = copy
        for key, value in self.__dict__.items():
            copy.__dict__[key] = deepcopy(value, memo)
        copy._tag_parameters()  # Parameter.__deepcopy__ drops Python attributes
        return copy
