"""DeviceMeshes for layouts smaller than the worker pool: the ("dp", "pp", "tp") mesh over the
first dp * pp * tp ranks of the pool.

Creating a process group is a collective over every rank of the default group, members or not,
so the pool runs `prepare_mesh` on all its ranks (`WorkerPool.run(..., mesh=(dp, pp, tp))`)
before the task, which then calls `layout_mesh`. Groups are created once per mesh shape and
pool: a pool reused for many checks does not pile them up.
"""

import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DIMS = ("dp", "pp", "tp")
_meshes: dict[tuple, list] = {}  # (dp, pp, tp) -> this rank's (dp, pp, tp) groups (None: not a member)


def _grid(dp, pp, tp):
    return torch.arange(dp * pp * tp).view(dp, pp, tp)


def prepare_mesh(dp: int, pp: int, tp: int) -> None:
    """Create the groups of a (dp, pp, tp) mesh over ranks 0 .. dp*pp*tp - 1; every rank of the
    default group calls it, in the same order."""
    key = (dp, pp, tp)
    if key in _meshes:
        return
    grid, rank = _grid(*key), dist.get_rank()
    mine = [None, None, None]
    for dim in range(3):
        others = [range(size) for d, size in enumerate(key) if d != dim]
        for index in itertools.product(*others):
            index = list(index)
            index.insert(dim, slice(None))
            ranks = grid[tuple(index)].tolist()
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[dim] = group
    _meshes[key] = mine


def layout_mesh(dp: int, pp: int, tp: int) -> DeviceMesh:
    """This rank's ("dp", "pp", "tp") mesh over global ranks 0 .. dp*pp*tp - 1 (tp fastest, as
    `tplayers.init_mesh` lays them out), from the groups `prepare_mesh` made."""
    groups = _meshes.get((dp, pp, tp))
    if groups is None:
        raise RuntimeError(f"layout_mesh: the ({dp}, {pp}, {tp}) mesh was not prepared (run the task with mesh=)")
    if any(g is None for g in groups):
        raise ValueError(f"layout_mesh: rank {dist.get_rank()} is not in a mesh of {dp * pp * tp} ranks")
    return DeviceMesh.from_group(groups, "cpu", mesh=_grid(dp, pp, tp), mesh_dim_names=DIMS)
