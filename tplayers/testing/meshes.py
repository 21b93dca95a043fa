"""DeviceMeshes for layouts smaller than the worker pool: the ("dp", "pp", "tp") mesh over the
first dp * pp * tp ranks of the pool, or for a 2-D tensor-parallel grid the ("dp", "pp", "tp_r",
"tp_c") mesh over dp * pp * r * c (with its flattened tensor-parallel group,
`tplayers.distributed.register_grid_group`).

Creating a process group is a collective over every rank of the default group, members or not,
so the pool runs `prepare_mesh` on all its ranks (`WorkerPool.run(..., mesh=(dp, pp, tp))`)
before the task, which then calls `layout_mesh`. Groups are created once per mesh shape and
pool: a pool reused for many checks does not pile them up.
"""

import itertools
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tplayers.distributed import register_context_data_group, register_expert_data_group, register_grid_group

DIMS = ("dp", "pp", "tp")
GRID_DIMS = ("dp", "pp", "tp_r", "tp_c")
# (dp, pp, tp) or (dp, pp, r, c) -> this rank's groups, one per dim (None: not a member)
_meshes: dict[tuple, list] = {}
# ranks -> their process group: one per set of ranks, whichever meshes share it (every group's
# connections keep a thread polling them: hundreds of duplicates slowed every later collective)
_groups: dict[tuple, object] = {}


def group_of(ranks) -> dist.ProcessGroup:
    """The pool's process group over `ranks`, made on first use (a collective over every rank of the
    default group, members or not: every rank asks for the same ranks in the same order)."""
    key = tuple(int(r) for r in ranks)
    if key not in _groups:
        _groups[key] = dist.new_group(list(key))
    return _groups[key]


def _grid(*sizes):
    return torch.arange(math.prod(sizes)).view(*sizes)


def prepare_mesh(*sizes: int) -> None:
    """Create the groups of a (dp, pp, tp) or (dp, pp, tp_r, tp_c) mesh over its first ranks; every
    rank of the default group calls it, in the same order. A grid's flattened tensor-parallel
    groups too."""
    key = tuple(sizes)
    if key in _meshes:
        return
    if key and key[0] == "ep":
        _meshes[key] = _expert_groups(*key[1:])
        return
    if key and key[0] == "cp":
        _meshes[key] = _context_groups(*key[1:])
        return
    if len(key) not in (3, 4):
        raise ValueError(f"prepare_mesh: (dp, pp, tp) or (dp, pp, tp_r, tp_c), got {key}")
    grid, rank = _grid(*key), dist.get_rank()
    mine = [None] * len(key)
    for dim in range(len(key)):
        for ranks in _lines(grid, dim):
            group = group_of(ranks)
            if rank in ranks:
                mine[dim] = group
    if len(key) == 4:  # the grid flattened: each (dp, pp) slice's r * c ranks
        for ranks in grid.reshape(key[0] * key[1], -1).tolist():
            group = group_of(ranks)
            if rank in ranks:
                register_grid_group(ranks, group)
    _meshes[key] = mine


EXPERT_DIMS = ("edp", "ep", "pp", "tp")


def mesh_ranks(key) -> int:
    """The ranks a mesh key spans: dp * pp * tp (* the grid's r * c); ("ep", dp, ep, pp, tp): dp * pp * tp;
    ("cp", dp, pp, cp, tp): dp * pp * cp * tp."""
    if key[0] == "ep":
        return math.prod(key[1:]) // key[2]
    return math.prod(key[1:]) if key[0] == "cp" else math.prod(key)


CONTEXT_DIMS = ("dp", "pp", "cp", "tp")


def _context_groups(dp, pp, cp, tp) -> dict:
    """A ("dp", "pp", "cp", "tp") mesh's groups over its first dp * pp * cp * tp ranks (as
    `tplayers.init_mesh(cp=)` lays it out), with this rank's dp x cp group registered."""
    grid, rank, mine = _grid(dp, pp, cp, tp), dist.get_rank(), {}
    for dim, name in enumerate(CONTEXT_DIMS):
        for ranks in _lines(grid, dim):
            group = group_of(ranks)
            if rank in ranks:
                mine[name] = group
    for ranks in _lines(grid.permute(0, 2, 1, 3).reshape(dp * cp, pp, tp), 0):
        group = group_of(ranks)
        if rank in ranks:
            mine["dp_cp"] = group
    if len(mine) == len(CONTEXT_DIMS) + 1:
        ranks = {name: dist.get_process_group_ranks(g) for name, g in mine.items()}
        register_context_data_group(ranks["dp"], ranks["cp"], mine["dp_cp"])
    return mine


