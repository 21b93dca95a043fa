"""`save_checkpoint` / `load_checkpoint`: sharded, resharding, atomic checkpoints on
torch.distributed.checkpoint (DCP), called on every rank.

Each rank writes only the chunks it holds (replicas write once) of each tensor under its
unsharded HF name, and reads back only the chunks its layout needs, whatever layout saved them:
the model's weights (`model.<name>`), fp32 master weights (`master.<name>`), every optimizer
state tensor (`optim.<name>.<state>`), the optimizer's hyperparameters, the loss scaler's state,
the caller's `extra` and each rank's RNG state (restored only into the same layout).

A save writes into `<path>.partial` and becomes `<path>` by a rename once every rank has
written, with a marker file last: a crash mid-save leaves the previous `<path>` whole and the
partial one without its marker, and the next save or load of `<path>` finishes or undoes it. A
save replaces only a complete tplayers checkpoint or an empty directory, and deletes only
directories it wrote: anything else at `<path>` (or its `.partial` / `.old`) is refused.

A load checks every tensor's name, shape and dtype against the model on every rank before
reading, reads into staging buffers, and only copies into the model once every rank has read
everything: a mismatch or an unreadable file raises and changes nothing.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, raised on every rank

from tplayers.checkpoint.chunks import Chunk, ChunkedTensor, chunked, model_pieces, parameters
from tplayers.checkpoint.planners import CheckpointError, LoadPlannerForChunks, SavePlannerForChunks, is_tensor_md
from tplayers.placement import covering_group, get_placement
from tplayers.train.master import MixedPrecisionOptimizer

MARKER = "tplayers-checkpoint.json"  # written last: a directory with it is a complete checkpoint
IN_PROGRESS = "tplayers-checkpoint.in-progress"  # in <path>.partial while a save writes it
PARTIAL, OLD = ".partial", ".old"
FORMAT = 1


def _stepped(optimizer):
    """(the optimizer holding the state, {id(model param): master})."""
    masters = {}
    if isinstance(optimizer, MixedPrecisionOptimizer):
        masters = {id(p): m for p, m in zip(optimizer._model_params, optimizer._masters, strict=True)}
        optimizer = optimizer.optimizer
    holder = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this replica's own optimizer
    return holder, masters


def _layout(model, world) -> list[int]:
    """What the RNG states depend on: the world size and the TP / DP / PP group sizes."""
    sizes = [world, 1, 1, 1]
    for p in parameters(model):
        placement = get_placement(p)
        for i, g in enumerate((getattr(placement, "group", None), getattr(placement, "dp_group", None),
                               getattr(placement, "pp_group", None)), 1):  # fmt: skip
            if g is not None:
                sizes[i] = max(sizes[i], dist.get_world_size(g))
    return sizes


def _scalar(value) -> ChunkedTensor:
    return ChunkedTensor((), value.dtype, [Chunk((), (), value, None, None, False)])


def _optimizer_tensors(pieces, optimizer, create=None):
    """({name: ChunkedTensor or object} of the masters and optimizer states, [(optimizer state,
    parameter, key, fresh states, name)] to fill once loaded). With `create` (the checkpoint's
    metadata): fresh tensors for every state the checkpoint holds, to load into, attached to the
    optimizer only after the load."""
    holder, masters = _stepped(optimizer)
    owned = {id(p) for g in holder.param_groups for p in g["params"]}
    out, attach = {}, []
    created = {}  # id(param) -> its fresh states, shared by the names it holds pieces of
    saved = {}  # name -> the state keys the checkpoint holds for it
    for full in create or ():
        if full.startswith("optim."):
            name, _, key = full[len("optim.") :].rpartition(".")
            saved.setdefault(name, []).append(key)
    for name, ps in pieces.items():
        ps = [p for p in ps if id(masters.get(id(p.param), p.param)) in owned]  # ZeRO-1: this replica's
        if not ps:
            continue
        stepped = [masters.get(id(p.param), p.param) for p in ps]
        if all(id(p.param) in masters for p in ps):
            out[f"master.{name}"] = chunked(ps, stepped)
        prefix = f"optim.{name}."
        if create is None:
            states = [holder.state.get(s, {}) for s in stepped]
        else:
            states = []
            for s in stepped:
                fresh = created.setdefault(id(s), {})
                for key in saved.get(name, ()):
                    full = prefix + key
                    md = create[full]
                    if key in fresh:
                        continue
                    if is_tensor_md(md):
                        dtype = md.properties.dtype
                        fresh[key] = torch.zeros((), dtype=dtype) if not md.size else torch.zeros_like(s, dtype=dtype)
                    else:
                        fresh[key] = None  # an object: read as one
                    attach.append((holder.state, s, key, fresh, full))
                states.append(fresh)
        for key in sorted({k for st in states for k in st}):
            held = [(p, st[key]) for p, st in zip(ps, states, strict=True) if key in st]
            value = held[0][1]
            if torch.is_tensor(value) and value.dim() > 0:
                out[prefix + key] = chunked([p for p, _ in held], [v for _, v in held])
            elif torch.is_tensor(value):
                out[prefix + key] = _scalar(value)
            else:
                out[prefix + key] = value
    return out, attach


def _state(model, optimizer, scaler, scheduler, extra, group):
    rank, world = dist.get_rank(), dist.get_world_size(group)
    pieces = model_pieces(model)
    state = {f"model.{name}": chunked(ps) for name, ps in pieces.items()}
    if optimizer is not None:
        state.update(_optimizer_tensors(pieces, optimizer)[0])
        state["optim.param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if extra is not None:
        state["extra"] = extra
    rng = {"cpu": torch.get_rng_state(), "layout": _layout(model, world)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    state[f"rng.{rank}"] = rng
    return state


def _is_ours(path: Path) -> bool:
    """A directory this module wrote: a complete checkpoint (its marker) or a save in progress."""
    return path.is_dir() and not path.is_symlink() and ((path / MARKER).is_file() or (path / IN_PROGRESS).is_file())


def _is_complete(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / MARKER).is_file()


def _aside(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _refusal(path: Path) -> str | None:
    """Why a save to `path` must not go ahead (it would replace or delete what it did not write),
    or None. Replaced: a complete tplayers checkpoint, an empty directory; nothing else."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        return f"save_checkpoint: {path} exists and is not a directory: it is left untouched (save elsewhere)"
    if path.is_dir() and not _is_complete(path) and any(path.iterdir()):
        return (
            f"save_checkpoint: {path} is a directory that is not a tplayers checkpoint (no {MARKER}) and not "
            "empty: it is left untouched (save to a new or empty path, or to an existing checkpoint)"
        )
    for suffix in (PARTIAL, OLD):
        leftover = _aside(path, suffix)
        if (leftover.exists() or leftover.is_symlink()) and not _is_ours(leftover):
            return (
                f"save_checkpoint: {leftover} exists and was not written by tplayers: it is left untouched "
                "(a save writes there first; move it away)"
            )
    return None


