"""hooks_holding_state: the module hooks on a model whose closures hold a module or a tensor.

A deep copy of a model copies its hook dictionaries but not the functions in them: a hook that
captured a module or a tensor keeps reading the original's in the copy, silently (the copy's
weights train, the hook subtracts the original's). Hooks should read state off the module they
are called with, or be objects a deep copy rebuilds (bound methods, `functools.partial`)."""

from __future__ import annotations

import types

import torch

HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _captured_state(value, seen: set) -> list[str]:
    """The modules and tensors a function's closure reaches (through nested functions and
    containers): what a deep copy would leave pointing at the original."""
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, (torch.nn.Module, torch.Tensor)):
        return [type(value).__name__]
    if isinstance(value, types.FunctionType):
        found = []
        for cell in value.__closure__ or ():
            try:
                found += _captured_state(cell.cell_contents, seen)
            except ValueError:  # an empty cell
                continue
        return found
    if isinstance(value, (list, tuple, set, frozenset)):
        return [name for v in value for name in _captured_state(v, seen)]
    if isinstance(value, dict):
        return [name for v in value.values() for name in _captured_state(v, seen)]
    return []


def hooks_holding_state(model: torch.nn.Module) -> list[str]:
    """ "<module>.<hook dict>: <hook> holds <types>" for every hook of `model`'s modules whose
    closure holds a module or a tensor; [] when a deep copy of `model` is self-contained."""
    found = []
    for name, module in model.named_modules():
        for attr in HOOK_DICTS:
            for hook in getattr(module, attr, {}).values():
                held = _captured_state(hook, set())
                if held:
                    found.append(f"{name or '<model>'}.{attr}: {getattr(hook, '__qualname__', hook)} holds {held}")
    return found
