"""A refused `parallelize` gives the model back as it was given.

The pass changes the model in place: it swaps modules, cuts attributes to a rank's heads, edits
configs, hooks tensors and modules. Where it then refuses (a layout it does not know, a self-check
that fails, a rank that died), a user who catches the error and trains the model unsharded, or
tries again with other settings, must get the model they gave, never a half-sharded one.

`restored_if_refused(model)` keeps, for every module, config and tensor of the model, what the
pass may change in place (its attribute table and the containers in it, its class; a tensor's
attributes, data, hooks and requires_grad) and puts it back if the block raises. The same objects
come back (an optimizer or a hook handle made before still refers to them). The snapshot holds the
original modules until `parallelize` returns: during the pass the memory of the unsharded weights
is not given back early. A tensor written in place cannot be put back (the pass never writes one):
the restore checks each one's version counter, and where one was written the model refuses every
forward after, naming why.
"""

from __future__ import annotations

import contextlib
import copy
import sys

import torch
from torch import nn

from tplayers.hf.summed_grads import forget_hook, is_hooked

_CONTAINERS = (dict, list, set)


class _Table:
    """An object's `__dict__` and a copy of each container in it (hook tables, `_parameters`, ...),
    restored into the same objects (a `RemovableHandle` made before refers to its table)."""

    def __init__(self, obj):
        self.obj, self.items = obj, dict(vars(obj))
        self.contents = {k: copy.copy(v) for k, v in self.items.items() if _is_container(v)}
        self.cls = type(obj)

    def restore(self):
        for key, saved in self.contents.items():
            live = self.items[key]
            live.clear()
            live.update(saved) if not isinstance(live, list) else live.extend(saved)
        table = vars(self.obj)
        table.clear()
        table.update(self.items)
        if type(self.obj) is not self.cls:
            self.obj.__class__ = self.cls


def _is_container(value) -> bool:
    return isinstance(value, _CONTAINERS) and not isinstance(value, (nn.Module, torch.Tensor))


class _TensorState:
    """A parameter's or buffer's attributes (tplayers' State), data, gradient hooks, requires_grad."""

    def __init__(self, t: torch.Tensor):
        self.t, self.attributes, self.data = t, dict(vars(t)), t.data
        self.hooks = copy.copy(t._backward_hooks)
        self.requires_grad, self.version = t.requires_grad, t._version

    def restore(self):
        vars(self.t).clear()
        vars(self.t).update(self.attributes)
        self.t.data = self.data  # where `.data` was set to another tensor
        if self.t.is_leaf:
            self.t._backward_hooks = self.hooks
            self.t.requires_grad_(self.requires_grad)

    def intact(self) -> bool:
        """Not written in place (autograd's version counter: every in-place op on it counts)."""
        return self.t._version == self.version


def _configs(module: nn.Module):
    """The configs a module holds (HF's `config`, its sub-configs), each once (none where transformers
    was never imported: no config can exist then)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return ()
    PretrainedConfig = transformers.PretrainedConfig  # noqa: N806  (the class, by its name)
    seen, stack = {}, [v for v in vars(module).values() if isinstance(v, PretrainedConfig)]
    while stack:
        config = stack.pop()
        if id(config) not in seen:
            seen[id(config)] = config
            stack.extend(v for v in vars(config).values() if isinstance(v, PretrainedConfig))
    return seen.values()


class Snapshot:
    """What `parallelize` may change of `model` in place, to put back (see the module docstring)."""

    def __init__(self, model: nn.Module):
        modules = list(model.modules())
        configs = {id(c): c for m in modules for c in _configs(m)}
        self.tables = [_Table(obj) for obj in [*modules, *configs.values()]]
        tensors = {id(t): t for m in modules for t in [*m._parameters.values(), *m._buffers.values()] if t is not None}
        self.tensors = [_TensorState(t) for t in tensors.values()]
        self.hooked = {id(t) for t in tensors.values() if is_hooked(t)}

    def restore(self) -> list[str]:
        """Put the model back; returns what could not be (tensors changed in place: none expected)."""
        for table in self.tables:
            table.restore()
        for tensor in self.tensors:
            tensor.restore()
        for tensor in self.tensors:  # a summing hook the block added is gone with the restored hooks
            if id(tensor.t) not in self.hooked:
                forget_hook(tensor.t)
        return [f"a {tuple(t.t.shape)} tensor" for t in self.tensors if not t.intact()]


@contextlib.contextmanager
def restored_if_refused(model: nn.Module):
    """The block's changes to `model` undone if it raises (the error raised as it was)."""
    snapshot = Snapshot(model)
    try:
        yield
    except BaseException as error:
        lost = snapshot.restore()
        if lost:  # never expected: the model is not the one given, so it refuses to run
            model.register_forward_pre_hook(_Refuses(lost))
            error.add_note(f"tplayers could not put the model back as it was given ({', '.join(lost[:3])} changed in "
                           "place): it refuses every forward; load it again")  # fmt: skip
        raise


class _Refuses:
    def __init__(self, lost):
        self.lost = lost

    def __call__(self, module, args):
        raise RuntimeError(f"{type(module).__name__} was changed in place by a refused tplayers.hf.parallelize "
                           f"({', '.join(self.lost[:3])}) and could not be put back: load it again")  # fmt: skip
