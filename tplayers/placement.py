"""The placement every tplayers parameter carries: one record read by clipping, the loss
scaler, ZeRO-3 and checkpointing.

The placement types are DTensor's (`Shard(dim)` / `Replicate()`), paired with the process
group over which the parameter is sharded or replicated.
"""

import weakref
from copy import deepcopy
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from tplayers.distributed import resolve_group
from tplayers.state import set_state, state_of


def shard_sizes(total: int, n: int) -> list[int]:
    """How a dimension of `total` splits over `n` ranks, as torch.chunk and DTensor's Shard split
    it: ceil(total / n) each in rank order, the last non-empty one the remainder, any after it
    none (10 over 4: [3, 3, 3, 1]; 3 over 8: [1, 1, 1, 0, 0, 0, 0, 0])."""
    size = -(-total // n)
    return [max(0, min(size, total - r * size)) for r in range(n)]


def shard_range(total: int, n: int, r: int, sizes=None) -> tuple[int, int]:
    """(start, size) of rank r's contiguous slice of a dimension of `total` over `n` ranks, split
    as `shard_sizes` splits it, or as the explicit per-rank `sizes` say."""
    sizes = shard_sizes(total, n) if sizes is None else list(sizes)
    return sum(sizes[:r]), sizes[r]


def even_sizes(total: int, n: int) -> list[int]:
    """`total` whole items over `n` ranks as evenly as they go: the first total % n ranks one more
    (12 over 8: [2, 2, 2, 2, 1, 1, 1, 1]). Attention heads split so (an explicit split, as the
    layers' `split_sizes` take it): a rank is left without a head only where there are fewer heads
    than ranks, where torch.chunk's split leaves ranks without one much more often (12 over 8:
    [2, 2, 2, 2, 2, 2, 0, 0]) and HF attention forwards cannot run on none."""
    base, extra = divmod(total, n)
    return [base + (r < extra) for r in range(n)]


def check_sizes(sizes, total: int, n: int, what: str) -> tuple[int, ...]:
    """An explicit split: `n` non-negative sizes summing to `total` (else ValueError naming `what`)."""
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != n or sum(sizes) != total or min(sizes) < 0:
        raise ValueError(f"{what}: split sizes {list(sizes)} are not {n} non-negative sizes summing to {total}")
    return sizes


@dataclass(frozen=True)
class ParamPlacement:
    """`placement` of a parameter over `group`: Shard(dim) (rank r holds the r-th contiguous
    slice along dim, sized as `shard_sizes` splits it: uneven sizes allowed, a rank may hold
    none) or Replicate() (every rank holds the whole tensor, with the whole grad)."""

    group: dist.ProcessGroup | None
    placement: Shard | Replicate
    # Data parallelism (tplayers.data_parallel): the group of replicas, and whether the tensor the
    # module holds is this replica's shard of the TP-local parameter (ZeRO 2-3: a DTensor over it).
    dp_group: dist.ProcessGroup | None = None
    dp_sharded: bool = False
    # Replicated, but each TP rank computes only part of its gradient (weights that see part of
    # the sequence under SP, per-head norms): a hook sums it over `group` as it is computed.
    grad_summed: bool = False
    # Shard(0) whose ranks' rows overlap (key / value heads the query heads of several ranks read,
    # `tplayers.functional.shared_rows`): the local rows [a, b) this rank counts in norms, those no
    # lower rank holds; None: every row is this rank's alone
    counted: tuple[int, int] | None = None
    # Pipeline parallelism (tplayers.pipeline): the group of stages, each holding disjoint parameters
    pp_group: dist.ProcessGroup | None = None
    # a weight shared by two stages (tied embeddings) is counted by the first stage's norm only
    counted_by_another_stage: bool = False
    # Expert parallelism (tplayers.nn.experts): the group whose ranks hold disjoint whole experts
    # (dim 0 of the stacked expert weights, split as `even_sizes` splits it); `dp_group` is then
    # the expert-data-parallel group, the replicas of this rank's experts
    ep_group: dist.ProcessGroup | None = None
    # 2-D tensor parallelism (tplayers.nn.grid): ((group, placement), ...) of the further sharded
    # dimensions, `group` / `placement` being the first
    grid: tuple = ()
    # 2-D: the group of every tensor-parallel rank (the grid flattened), the model's one TP group
    # for the calls that gather or check over it (gather_state_dict, save_pretrained, ...)
    tp_all: dist.ProcessGroup | None = None

    @property
    def is_sharded(self) -> bool:
        return self.group is not None and isinstance(self.placement, Shard)

    def reduce_groups(self) -> tuple:
        """The groups a per-rank partial norm of this parameter's gradient is summed over."""
        grid = tuple((g, isinstance(p, Shard)) for g, p in self.grid)
        experts = (self.ep_group, self.ep_group is not None)
        return tuple(
            g for g, on in ((self.group, self.is_sharded), *grid, experts, (self.dp_group, self.dp_sharded)) if on
        )

    def __deepcopy__(self, memo):
        return self  # immutable, and a process group is shared, never copied


def set_placement(param, group, placement, **data_parallel) -> None:
    set_state(param, placement=ParamPlacement(group, placement, **data_parallel))


def update_placement(param, **changes) -> None:
    """Add to a parameter's record (its data-parallel group, a summed gradient)."""
    set_state(param, placement=replace(placement_or_none(param) or ParamPlacement(None, Replicate()), **changes))


def full_tensor(t):
    """The TP-local tensor whole on every data-parallel replica: a ZeRO 2-3 DTensor all-gathered
    over the replicas (a collective), anything else as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def copy_into(param, value) -> None:
    """Copy `value` (the TP-local tensor, whole) into `param`, or into this replica's shard of it
    (a ZeRO 2-3 DTensor sharded along dim 0 as torch.chunk splits it)."""
    if isinstance(param, DTensor):
        n, r = param.device_mesh.size(), param.device_mesh.get_local_rank()
        chunks = value.chunk(n, 0)
        value = chunks[r] if r < len(chunks) else value[:0]
        param = param.to_local()
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"shape {tuple(value.shape)} does not give this rank's shard {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value)


def counted_rows(record, t):
    """The part of `t` (a parameter, its gradient, or a state like it: TP-local, or this replica's
    ZeRO 2-3 shard of it) that this rank counts in a norm: all of it, or for rows several ranks
    hold (`counted`) those no lower rank holds."""
    local = local_tensor(t)
    if record is None or record.counted is None:
        return local
    a, b = record.counted
    lo, hi = replica_rows(t)
    return local[min(max(a, lo), hi) - lo : min(max(b, lo), hi) - lo]


def replica_rows(t) -> tuple[int, int]:
    """The rows [a, b) along dim 0 of the TP-local tensor that this replica holds: a ZeRO 2-3
    DTensor's local shard (torch.chunk's split: ceil(rows / n) each, the last ones short or
    empty); (0, rows) for anything else."""
    if not isinstance(t, DTensor):
        return 0, t.shape[0] if t.dim() else 0
    rows, n, r = t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
    size = -(-rows // n)
    return min(r * size, rows), min((r + 1) * size, rows)


def local_tensor(t):
    """The tensor this rank holds: a DTensor's local shard (ZeRO 2-3), anything else as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def get_placement(param) -> ParamPlacement | None:
    """The placement of a tplayers parameter, or None for a parameter tplayers does not manage.

    The record travels on the tensor and is kept by the module that holds it (`seal`): a tensor
    put in its place (`.to()` of a DTensor, `load_state_dict(assign=True)`, `copy.deepcopy`, FSDP2)
    gets its slot's record back. A parameter of a parallelized model that has no record (added
    after `parallelize`, by code that did not place it) raises `PlacementError`: tplayers cannot
    tell how it is split, and taking it as replicated would be silently wrong."""
    record = state_of(param).placement
    return record if record is not None else _recover(param, strict=True)


