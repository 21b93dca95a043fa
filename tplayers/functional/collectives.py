"""Autograd-aware tensor-parallel collectives (Megatron's f / g operators and their SP kin).

Each Function is the adjoint pair of one collective:
    copy_to_tp_region        fwd identity            bwd all-reduce
    reduce_from_tp_region    fwd all-reduce          bwd identity
    sum_over_tp_region       fwd all-reduce          bwd all-reduce       (a sum each rank uses for its own part)
    scatter_to_tp_region     fwd keep own slice      bwd all-gather       (along `dim`)
    gather_from_tp_region    fwd all-gather          bwd keep own slice   (along `dim`)
    all_gather_sequence      fwd all-gather `dim`     bwd reduce-scatter `dim` (dim 1: the sequence)
    reduce_scatter_sequence  fwd reduce-scatter `dim` bwd all-gather `dim`

The sequence pair splits the sequence as tplayers.functional.sequence records it: evenly where no
split is open, else as the open split of a length the group need not divide.
"""

import torch
import torch.distributed as dist

from tplayers.functional import comm
from tplayers.functional.rng import leave_sharded_region
from tplayers.functional.sequence import gathered_sizes, scattered_sizes
from tplayers.placement import shard_range, shard_sizes


def all_gather_dim(x, dim, group, total=None, *, sizes=None):
    """Concatenate every rank's `x` along `dim`. `total`: the gathered size, when the ranks hold
    uneven slices of it (split as `shard_sizes` splits it); `sizes`: every rank's, when known
    otherwise; neither: every rank holds as many."""
    n = dist.get_world_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    if sizes is None:
        sizes = shard_sizes(total, n) if total is not None else [x.shape[dim]] * n
    mine = sizes[dist.get_rank(group)]
    if x.shape[dim] != mine:
        raise ValueError(f"all_gather_dim: this rank holds {x.shape[dim]} of dim {dim}, its share of {total} is {mine}")
    widest = max(sizes)
    if widest != mine:  # pad to the widest slice: the collective moves equal blocks
        x = torch.cat([x, x.new_zeros((*x.shape[:dim], widest - mine, *x.shape[dim + 1 :]))], dim)
    out = x.new_empty((n, *x.shape))
    comm.all_gather_into(out, x.contiguous(), group)
    if len(set(sizes)) > 1:
        return torch.cat([out[i].narrow(dim, 0, size) for i, size in enumerate(sizes)], dim)
    if dim == 0:
        return out.view(n * x.shape[0], *x.shape[1:])
    return out.movedim(0, dim).reshape(*x.shape[:dim], n * x.shape[dim], *x.shape[dim + 1 :])


def all_gather_any(x, dim, group):
    """`all_gather_dim` of whatever each rank holds along `dim`, in rank order, for slices whose
    sizes this rank does not know (state-dict export: a cold path): one more tiny all-gather
    learns them first."""
    if dist.get_world_size(group) == 1:
        return x
    return all_gather_dim(x, dim, group, sizes=sizes_along(x, dim, group))


def sizes_along(x, dim, group) -> list[int]:
    """Every rank's size along `dim` of its `x`, in rank order (one tiny all-gather, not counted as
    the model's traffic)."""
    sizes = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=x.device)
    comm.all_gather_into(sizes, torch.tensor([x.shape[dim]], device=x.device), group, record=False)
    return sizes.tolist()


def reduce_scatter_dim(x, dim, group, sizes=None):
    """Sum `x` over ranks and keep this rank's slice along `dim` (`sizes`: every rank's, for an
    uneven split; default an even one)."""
    n = dist.get_world_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    if sizes is not None and len(set(sizes)) > 1:  # pad each rank's block to the widest: equal blocks move
        widest, parts = max(sizes), x.split(list(sizes), dim)
        blocks = x.new_zeros((n, *x.shape[:dim], widest, *x.shape[dim + 1 :]))
        for block, part in zip(blocks, parts, strict=True):
            block.narrow(dim, 0, part.shape[dim]).copy_(part)
        out = x.new_empty(blocks.shape[1:])
        comm.reduce_scatter_into(out, blocks, group)
        mine = out.narrow(dim, 0, sizes[dist.get_rank(group)])
        return mine.clone(memory_format=torch.contiguous_format)  # its own tensor, not a view: callers add in place
    size = x.shape[dim] // n
    blocks = x.unflatten(dim, (n, size)).movedim(dim, 0).contiguous()  # (n, ..., size, ...)
    out = x.new_empty(blocks.shape[1:])
    comm.reduce_scatter_into(out, blocks, group)
    return out


