"""`ParallelRMSNorm`: an RMSNorm over a dimension split across the tensor-parallel group (and
`ParallelLayerNorm`, `ParallelL2Norm`, its LayerNorm and unweighted unit-norm cousins); and
`RMSNorm`, HF's LlamaRMSNorm (whole on every rank) in one fused kernel each way
(tplayers.functional.rms_norm).

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
from torch.distributed.tensor import Replicate, Shard

from tplayers.distributed import grid_groups, is_grid, resolve_group
from tplayers.functional.collectives import copy_to_tp_region, own_slice, sum_over_tp_region
from tplayers.functional.rms_norm import rms_norm
from tplayers.nn.linear import _split
from tplayers.placement import PlacedModule


class ParallelRMSNorm(PlacedModule):
    """RMSNorm of `hidden_size` features, of which this rank holds the r-th contiguous slice.

    Input (..., local), the rank's slice of the features; output likewise. The slices are as
    torch.chunk splits hidden_size, or `split_sizes` whole units of `split_unit` features per rank
    (OLMo2's norms follow their projection's heads: units of head_dim). On a 2-D tensor-parallel
    mesh (`group=init_mesh(tp=(r, c))["tp_r", "tp_c"]`) the features split over tp_c and stay
    whole over tp_r: the grid's residual stream (`tplayers.nn.grid`). With sequence_parallel=True
    (a grid only) each row of the grid normalises its part of the sequence: the weight's
    gradient is summed over tp_r as it is computed, so every rank holds the whole of it."""

    _placements = {"weight": Shard(0)}

    def __init__(self, hidden_size, eps=1e-6, *, group=None, split_unit=1, split_sizes=None, sequence_parallel=False,
                 device=None, dtype=None):  # fmt: skip
        super().__init__()
        if sequence_parallel and not is_grid(group):
            raise ValueError(
                "ParallelRMSNorm: sequence_parallel=True takes a 2-D tensor-parallel mesh (on a 1-D group the "
                "features are split and the sequence whole)"
            )
        # under sequence parallelism: the tp_r group the weight's gradient is summed over
        self.sequence_group = grid_groups(group)["tp_r"] if sequence_parallel else None
        self.group = grid_groups(group)["tp_c"] if is_grid(group) else resolve_group(group)
        self.tp_size = dist.get_world_size(self.group)
        self.hidden_size, self.eps = hidden_size, eps
        if hidden_size % split_unit:
            raise ValueError(f"ParallelRMSNorm: hidden_size {hidden_size} is not in whole units of {split_unit}")
        self.split_unit = split_unit
        self.split_sizes = _split(hidden_size, split_unit, split_sizes, self.group, "ParallelRMSNorm")
        local = self.split_sizes[dist.get_rank(self.group)] * split_unit
        self.weight = nn.Parameter(torch.ones(local, device=device, dtype=dtype))
        self._keep_placements()

    @classmethod
    def from_weight(cls, weight, eps, *, group=None, **split):
        """The layer holding this rank's slice of the unsharded norm `weight` (left unchanged);
        `split`: split_unit / split_sizes / sequence_parallel as the constructor takes them."""
        layer = cls(weight.shape[0], eps, group=group, device="meta", dtype=weight.dtype, **split)
        local = own_slice(weight.detach(), 0, layer.group, layer.split_unit, layer.split_sizes)
        layer.weight = nn.Parameter(local.to(weight.device, copy=True))
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
        weight = self.weight
        if self.sequence_group is not None:  # this rank's tokens only: the gradient summed over tp_r
            weight = copy_to_tp_region(weight, self.sequence_group)
        return (weight * h).to(x.dtype)

    def extra_repr(self):
        sp = ", sequence_parallel=True" if self.sequence_group is not None else ""
        return f"{self.hidden_size} ({self.weight.shape[0]} per rank of {self.tp_size}), eps={self.eps}{sp}"


class ParallelLayerNorm(PlacedModule):
    """LayerNorm over features split across the group, this rank holding its slice of the input,
    the weight and the bias (Shard(0), split as a row layer's input: `split_unit` / `split_sizes`):
    Kosmos-2's sub-LayerNorms over every head's output and over the MLP's features, before the row
    projection. The mean, then the variance around it, are sums over the whole width: each rank's
    sum summed over the group (`sum_over_tp_region`, forward and backward; two passes, as torch's
    LayerNorm centres before squaring), then every rank normalises its own slice, in fp32.

        y = (x - mean(x)) * rsqrt(var(x) + eps) * weight + bias"""

    _placements = {"weight": Shard(0), "bias": Shard(0)}

    def __init__(self, hidden_size, eps=1e-5, *, group=None, split_unit=1, split_sizes=None, bias=True,
                 device=None, dtype=None):  # fmt: skip
        super().__init__()
        self.group = resolve_group(group)
        self.tp_size = dist.get_world_size(self.group)
        self.hidden_size, self.eps, self.split_unit = hidden_size, eps, split_unit
        self.split_sizes = _split(hidden_size, split_unit, split_sizes, self.group, "ParallelLayerNorm")
        local = self.split_sizes[dist.get_rank(self.group)] * split_unit
        self.weight = nn.Parameter(torch.ones(local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local, device=device, dtype=dtype)) if bias else None
        self._keep_placements()

    @classmethod
    def from_norm(cls, norm: nn.LayerNorm, *, group=None, **split):
        """The layer holding this rank's slice of nn.LayerNorm `norm` (left unchanged)."""
        (size,) = norm.normalized_shape
        layer = cls(size, norm.eps, group=group, bias=norm.bias is not None, device="meta", dtype=norm.weight.dtype,
                    **split)  # fmt: skip
        for key in ("weight", "bias"):
            if getattr(norm, key) is not None:
                local = own_slice(getattr(norm, key).detach(), 0, layer.group, layer.split_unit, layer.split_sizes)
                setattr(layer, key, nn.Parameter(local.to(norm.weight.device, copy=True)))
        layer._tag_parameters()
        return layer

    def forward(self, x):
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(
                f"ParallelLayerNorm: input last dim {x.shape[-1]} is not this rank's {self.weight.shape[0]} "
                f"of {self.hidden_size} features"
            )
        h = x.float()
        centred = h - sum_over_tp_region(h.sum(-1, keepdim=True), self.group) / self.hidden_size
        variance = sum_over_tp_region(centred.pow(2).sum(-1, keepdim=True), self.group) / self.hidden_size
        y = centred * torch.rsqrt(variance + self.eps) * self.weight.float()
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)

    def extra_repr(self):
        return f"{self.hidden_size} ({self.weight.shape[0]} per rank of {self.tp_size}), eps={self.eps}"