def placement_or_none(param) -> ParamPlacement | None:
    """`get_placement` for the code that places parameters: None where no record is found."""
    record = state_of(param).placement
    return record if record is not None else _recover(param, strict=False)


# ------------------------------------------------------------------------------ records kept by modules
# One table per module ({parameter name: record}), the module's own state, as FSDP2 keeps one
# state per module: a tensor can be replaced in its slot, the module stays. `seal(root)` writes
# the tables of every module under a parallelized model (or a tplayers layer built on its own);
# the tensors carry the records as a cache that `get_placement` refills from the tables.

_TABLE = "_tplayers_records"
_HOLDERS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules holding a table


class PlacementError(ValueError):
    """A parameter inside a parallelized model has no placement record."""


class _Records(dict):
    """{parameter name: ParamPlacement} of one module; `root`: the module is a parallelized model
    (or a standalone tplayers layer), whose every parameter must have a record."""

    def __init__(self, owner, records=(), root=False):
        super().__init__(records)
        self.owner, self.root = weakref.ref(owner), root

    def __deepcopy__(self, memo):
        # deepcopy copies the owner first (its __dict__ holds this table): the copy's table is its own
        copy = memo.get(id(self.owner()))
        if copy is None:
            return dict(self)
        table = _Records(copy, self, self.root)
        _HOLDERS.add(copy)
        return table