def context_mesh(dp, pp, cp, tp) -> dict:
    """This rank's groups {"dp", "pp", "cp", "tp", "dp_cp"} of the mesh `prepare_mesh("cp", dp, pp,
    cp, tp)` made (`WorkerPool.run(..., mesh=("cp", dp, pp, cp, tp))`)."""
    groups = _meshes.get(("cp", dp, pp, cp, tp))
    if groups is None:
        raise RuntimeError(f"context_mesh: the {(dp, pp, cp, tp)} mesh was not prepared (run the task with mesh=)")
    return groups


def _expert_groups(dp, ep, pp, tp) -> dict:
    """An ("edp", "ep", "pp", "tp") mesh's groups over its first dp * pp * tp ranks (expert
    parallelism folded over dp, as `tplayers.init_mesh(ep=)` lays it out), with "dp" the first
    two dims flattened; this rank's expert-data-parallel group registered."""
    grid, rank, mine = _grid(dp // ep, ep, pp, tp), dist.get_rank(), {}
    for dim, name in enumerate(EXPERT_DIMS):
        for ranks in _lines(grid, dim):
            group = group_of(ranks)
            if rank in ranks:
                mine[name] = group
    for ranks in _lines(grid.reshape(dp, pp, tp), 0):
        group = group_of(ranks)
        if rank in ranks:
            mine["dp"] = group
    if len(mine) == len(EXPERT_DIMS) + 1:
        ranks = {name: dist.get_process_group_ranks(g) for name, g in mine.items()}
        register_expert_data_group(ranks["dp"], ranks["ep"], mine["edp"])
    return mine


def expert_mesh(dp, ep, pp, tp) -> dict:
    """This rank's groups {"dp", "edp", "ep", "pp", "tp"} of the mesh `prepare_mesh("ep", dp, ep,
    pp, tp)` made (`WorkerPool.run(..., mesh=("ep", dp, ep, pp, tp))`)."""
    groups = _meshes.get(("ep", dp, ep, pp, tp))
    if groups is None:
        raise RuntimeError(f"expert_mesh: the {(dp, ep, pp, tp)} mesh was not prepared (run the task with mesh=)")
    return groups


def _lines(grid, dim):
    """The rank lists along `dim` of `grid`, every position of the other dims."""
    others = [range(size) for d, size in enumerate(grid.shape) if d != dim]
    for index in itertools.product(*others):
        index = list(index)
        index.insert(dim, slice(None))
        yield grid[tuple(index)].tolist()


def layout_mesh(*sizes: int) -> DeviceMesh:
    """This rank's ("dp", "pp", "tp") or ("dp", "pp", "tp_r", "tp_c") mesh over global ranks 0 ..
    prod(sizes) - 1 (tp fastest, as `tplayers.init_mesh` lays them out), from the groups
    `prepare_mesh` made; ("cp", dp, pp, cp, tp): the ("dp", "pp", "cp", "tp") mesh."""
    if sizes and sizes[0] == "cp":  # ("cp", dp, pp, cp, tp): a ("dp", "pp", "cp", "tp") mesh
        groups = context_mesh(*sizes[1:])
        return DeviceMesh.from_group([groups[d] for d in CONTEXT_DIMS], "cpu", mesh=_grid(*sizes[1:]),
                                     mesh_dim_names=CONTEXT_DIMS)  # fmt: skip
    groups = _meshes.get(tuple(sizes))
    if groups is None:
        raise RuntimeError(f"layout_mesh: the {tuple(sizes)} mesh was not prepared (run the task with mesh=)")
    if any(g is None for g in groups):
        raise ValueError(f"layout_mesh: rank {dist.get_rank()} is not in a mesh of {math.prod(sizes)} ranks")
    names = DIMS if len(sizes) == 3 else GRID_DIMS
    return DeviceMesh.from_group(groups, "cpu", mesh=_grid(*sizes), mesh_dim_names=names)