class ParallelL2Norm(nn.Module):
    """x / |x| over features split across the group, y = x * rsqrt(sum(x^2) + eps) in fp32, cast back
    to x's dtype (nGPT's projection onto the unit sphere: Dory's sub-norms before a row projection).
    No weight; each rank's sum of squares is summed over the group (`sum_over_tp_region`: forward
    and backward), then every rank scales its own slice."""

    def __init__(self, eps=1e-6, *, group=None):
        super().__init__()
        self.group, self.eps = resolve_group(group), eps

    def forward(self, x):
        h = x.float()
        squares = sum_over_tp_region(h.pow(2).sum(-1, keepdim=True), self.group)
        return (h * torch.rsqrt(squares + self.eps)).to(x.dtype)

    def extra_repr(self):
        return f"eps={self.eps}, over {dist.get_world_size(self.group)} ranks"


class ComputedRowsRMSNorm(PlacedModule):
    """RMSNorm of `hidden_size` features of which each rank computes given rows, some on several
    ranks or more than once on one (OLMo2's k_norm where each rank computes the keys its query
    heads read: fewer key/value heads than ranks, or query heads straddling key/value groups).

    `rows[r]`: the features rank r's input holds, in order. The weight is whole on every rank
    (placement Replicate()), read at this rank's rows through `copy_to_tp_region`, whose backward
    sums its gradient over the group (each copy of a feature received its part). The sum of
    squares counts each feature once over the group: the first copy of it, in rank order, adds it,
    the others multiply it by zero. The input gradients of the copies add up, through the
    projection that computed them, to the unsharded one."""

    _placements = {"weight": Replicate()}

    def __init__(self, weight, eps, rows: list[torch.Tensor], *, group=None):
        super().__init__()
        self.group = resolve_group(group)
        rank = dist.get_rank(self.group)
        self.hidden_size, self.eps = weight.shape[0], eps
        self.weight = nn.Parameter(weight.detach().clone())
        seen, counted = set(), []
        for r, own in enumerate(rows):
            for row in own.tolist():
                if r == rank:
                    counted.append(row not in seen)
                seen.add(row)
        self.register_buffer("rows", rows[rank].clone(), persistent=False)
        self.register_buffer("counted", torch.tensor(counted, dtype=torch.float32), persistent=False)
        self._keep_placements()

    def forward(self, x):
        if x.shape[-1] != self.rows.numel():
            raise ValueError(
                f"ComputedRowsRMSNorm: input last dim {x.shape[-1]} is not this rank's {self.rows.numel()}"
            )
        h = x.float()
        squares = sum_over_tp_region((h.pow(2) * self.counted).sum(-1, keepdim=True), self.group)
        h = h * torch.rsqrt(squares / self.hidden_size + self.eps)
        return (copy_to_tp_region(self.weight, self.group)[self.rows] * h).to(x.dtype)

    def extra_repr(self):
        return f"{self.hidden_size} (whole on every rank, {self.rows.numel()} rows computed here), eps={self.eps}"