def _recover(path: Path) -> None:
    """Finish or undo an interrupted save of `path` (on one rank): a save that died after writing
    everything but before its renames is completed; otherwise the previous checkpoint is kept and
    the partial one removed. Only directories this module wrote are touched."""
    partial, old = _aside(path, PARTIAL), _aside(path, OLD)
    if not path.exists() and not path.is_symlink():
        if _is_complete(partial):  # died between the two renames: the new checkpoint is whole
            partial.rename(path)
        elif _is_complete(old):
            old.rename(path)
    for leftover in (partial, old):
        if _is_ours(leftover):
            shutil.rmtree(leftover)


def _agree(error: str | None, pg) -> None:
    """Raise `error` (this rank's or any other's) on every rank of `pg`."""
    errors = [None] * dist.get_world_size(pg)
    dist.all_gather_object(errors, error, group=pg)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def _rotate(path: Path, keep: int) -> None:
    """Of the complete checkpoints beside `path` whose names differ from its own only in a
    trailing number (step_100, step_200, ...), keep the `keep` saved last; delete the others."""
    stem = re.sub(r"\d+$", "", path.name)
    pattern = re.compile(re.escape(stem) + r"\d+$" if stem != path.name else re.escape(path.name) + "$")
    series = [p for p in path.parent.iterdir() if pattern.match(p.name) and _is_complete(p)]

    def saved_at(p):
        try:
            return json.loads((p / MARKER).read_text()).get("saved_at", 0), p.name
        except (OSError, ValueError):
            return 0, p.name

    for stale in sorted(series, key=saved_at)[:-keep]:
        if stale != path:
            shutil.rmtree(stale)


