"""What the user attached to a module the sharding pass replaces: hooks (a probe, a steering
vector, HF's `enable_input_require_grads`) and parametrizations (torch's weight norm, orthogonal).
Dropped with the module, hooks would stop running and a parametrization's tensors stop training
(the pass would shard the weight it computes and train that), without an error (before, both were).

Where the replacement's output is the unsharded module's (an embedding, an MLP, a row-parallel
projection; under sequence parallelism this rank's part of the sequence, as every block's), hooks
move to it: the same dicts, so the handles the user holds still remove them. Where it is not (a
column-parallel projection holds this rank's features; an LM head defers its training logits to
the fused loss), a hook would see something else than it was written for: refused, naming the
module and the hook. A parametrized module is refused, naming the parametrization, and so is a
plain linear or embedding holding parameters, buffers or modules of the user's beside its own."""

from torch.nn.utils import parametrize

HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# the sets that say how each hook is called, keyed by the hooks' ids
FLAGS = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")


def _names(module) -> list[str]:
    return [getattr(h, "__qualname__", repr(h)) for d in HOOKS for h in getattr(module, d).values()]


# What a plain layer holds; anything else on one was put there by its user
PLAIN = {"Linear": {"weight", "bias"}, "Conv1D": {"weight", "bias"}, "Embedding": {"weight"}}


def _extras(module) -> list[str]:
    """The parameters, buffers and modules a plain linear / embedding holds beyond its own."""
    own = PLAIN.get(type(module).__name__) if type(module).__module__.startswith(("torch.", "transformers.")) else None
    if own is None:
        return []
    held = [*module._parameters, *module._buffers, *module._modules]
    return [k for k in held if k not in own and k != "parametrizations"]  # parametrizations: named above


def _hooked(module) -> bool:
    return any(getattr(module, d) for d in HOOKS)


def hooked_modules(model) -> frozenset[str]:
    """The modules holding hooks: the sharding pass keeps them layers of their own (a gated MLP's
    down_proj is not fused away into a ParallelMLP), so that their hooks can move or be refused."""
    return frozenset(name for name, m in model.named_modules() if name and _hooked(m))


def move_attached(name: str, old, new, whole_output: bool) -> None:
    """Give `new`, which replaces `old` at `name`, the hooks `old` holds, or refuse what cannot move
    (module docstring)."""
    kept = {id(m) for m in new.modules()}
    for inner, module in old.named_modules(prefix=name):
        if id(module) not in kept:
            _refuse_dropped(inner, module, new, inside=None if module is old else name)
    if not _hooked(old):
        return
    if not whole_output:
        raise ValueError(
            f"parallelize: {name} ({type(old).__name__}) holds hooks ({', '.join(_names(old))}); tplayers replaces "
            f"it with {type(new).__name__}, whose output is not the unsharded module's, so they would see something "
            f"else or stop running. {_REGISTER_AFTER}"
        )
    for attr in HOOKS:
        theirs, ours = getattr(old, attr), getattr(new, attr)
        for key, hook in reversed(list(ours.items())):  # the replacement's own hooks run first, as they did
            theirs[key] = hook
            theirs.move_to_end(key, last=False)
        setattr(new, attr, theirs)  # the dicts themselves: the user's handles remove from them
    for attr in FLAGS:
        getattr(old, attr).update(getattr(new, attr))
        setattr(new, attr, getattr(old, attr))
    if old._backward_hooks:
        new._is_full_backward_hook = old._is_full_backward_hook


_REGISTER_AFTER = (
    "Remove them before parallelize and register them after it on a module whose output is whole (its block, its "
    "attention or MLP)"
)


def _refuse_dropped(name: str, module, new, inside: str | None) -> None:
    """Refuse what `module`, which no module of `new` keeps, holds that would be lost with it: a
    parametrization, tensors of the user's, hooks (`inside`: the replaced module it sits in)."""
    if parametrize.is_parametrized(module):
        tensors = {k: [type(f).__name__ for f in fs] for k, fs in module.parametrizations.items()}
        raise ValueError(
            f"parallelize: {name} ({type(module).__name__}) is parametrized ({tensors}); tplayers would shard the "
            "tensors it computes and train those, not the parametrization's. Remove it before parallelize "
            "(torch.nn.utils.parametrize.remove_parametrizations keeps the tensor it computes)"
        )
    extra = _extras(module)
    if extra:
        raise ValueError(
            f"parallelize: {name} ({type(module).__name__}) holds {extra}, which its class does not; tplayers "
            f"replaces it with {type(new).__name__} and would drop them. Move them to a module of your own before "
            "parallelize"
        )
    if inside is not None and _hooked(module):
        raise ValueError(
            f"parallelize: {name} ({type(module).__name__}) holds hooks ({', '.join(_names(module))}); tplayers "
            f"replaces {inside} with {type(new).__name__}, which holds no such module, so they would stop running. "
            f"{_REGISTER_AFTER}"
        )