class ParallelGatedRMSNorm(PlacedModule):
    """The gated RMSNorm of a Mamba 2 mixer over groups that span the tensor-parallel ranks (one
    group over every head, as most Mamba 2 checkpoints have): each rank holds the weight of its
    own heads' features (placement Shard(0)) and normalises them by the mean of squares over the
    whole group (each rank's sum of squares summed over the group, `sum_over_tp_region`), in the
    order of operations of the model's own norm (`gated_rms_norm`), up to the order of that sum."""

    _placements = {"weight": Shard(0)}

    def __init__(self, weight, eps, group_size, *, group=None, norm_before_gate=False, weight_in_fp32=False):
        super().__init__()
        self.group = resolve_group(group)
        self.group_size, self.eps = group_size, eps
        self.variance_epsilon = eps  # the name the mixers' forwards read (transformers' norms)
        self.norm_before_gate, self.weight_in_fp32 = norm_before_gate, weight_in_fp32
        self.weight = nn.Parameter(weight.detach().clone())
        self._keep_placements()

    def forward(self, x, gate=None):
        return gated_rms_norm(x, gate, self.weight, self.eps, self.group_size, norm_before_gate=self.norm_before_gate,
                              weight_in_fp32=self.weight_in_fp32, group=self.group)  # fmt: skip

    def extra_repr(self):
        return f"{self.weight.shape[0]} of a group of {self.group_size} features, eps={self.eps}"


def gated_rms_norm(x, gate, weight, eps, group_size, *, norm_before_gate=False, weight_in_fp32=False, group=None):
    """x normalised over groups of `group_size` features (the last dim: whole groups, or with
    `group` this rank's part of one group spanning the ranks) and gated by silu(gate), in fp32:

        transformers' MambaRMSNormGated (Mamba 2, Bamba, Nemotron-H, Granite-4, Zamba2):
            h = x * silu(gate);  weight * (h * rsqrt(mean(h^2) + eps)).to(x's dtype)
        Falcon-H1's (weight_in_fp32; the gate before or after the norm):
            (weight * (h * rsqrt(mean(h^2) + eps))) [* silu(gate)], then to x's dtype"""
    h = x.float()
    if gate is not None and not norm_before_gate:
        h = h * nn.functional.silu(gate.float())
    shape = h.shape
    if group is None:
        h = h.view(*shape[:-1], -1, group_size)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    else:
        h = h * torch.rsqrt(sum_over_tp_region(h.pow(2).sum(-1, keepdim=True), group) / group_size + eps)
    h = h.reshape(shape)
    if not weight_in_fp32:
        return weight * h.to(x.dtype)
    h = weight * h
    if gate is not None and norm_before_gate:
        h = h * nn.functional.silu(gate.float())
    return h.to(x.dtype)


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm, y = weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype), through the fused
    RMSNorm kernels (the torch backend runs HF's own ops). The weight is whole (replicated); built
    from an HF norm it holds that norm's Parameter itself, so the parameter's name, placement
    record and gradient hooks stay as they were."""

    def __init__(self, hidden_size, eps=1e-6, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps  # HF's name: code that reads a norm's epsilon finds it

    @classmethod
    def from_norm(cls, norm):
        """The fused norm holding `norm`'s weight Parameter and epsilon (`norm` is left as it was)."""
        layer = cls(norm.weight.shape[0], float(norm.variance_epsilon), device="meta")
        layer.weight = norm.weight
        layer.train(norm.training)
        return layer

    def forward(self, x):
        return rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