def _table(module) -> "_Records | None":
    return module.__dict__.get(_TABLE)


def seal(root: nn.Module) -> nn.Module:
    """Keep every placed parameter's record in the module holding it, and mark `root` as a
    parallelized model: its parameters without a record are errors, never "replicated"."""
    _repair(root)
    for module in root.modules():
        records = {
            name: state_of(p).placement
            for name, p in module._parameters.items()
            if p is not None and state_of(p).placement is not None
        }
        old = _table(module)
        if records or module is root or old is not None:
            table = _Records(module, {**(old or {}), **records}, root=module is root or bool(old and old.root))
            module.__dict__[_TABLE] = table
            _HOLDERS.add(module)
    return root


def _held(record, tensor):
    """The record for the tensor now in its slot: FSDP2's unsharded parameter (a plain tensor in
    the slot of the DTensor shard during forward / backward) is the TP-local tensor whole."""
    if record.dp_sharded and not isinstance(tensor, DTensor):
        return replace(record, dp_sharded=False)
    return record


def _repair(root) -> None:
    """Give every tensor under `root` that lost its record (replaced in its slot) its slot's record."""
    for module in root.modules():
        table = _table(module)
        if not table:
            continue
        for name, p in module._parameters.items():
            if p is not None and state_of(p).placement is None and name in table:
                set_state(p, placement=_held(table[name], p))


def _recover(param, *, strict):
    """The record of a parameter that does not carry one, from the table of the module holding it
    in a parallelized model (repairing every tensor of that model); None where it is in none."""
    if not isinstance(param, torch.Tensor):
        return None
    for root in list(_HOLDERS):
        table = _table(root)
        if table is None or not table.root:
            continue
        for qualified, module in root.named_modules():
            for name, p in module._parameters.items():
                if p is not param:
                    continue
                _repair(root)
                record = state_of(param).placement
                if record is None and strict:
                    where = f"{qualified}.{name}" if qualified else name
                    raise PlacementError(
                        f"parameter {where!r} of the parallelized {type(root).__name__} has no placement record: "
                        "it was added or replaced after tplayers placed the model, by code that did not place it, "
                        "so tplayers cannot tell how it is split across ranks (and will not assume it replicated). "
                        "Add it before parallelize, or give it a record with tplayers.placement.set_placement"
                    )
                return record
    return None


def shared(value, memo) -> None:
    """Put the process groups and meshes in `value` into `memo` as themselves: shared, never copied."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(value, dist.ProcessGroup | DeviceMesh):
        memo[id(value)] = value
    elif isinstance(value, dict):
        for item in value.values():
            shared(item, memo)
    elif isinstance(value, list | tuple):
        for item in value:
            shared(item, memo)


class SharesGroups:
    """A module mixin: `copy.deepcopy` shares its process groups and meshes (they cannot be copied,
    and a copy of a layer computes over the same ranks) and keeps its parameters' records."""

    def __deepcopy__(self, memo):
        for value in self.__dict__.values():
            shared(value, memo)
        copy = self.__class__.__new__(self.__class__)
        memo[id(self)] = copy
        for key, value in self.__dict__.items():
            copy.__dict__[key] = deepcopy(value, memo)
        return copy


class PlacedModule(SharesGroups, nn.Module):
    """A module whose parameters carry placements over `self.group`, as listed in `_placements`
    ({parameter name: Shard(dim) | Replicate()}). They stay attached when the parameters are
    replaced (load_state_dict(assign=True)) or the module is deep-copied (the copy shares the
    process group: groups are never copied)."""

    _placements: dict

    def _placed(self, name):
        """The parameter `name` names (dotted: a child's), or None where it is not there (yet)."""
        owner, _, leaf = name.rpartition(".")
        try:
            return getattr(self.get_submodule(owner), leaf, None) if owner else getattr(self, leaf, None)
        except AttributeError:
            return None

    def _tag_parameters(self, *_):
        _repair(self)  # from this module's own table: no search of every parallelized model
        for name, placement in self._placements.items():
            param = self._placed(name)
            if param is not None:  # a data-parallel record already there is kept
                update_placement(param, group=self.group, placement=placement)
        seal(self)

    def _keep_placements(self):
        """Tag the parameters now and after every load_state_dict."""
        self._tag_parameters()
        self.register_load_state_dict_post_hook(self._tag_parameters)

    def __deepcopy__(self, memo):
        copy = super().__deepcopy__(memo)
        copy._tag_parameters()  # Parameter.__deepcopy__ drops Python attributes
        return copy


