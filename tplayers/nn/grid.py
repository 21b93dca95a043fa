"""2-D tensor parallelism (AxoNN's grid): a linear layer's weight sharded along both dimensions
over a tp_r x tp_c grid of ranks (`tplayers.init_mesh(tp=(r, c))["tp_r", "tp_c"]`).

`GridLinear(in, out, mesh=..., out_axis=...)`: rank (i, j) holds block (i, j) of the (out, in)
weight: the output features split over `out_axis`, the input features over the other axis. Its
input is split along the features over the input axis (and whole over the output axis); its
output along the features over the output axis (whole over the input axis):

    column-type  out_axis "tp_r": x (..., in / c) -> y (..., out / r)
    row-type     out_axis "tp_c": x (..., in / r) -> y (..., out / c)

so a column-type layer feeds a row-type one directly (AxoNN's `transpose=True` pairing), and a
row-type one the next column-type one: no re-layout between them, whatever elementwise function
sits in between. Each layer is one partial GEMM whose output is all-reduced over the input axis
(the overlap engine's matmul_all_reduce, `overlap` as for the 1-D layers), and its input gradient
all-reduced over the output axis:

    forward   y_i = sum_j x_j W_ij^T + b_i          all-reduce over the input axis
    backward  dx_j = sum_i dy_i W_ij                  all-reduce over the output axis
              dW_ij = dy_i^T x_j, db_i = sum dy_i    local, complete

A layer of T tokens sends 2 (c-1)/c x T x out/r elements forward (column-type) and
2 (r-1)/r x T x in/c backward: on a q x q grid about 1/q of a 1-D layer's per collective. Sizes
that do not divide split as torch.chunk splits them along each axis.

sequence_parallel=True shards the sequence over tp_r, the axis the residual stream is whole
over (Megatron's sequence parallelism on one axis of the grid): the residual is (B, S/r, H/c).
A column-type layer all-gathers its input along the sequence over tp_r (backward: the input
gradient reduce-scattered there, in place of the all-reduce), a row-type one reduce-scatters its
output along the sequence over tp_r (in place of the all-reduce; backward: all-gathered). The
bytes per layer are the same as without it; the activations between the layers shrink by r.

Each parameter's placement record holds one (group, placement) per sharded dimension: the
weight Shard(0) over the output axis and Shard(1) over the input axis (`ParamPlacement.grid`),
the bias Shard(0) over the output axis, whole over the input one; clipping sums partial norms
over both.
"""

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from tplayers.distributed import GRID_AXES, grid_groups
from tplayers.functional.auto_overlap import check_overlap
from tplayers.functional.collectives import all_gather_sequence, copy_to_tp_region, own_slice
from tplayers.functional.linear import row_parallel_linear
from tplayers.nn.linear import _full_linear_init, autocast_operands, check_input, tokens_as_sequence
from tplayers.placement import SharesGroups, seal, set_placement, shard_sizes

AXES = GRID_AXES


class GridLinear(SharesGroups, nn.Module):
    """y = x W^T + b with W split over both axes of a 2-D mesh (module docstring)."""

    def __init__(self, in_features, out_features, bias=True, *, mesh, out_axis="tp_r", overlap="auto",
                 out_unit=1, in_unit=1, reduce_input_grad=True, sequence_parallel=False, device=None,
                 dtype=None):  # fmt: skip
        super().__init__()
        if out_axis not in AXES:
            raise ValueError(f"GridLinear: out_axis must be one of {AXES}, got {out_axis!r}")
        groups = grid_groups(mesh)
        self.mesh, self.out_axis = mesh, out_axis
        self.in_axis = AXES[1 - AXES.index(out_axis)]
        self.out_group, self.in_group = groups[out_axis], groups[self.in_axis]
        self.in_features, self.out_features = in_features, out_features
        for what, size, unit in (("out_features", out_features, out_unit), ("in_features", in_features, in_unit)):
            if size % unit:
                raise ValueError(f"GridLinear: {what} ({size}) must be whole units of {unit}")
        # units: whole groups of rows / columns that stay together (ParallelMLP's gate / up pairs)
        self.out_unit, self.in_unit = out_unit, in_unit
        # False: the input gradient is left this rank's part over the output axis, for layers that
        # share one input whose gradient the caller sums once (q / k / v: one reduction, not three)
        self.reduce_input_grad = reduce_input_grad
        if sequence_parallel and out_axis == "tp_r" and not reduce_input_grad:
            raise ValueError(
                "GridLinear: reduce_input_grad=False applies to column-type layers only without sequence_parallel "
                "(their caller gathers the sequence once)"
            )
        self.sequence_parallel = sequence_parallel
        self.seq_group = groups["tp_r"]  # the axis the sequence is sharded over (sequence_parallel)
        self.overlap = check_overlap(overlap, "GridLinear")
        self.in_sizes = [in_unit * s for s in shard_sizes(in_features // in_unit, dist.get_world_size(self.in_group))]
        self.in_features_per_rank = self.in_sizes[dist.get_rank(self.in_group)]
        weight, full_bias = _full_linear_init(in_features, out_features, bias, device, dtype)
        self._set_shards(weight, full_bias, device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, mesh, out_axis="tp_r", **kwargs):
        """The layer holding this rank's block of `linear` (left unchanged)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, mesh=mesh, out_axis=out_axis,
                    device="meta", dtype=linear.weight.dtype, **kwargs)  # fmt: skip
        bias = linear.bias.detach() if linear.bias is not None else None
        layer._set_shards(linear.weight.detach(), bias, linear.weight.device)
        return layer

    def _set_shards(self, weight, bias, device):
        block = own_slice(own_slice(weight, 0, self.out_group, self.out_unit), 1, self.in_group, self.in_unit)
        self.weight = nn.Parameter(block.to(device=device, copy=True))
        set_placement(self.weight, self.out_group, Shard(0), grid=((self.in_group, Shard(1)),))
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(own_slice(bias, 0, self.out_group, self.out_unit).to(device=device, copy=True))
            set_placement(self.bias, self.out_group, Shard(0))
        seal(self)  # the module keeps the records: a tensor assigned in their place gets them back

    @tokens_as_sequence
    def forward(self, x):
        x, weight, bias = autocast_operands(self, x)
        check_input(self, x, self.in_features_per_rank, self.sequence_parallel, weight)
        widest = max(self.in_sizes)
        if self.sequence_parallel and self.out_axis == "tp_c":  # row-type: reduce-scattered over tp_r
            if self.reduce_input_grad:
                x = copy_to_tp_region(x, self.out_group)
            return row_parallel_linear(x, weight, bias, self.in_group, sequence_parallel=True,
                                       overlap=self.overlap, widest=widest)  # fmt: skip
        if self.sequence_parallel:  # column-type: the sequence gathered over tp_r (backward reduce-scattered)
            x = all_gather_sequence(x, self.out_group)
        elif self.reduce_input_grad:  # whole over the output axis: its gradient summed there
            x = copy_to_tp_region(x, self.out_group)
        y = row_parallel_linear(x, weight, None, self.in_group, overlap=self.overlap, widest=widest)
        return y + bias if bias is not None else y

    def extra_repr(self):
        return (
            f"in_features={self.in_features} (split over {self.in_axis}), out_features={self.out_features} "
            f"(split over {self.out_axis}), bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, "
            f"overlap={self.overlap}"
        )