def save_checkpoint(
    path, *, model, optimizer=None, scaler=None, scheduler=None, extra=None, group=None, keep: int | None = None
) -> None:
    """Write `model` (and `optimizer`, `scaler`, `scheduler`: a torch LR scheduler, `extra`:
    plain data and tensors) to the directory `path`, each rank its own shards; on every rank of
    `group` (default: the world; an explicit group must hold every group the parameters'
    placement records name). `model` may also be this rank's stages from
    `tplayers.pipeline_split` (the model dropped).

    `path` may be new, an empty directory or a complete tplayers checkpoint, which is replaced
    atomically; anything else (a file, a directory of other files) is refused on every rank and
    left as it is. The leftovers of an interrupted save of `path` are cleaned up first.
    `keep=N`: afterwards only the N checkpoints saved last among those beside `path` whose names
    differ from its own in a trailing number (`step_100`, `step_200`, ...) remain."""
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"save_checkpoint: keep must be a positive int, got {keep!r}")
    pg = covering_group(parameters(model), group, "save_checkpoint")
    path = Path(path)
    partial = _aside(path, PARTIAL)
    state = _state(model, optimizer, scaler, scheduler, extra, pg)
    first = dist.get_rank(pg) == 0
    _agree(_refusal(path) if first else None, pg)  # rank 0 decides: every rank sees one file system state
    if first:
        _recover(path)
        partial.mkdir(parents=True)
        (partial / IN_PROGRESS).touch()
    dist.barrier(group=pg)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), planner=SavePlannerForChunks(), process_group=pg)
    dist.barrier(group=pg)
    if first:
        info = {"format": FORMAT, "world_size": dist.get_world_size(pg), "saved_at": time.time_ns(), "tensors": sum(
            isinstance(v, ChunkedTensor) for v in state.values())}  # fmt: skip
        (partial / IN_PROGRESS).unlink()
        (partial / MARKER).write_text(json.dumps(info))
        old = _aside(path, OLD)
        if path.is_dir() and any(path.iterdir()):  # a complete checkpoint (checked above)
            path.rename(old)
        elif path.is_dir():
            path.rmdir()
        partial.rename(path)
        if old.exists():
            shutil.rmtree(old)
        if keep is not None:
            _rotate(path, keep)
    dist.barrier(group=pg)


def _read_metadata(path: Path):
    if not (path / MARKER).is_file():
        raise CheckpointError(f"checkpoint: {path} is not a complete tplayers checkpoint (no {MARKER})")
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 -- any failure to parse is a damaged checkpoint
        raise CheckpointError(f"checkpoint: {path}'s metadata cannot be read ({type(e).__name__}: {e})") from e


def _check(wanted: dict, metadata, pg) -> None:
    """Every tensor this rank will load exists with its shape and dtype; every model tensor of
    the checkpoint is held by some rank. Raises the same error on every rank."""
    md = metadata.state_dict_metadata
    errors = []
    for name, value in wanted.items():
        if not isinstance(value, ChunkedTensor):
            if name not in md:  # an optimizer or scaler the checkpoint was saved without
                errors.append(f"{name} is not in the checkpoint (saved without it?)")
            continue
        saved = md.get(name)
        if saved is None or not is_tensor_md(saved):
            errors.append(f"{name} is not in the checkpoint")
        elif tuple(saved.size) != tuple(value.shape) or saved.properties.dtype != value.dtype:
            errors.append(
                f"{name}: the checkpoint holds {tuple(saved.size)} {saved.properties.dtype}, "
                f"the model {tuple(value.shape)} {value.dtype}"
            )
    names = [None] * dist.get_world_size(pg)
    dist.all_gather_object(names, ([k for k in wanted if k.startswith("model.")], errors), group=pg)
    held = {k for keys, _ in names for k in keys}
    errors = sorted({e for _, errs in names for e in errs})
    errors += [
        f"{k} is in the checkpoint but not in the model" for k in sorted(md) if k.startswith("model.") and k not in held
    ]
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise CheckpointError("checkpoint does not fit the model, which is unchanged: " + "; ".join(errors[:5]) + more)


