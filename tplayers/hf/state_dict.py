"""The full, unsharded state dict (and gradients) of a parallelized model under its original
names, and loading one back into the shards. `parallelize` leaves on the model, for each
swapped module, how to export and load it (its State's `exports`: `tplayers.state`); nothing
else is needed."""

import copy
import types
from collections.abc import Callable
from typing import NamedTuple

from tplayers.placement import copy_into, full_tensor, shared, tensor_parallel_group
from tplayers.state import state_of

# A parallelized model's State (tplayers.state) holds its export records (a list of ExportRecord,
# or a function returning them as the model is now: a peft model's, tplayers.hf.lora.live_records);
# its state_dict() keys before parallelize; and {LM head name: embedding name} where the two share
# one Parameter.


class ExportRecord(NamedTuple):
    """How one swapped module is exported and loaded under the HF module's names."""

    prefix: str  # the HF module's name
    export: Callable  # export(pick, group) -> {HF key: full tensor} (`pick`: what to gather of each tensor)
    load: Callable  # load({HF key: full tensor}): this rank's shards copied in
    pieces: Callable  # pieces() -> [tplayers.hf.pieces.Piece]: where this rank's tensors sit in the HF ones

    def __deepcopy__(self, memo):
        # wherever a deep copy of the model reaches a record (its Records, or a closure holding the
        # pass that made it), its closures are rebuilt over the copy's modules, never left on the original's
        return _rebind(self, memo)


class Records(list):
    """A model's export records (its State's `exports`): closures over its swapped modules. A deep copy of the
    model gets records over its own modules (`_rebind`), never the original's (whose weights a
    copy's export would otherwise return, silently)."""

    def __deepcopy__(self, memo):
        return _rebind(self, memo)


class LiveRecords:
    """A function returning the model's records as it is now (a peft model's), rebound like
    `Records` in a deep copy of the model."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self):
        return self.fn()

    def __deepcopy__(self, memo):
        return LiveRecords(_rebind(self.fn, memo))


def _rebind(value, memo):
    """`value` deep-copied through `memo` (the deep copy of the model in progress: a module or a
    tensor of the model is its copy), functions included: a closure is rebuilt over copies of what
    it captured. Process groups and meshes are shared, never copied."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, types.FunctionType) and value.__closure__:
        cells = tuple(types.CellType() for _ in value.__closure__)
        new = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, cells)
        new.__kwdefaults__ = value.__kwdefaults__
        memo[id(value)] = new
        for old, cell in zip(value.__closure__, cells, strict=True):
            try:
                cell.cell_contents = _rebind(old.cell_contents, memo)
            except ValueError:  # an empty cell (a name not yet bound when the closure was made)
                continue
        return new
    if type(value) in (list, Records):
        new = type(value)()
        memo[id(value)] = new  # before its items: a record's closure may reach this list again
        new.extend(_rebind(v, memo) for v in value)
        return new
    if isinstance(value, ExportRecord):
        new = memo[id(value)] = ExportRecord._make(_rebind(v, memo) for v in value)
        return new
    if type(value) is tuple:
        return tuple(_rebind(v, memo) for v in value)
    shared(value, memo)
    return copy.deepcopy(value, memo)


def export_records(model) -> list:
    """The model's export records (its State's `exports`): [] for a model parallelize did not shard."""
    records = state_of(model).exports
    return [] if records is None else records() if callable(records) else records


def record_name(prefix: str, key: str) -> str:
    """The original name of `key` in the record of `prefix` (key "": the prefix names the tensor
    itself, a parameter its module holds directly, such as an attention's per-head sinks)."""
    return f"{prefix}.{key}" if key else prefix


def under_records(name: str, prefixes) -> bool:
    """Whether a record of `prefixes` (a set) exports `name`: the prefix itself, or a name under it."""
    while name:
        if name in prefixes:
            return True
        name = name.rpartition(".")[0]
    return False


