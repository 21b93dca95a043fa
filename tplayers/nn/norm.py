"""`ParallelRMSNorm`: an RMSNorm over a dimension split across the tensor-parallel group.

Some models normalise a whole projection's output (OLMo2's q_norm / k_norm span every head),
which column parallelism leaves split over the ranks. Each rank holds its slice of the weight
(placement Shard(0)) and of the input; the mean of squares is over the whole dimension: each
rank's sum of squares is summed over the group (one all-reduce of one number per token, and one
more in backward, `sum_over_tp_region`), then every rank normalises its own slice. Forward and
backward equal the unsharded norm's up to the order of that sum.

    y = weight * (x * rsqrt(mean(x^2) + eps))   in fp32, cast back to x's dtype
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from tplayers.distributed import resolve_group
from tplayers.functional.collectives import own_slice, sum_over_tp_region
from tplayers.nn.linear import _divide
from tplayers.placement import PlacedModule


class ParallelRMSNorm(PlacedModule):
    """RMSNorm of `hidden_size` features, of which this rank holds the r-th contiguous slice.

    Input (..., hidden_size / n), the rank's slice of the features; output likewise."""

    _placements = {"weight": Shard(0)}

    def __init__(self, hidden_size, eps=1e-6, *, group=None, device=None, dtype=None):
        super().__init__()
        self.group = resolve_group(group)
        self.tp_size = dist.get_world_size(self.group)
        self.hidden_size, self.eps = hidden_size, eps
        local = _divide(hidden_size, self.tp_size, "ParallelRMSNorm hidden_size")
        self.weight = nn.Parameter(torch.ones(local, device=device, dtype=dtype))
        self._keep_placements()

    @classmethod
    def from_weight(cls, weight, eps, *, group=None):
        """The layer holding this rank's slice of the unsharded norm `weight` (left unchanged)."""
        layer = cls(weight.shape[0], eps, group=group, device="meta", dtype=weight.dtype)
        layer.weight = nn.Parameter(own_slice(weight.detach(), 0, layer.group).to(weight.device, copy=True))
        layer._tag_parameters()
        return layer

    def forward(self, x):
        if x.shape[-1] != self.weight.shape[0]:  # every rank sees the same shapes: all raise together
            raise ValueError(
                f"ParallelRMSNorm: input last dim {x.shape[-1]} is not this rank's {self.weight.shape[0]} "
                f"of {self.hidden_size} features"
            )
        h = x.float()
        squares = sum_over_tp_region(h.pow(2).sum(-1, keepdim=True), self.group)
        h = h * torch.rsqrt(squares / self.hidden_size + self.eps)
        return (self.weight * h).to(x.dtype)

    def extra_repr(self):
        return f"{self.hidden_size} ({self.weight.shape[0]} per rank of {self.tp_size}), eps={self.eps}"