def own_slice(x, dim, group, unit=1, sizes=None):
    """This rank's contiguous slice of `x` along `dim` (uneven sizes as `shard_sizes` splits them,
    or the explicit per-rank `sizes`), in whole units of `unit` entries (ParallelMLP's interleaved
    gate / up pairs: 2; attention heads: head_dim)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return x
    start, size = shard_range(x.shape[dim] // unit, n, r, sizes)
    return x.narrow(dim, start * unit, size * unit).contiguous()


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous().clone()
        comm.all_reduce(dy, ctx.group)
        return dy, None


class _ReduceFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.contiguous().clone()
        comm.all_reduce(y, group)
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _SumOverTPRegion(torch.autograd.Function):
    """A sum over the group that every rank then uses for its own part (the sum of squares of a
    norm over a split dim): each rank's gradient of it is a partial, so backward sums them too."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.contiguous().clone()
        comm.all_reduce(y, group)
        return y

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous().clone()
        comm.all_reduce(dy, ctx.group)
        return dy, None


class _ScatterToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes):
        ctx.dim, ctx.group, ctx.total, ctx.sizes = dim, group, x.shape[dim], sizes
        return own_slice(x, dim, group, sizes=sizes)

    @staticmethod
    def backward(ctx, dy):
        return all_gather_dim(dy, ctx.dim, ctx.group, ctx.total, sizes=ctx.sizes), None, None, None


class _GatherFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, total, sizes):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return all_gather_dim(x, dim, group, total, sizes=sizes)

    @staticmethod
    def backward(ctx, dy):
        return own_slice(dy, ctx.dim, ctx.group, sizes=ctx.sizes), None, None, None, None


class _AllGatherSequence(torch.autograd.Function):
    """Every rank's part of the sequence (split as tplayers.functional.sequence records it)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.sizes = group, dim, gathered_sizes(x, dim, group)
        return all_gather_dim(x, dim, group, sizes=ctx.sizes)

    @staticmethod
    def backward(ctx, dy):
        return reduce_scatter_dim(dy, ctx.dim, ctx.group, ctx.sizes), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.sizes = group, dim, scattered_sizes(x, dim, group)
        return reduce_scatter_dim(x, dim, group, ctx.sizes)

    @staticmethod
    def backward(ctx, dy):
        return all_gather_dim(dy, ctx.dim, ctx.group, sizes=ctx.sizes), None, None


# On a group of one every region function is the identity, forward and backward: it returns its
# input itself, with no autograd node, copy or collective (a model parallelized at TP 1 runs what
# the unsharded one does).


def _alone(group) -> bool:
    return dist.get_world_size(group) == 1


def copy_to_tp_region(x, group):
    return x if _alone(group) else _CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(x, group):
    if _alone(group):
        return x
    leave_sharded_region()  # a sum of the ranks' parts ends their sharded region (tplayers.functional.rng)
    return _ReduceFromTPRegion.apply(x, group)


def sum_over_tp_region(x, group):
    return x if _alone(group) else _SumOverTPRegion.apply(x, group)


def scatter_to_tp_region(x, group, dim=-1, sizes=None):
    """This rank's slice along `dim` (`sizes`: every rank's, default as `shard_sizes` splits it);
    backward all-gathers the slices."""
    return x if _alone(group) else _ScatterToTPRegion.apply(x, dim, group, sizes)


def gather_from_tp_region(x, group, dim=-1, total=None, sizes=None):
    """All-gather along `dim` (`total`: the gathered size, for uneven slices split as `shard_sizes`
    splits it; `sizes`: every rank's, split otherwise); backward keeps this rank's slice. The whole
    it makes is every rank's: a sharded region ends (tplayers.functional.rng)."""
    if _alone(group):
        return x
    leave_sharded_region()
    return _GatherFromTPRegion.apply(x, dim, group, total, sizes)


def all_gather_sequence(x, group, dim=1):
    return x if _alone(group) else _AllGatherSequence.apply(x, group, dim)


def reduce_scatter_sequence(x, group, dim=1):
    if _alone(group):
        return x
    leave_sharded_region()
    return _ReduceScatterSequence.apply(x, group, dim)