def reshard(model) -> None:
    """FSDP2's parameters back to their shards. ZeRO-2 keeps the gathered ones after a forward without
    backward (evaluation); a tensor read from them would alias storage FSDP2 frees at its next
    reshard (which `state_dict()` runs): at TP 1 the records return the tensor itself, not a copy.
    Run first by everything that reads the parameters through the records."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _gathered(model, group, pick):
    """{original name: full tensor} for every sharded module; a collective on every rank."""
    reshard(model)
    full = {}
    for record in export_records(model):
        for key, tensor in record.export(pick, group).items():
            full[record_name(record.prefix, key)] = tensor
    return full


def _refuse_unexported(model) -> None:
    """Every parameter under a sharded module is one its record exports: one that is not (a module
    added inside a sharded one after parallelize) would be left out of the state dict, silently."""
    records = export_records(model)
    exported = {id(piece.param) for record in records for piece in record.pieces()}
    prefixes = frozenset(record.prefix for record in records)
    missing = [n for n, p in model.named_parameters() if id(p) not in exported and under_records(n, prefixes)]
    if missing:
        raise ValueError(
            f"gather_state_dict: {missing[:4]} sit inside modules tplayers sharded but no export knows them (added "
            "after parallelize?); their values would be left out of the state dict. Add them before parallelizing"
        )


def _sharded_prefixes(model) -> frozenset[str]:
    return frozenset(record.prefix for record in export_records(model))


def gather_state_dict(model, *, group=None) -> dict:
    """The full, unsharded state dict under the original module names, on every rank. Gathers
    over the tensor-parallel group the parameters' placement records name (and their data-parallel
    shards); an explicit `group` over other ranks raises on every rank before any collective."""
    group = tensor_parallel_group(model.parameters(), group, "gather_state_dict")
    _refuse_unexported(model)
    full = _gathered(model, group, lambda p: full_tensor(p.detach()))  # whole over data parallelism too
    sharded = _sharded_prefixes(model)
    for key, value in model.state_dict().items():
        if not under_records(key, sharded):
            full[key] = full_tensor(value)
    order = state_of(model).original_keys  # then what was added since (a peft adapter)
    # contiguous, as a model's own state_dict() is (HF's save_pretrained reads each tensor as one span)
    return {key: full[key].contiguous() for key in dict.fromkeys([*order, *full]) if key in full}


def gather_grads(model, *, group=None) -> dict:
    """The full, unsharded gradient of every parameter under its original name, on every rank
    (groups as `gather_state_dict`)."""
    group = tensor_parallel_group(model.parameters(), group, "gather_grads")
    full = _gathered(model, group, lambda p: None if p.grad is None else full_tensor(p.grad))
    sharded = _sharded_prefixes(model)
    for key, p in model.named_parameters():
        if not under_records(key, sharded):
            full[key] = None if p.grad is None else full_tensor(p.grad)
    return {k: v for k, v in full.items() if v is not None}


def load_full_state_dict(model, state_dict, *, group=None) -> None:
    """Load a full, unsharded state dict (original names, what `gather_state_dict` returns) into a
    parallelized model: each rank copies in its shards. No communication; strict like
    `load_state_dict`. An explicit `group` must be the records' tensor-parallel group."""
    tensor_parallel_group(model.parameters(), group, "load_full_state_dict")
    records = export_records(model)
    state_dict = dict(state_dict)
    supplied = set(state_dict)
    for record in records:
        prefix, start = record.prefix, record.prefix + "."
        tied_to = (state_of(model).tied or {}).get(prefix)
        if tied_to and f"{start}weight" not in supplied and f"{tied_to}.weight" in supplied:
            continue  # HF checkpoints of tied models omit the head: it is the embedding's Parameter
        try:
            mine = [k for k in list(state_dict) if k == prefix or k.startswith(start)]
            record.load({k[len(start) :] if k != prefix else "": state_dict.pop(k) for k in mine})
        except KeyError as e:
            raise ValueError(f"load_full_state_dict: missing key {start}{e.args[0]}") from None
    sharded = _sharded_prefixes(model)
    own = {k for k in model.state_dict() if not under_records(k, sharded)}
    if set(state_dict) != own:
        raise ValueError(
            f"load_full_state_dict: unexpected keys {sorted(set(state_dict) - own)}, "
            f"missing keys {sorted(own - set(state_dict))}"
        )
    current = model.state_dict(keep_vars=True)
    for key, value in state_dict.items():  # in place: shards of data parallelism included
        copy_into(current[key], value)