def load_checkpoint(path, *, model, optimizer=None, scaler=None, scheduler=None, group=None, staged: bool = True):
    """Load what `save_checkpoint` wrote (at any layout) into `model` (and `optimizer` with its
    param_groups' hyperparameters, `scaler`, `scheduler`) at this layout; returns the saved
    `extra`. On every rank of `group` (as `save_checkpoint`'s). An interrupted save of `path` is
    finished or undone first (see `save_checkpoint`).

    `staged=False` writes each chunk into the model as soon as it is read: no second copy of
    this rank's shards, but a file failing to read midway leaves the model partly loaded (the
    names, shapes and dtypes are still checked first)."""
    pg = covering_group(parameters(model), group, "load_checkpoint")
    path = Path(path)
    if dist.get_rank(pg) == 0:
        _recover(path)
    dist.barrier(group=pg)
    metadata = _read_metadata(path)
    md = metadata.state_dict_metadata
    rank, world = dist.get_rank(), dist.get_world_size(pg)
    pieces = model_pieces(model)
    wanted = {f"model.{name}": chunked(ps) for name, ps in pieces.items()}
    attach = []
    if optimizer is not None:
        tensors, attach = _optimizer_tensors(pieces, optimizer, create=md)
        wanted.update({k: v for k, v in tensors.items() if isinstance(v, ChunkedTensor)})
        wanted.update({k: None for k, v in tensors.items() if not isinstance(v, ChunkedTensor)})
        wanted["optim.param_groups"] = None
    if scaler is not None:
        wanted["scaler"] = None
    if scheduler is not None:
        wanted["scheduler"] = None
    for name in ("extra", f"rng.{rank}"):
        if name in md:
            wanted[name] = None
    _check(wanted, metadata, pg)
    planner = LoadPlannerForChunks(staged)
    try:
        dcp.load(wanted, storage_reader=dcp.FileSystemReader(path), planner=planner, process_group=pg)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- a truncated or damaged file on any rank
        failures = getattr(e, "failures", None) or {dist.get_rank(pg): e}
        rank_, first = next(iter(failures.items()))
        cause = f"{type(first).__name__}: {first}".strip(": ") or type(first).__name__
        raise CheckpointError(
            f"checkpoint: {path} cannot be read (a truncated or damaged file? rank {rank_}: {cause}); "
            + ("the model is unchanged" if staged else "the model may be partly loaded (staged=False)")
        ) from e
    planner.commit()
    objects = planner.objects
    for state, param, key, fresh, name in attach:  # the optimizer's state, now that everything is read
        state[param][key] = fresh[key] if fresh[key] is not None else objects[name]
    if optimizer is not None:
        _load_param_groups(optimizer, objects["optim.param_groups"])
    if scaler is not None:
        scaler.load_state_dict(objects["scaler"])
    if scheduler is not None:
        scheduler.load_state_dict(objects["scheduler"])
    rng = objects.get(f"rng.{rank}")
    if rng is not None and list(rng["layout"]) == _layout(model, world):
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return objects.get("extra")


def _load_param_groups(optimizer, saved) -> None:
    groups = optimizer.param_groups
    if len(saved) != len(groups):
        raise CheckpointError(f"checkpoint: {len(saved)} optimizer param groups saved, the optimizer has {len(groups)}")
    for group, values in zip(groups, saved, strict=True):
        group.update(values)
