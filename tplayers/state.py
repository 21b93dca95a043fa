"""What tplayers keeps on the objects it changes: one `State` per object, under one attribute.

    from tplayers.state import set_state, state_of
    state_of(model).exports              # read: an empty State where tplayers set nothing
    set_state(model, sequence_group=g)   # write: the object's State replaced by one with `g`

A `State` is frozen: `set_state` gives the object a new one, so two tensors that share one after a
shallow copy of their `__dict__` (a meta parameter materialised, `load_state_dict(assign=True)`)
never see each other's later changes. It lives in the object's `__dict__`, so `copy.deepcopy`,
`.to()`, pickling (DCP) and peft's wrapping carry it as they carry any attribute (torch's deep copy
of a Parameter carries none: the placement records are kept by the modules too, below). Its fields are
grouped by the kind of object that holds them (FSDP2 keeps one state per module alike,
`fully_shard.state(module)`); a field the object's kind never sets stays at its default.

The placement records have a second, per-module table beside this (`tplayers.placement`'s
record cache), which restores a parameter's record when a tensor is assigned in its place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

SLOT = "_tplayers_state"


@dataclass(frozen=True)
class State:
    # -- a parallelized model (tplayers.hf.parallelize and the passes beside it) ---------------
    exports: Any = None  # tplayers.hf.state_dict.Records: how each swapped module exports / loads
    original_keys: tuple = ()  # model.state_dict() keys before parallelize, in order
    tied: Any = None  # {LM head name: embedding name} where they share one Parameter
    sequence_group: Any = None  # the group the sequence is split over (pipeline_split reads it)
    context: Any = None  # tplayers.hf.context.ContextState: context parallelism (its stages too)
    same_inputs: Any = None  # tplayers.hf.same_inputs: the groups whose ranks must see one batch
    check_inputs: bool = False  # that check armed for the next forward
    check_generators: bool = False  # the generators' check armed for the next training forward
    # -- a module tplayers wrapped or swapped ----------------------------------------------------
    data_parallel: tuple | None = None  # (group, ZeRO stage) of tplayers.data_parallel
    compressor: Any = None  # its gradient compressor (residuals, PowerSGD's state) at stages 0-1
    tied_across_stages: bool = False  # a pipeline stage's module tied to another stage's
    weight_map: tuple | None = None  # a swapped layer's (dim, the HF rows / columns it holds): LoRA
    # -- a parameter ------------------------------------------------------------------------------
    placement: Any = None  # tplayers.placement.ParamPlacement
    replaced_by: str | None = None  # a parameter a ZeRO 2-3 wrap took off its module: its name there
    has_master: bool = False  # its gradients go to an fp32 master (tplayers.train.master)
    # -- a function or an object of another library tplayers extends -----------------------------
    guarded: bool = False  # a function tplayers wrapped (tplayers.data_parallel.guards, torch's clipping)
    replicas: Any = None  # tplayers.loops.replicas.Replicas of the model a Trainer / accelerator serves
    checkpointing: bool = False  # a Trainer inside its sharded save


EMPTY = State()


def state_of(obj) -> State:
    """The State tplayers keeps on `obj` (EMPTY where it keeps none). An object that forwards the
    attributes it lacks to another (peft's PeftModel / LoraModel to the model inside) reads that
    one's State until it is given its own."""
    own = getattr(obj, "__dict__", {}).get(SLOT)
    return own if own is not None else getattr(obj, SLOT, EMPTY)


def set_state(obj, **fields) -> State:
    """Give `obj` a State with `fields` changed, the rest as `state_of(obj)` has them."""
    new = replace(state_of(obj), **fields)
    obj.__dict__[SLOT] = new
    return new