# ---------------------------------------------------------------------------- groups from the record
# Calls that read placed parameters take their groups from the records; an explicit `group=`
# must agree with them. Each rank checks its own records, so a contradiction raises on every
# rank before any collective (on a mesh every rank's records have the same shape).


_KIND_NAMES = {"tp": "tensor-parallel", "dp": "data-parallel", "pp": "pipeline", "ep": "expert-parallel"}


def ranks_of(pg) -> tuple[int, ...]:
    """The global ranks of a process group (None: none)."""
    return () if pg is None else tuple(dist.get_process_group_ranks(pg))


def recorded_groups(params, kind: str) -> list:
    """The distinct groups (by their ranks) that the records of `params` name, of `kind`:
    "tp" (the placement's group), "dp", "pp" or "ep"."""
    attr = {"tp": "group", "dp": "dp_group", "pp": "pp_group", "ep": "ep_group"}[kind]
    found = {}
    for p in params:
        record = get_placement(p)
        pg = getattr(record, attr, None)
        if kind == "tp" and getattr(record, "tp_all", None) is not None:
            pg = record.tp_all
        if pg is not None:
            found.setdefault(ranks_of(pg), pg)
    return list(found.values())


def spans_ranks(module) -> bool:
    """Whether the placement records of `module`'s parameters name a group of more than one rank
    (the module is parallelized across ranks)."""
    params = [p for p in module.parameters() if placement_or_none(p) is not None]
    return any(len(ranks_of(g)) > 1 for kind in ("tp", "dp", "pp") for g in recorded_groups(params, kind))


def tensor_parallel_group(params, group, caller: str):
    """The tensor-parallel group the records of `params` name (None when nothing is placed);
    an explicit `group` (ProcessGroup or 1-D DeviceMesh) over other ranks is refused."""
    recorded = recorded_groups(params, "tp")
    if len(recorded) > 1:
        raise ValueError(
            f"{caller}: the parameters are placed over {len(recorded)} tensor-parallel groups "
            f"({', '.join(str(list(ranks_of(g))) for g in recorded)}); call it on each part"
        )
    if group is None:
        return recorded[0] if recorded else None
    pg = resolve_group(group)
    if recorded and ranks_of(pg) != ranks_of(recorded[0]):
        raise ValueError(
            f"{caller}: group= holds ranks {list(ranks_of(pg))}, but the parameters' placement records name the "
            f"tensor-parallel group {list(ranks_of(recorded[0]))}: leave group= out (the record's group is used) "
            "or pass that group"
        )
    return recorded[0] if recorded else pg


def covering_group(params, group, caller: str):
    """The group a call that every rank holding the model takes part in runs over: `group`, or
    by default the world (it holds every group a record names, and also data-parallel replicas
    no record names, e.g. `train_step(dp_group=)`'s). An explicit group that leaves out a rank
    of a group a record names is refused: those ranks hold part of what the call reads."""
    pg = resolve_group(group)
    if group is None:
        return pg
    members, params = set(ranks_of(pg)), list(params)
    for kind, name in _KIND_NAMES.items():
        for recorded in recorded_groups(params, kind):
            missing = sorted(set(ranks_of(recorded)) - members)
            if missing:
                raise ValueError(
                    f"{caller}: group= holds ranks {sorted(members)}, which leaves out ranks {missing} of the "
                    f"{name} group {list(ranks_of(recorded))} that the parameters' placement records name: "
                    "leave group= out (the world) or pass a group over every rank that holds the model"
                )
    return pg


def refuse_overlap(params, group, caller: str, kinds, why: str, role: str = "group=") -> None:
    """Refuse a `group` two of whose ranks are in one group of `kinds` ("tp" / "dp" / "pp") that
    the records of `params` name: those ranks do not hold what `group` means (`why` says so)."""
    mine, params = set(ranks_of(resolve_group(group))), list(params)
    for kind in kinds:
        for recorded in recorded_groups(params, kind):
            shared = sorted(mine & set(ranks_of(recorded)))
            if len(shared) > 1:
                raise ValueError(
                    f"{caller}: {role} {sorted(mine)} overlaps the {_KIND_NAMES[kind]} group "
                    f"{list(ranks_of(recorded))} that the parameters' placement records name (ranks {shared} are in "
                    f"both): {why}"
                )
