"""Replicated parameters whose gradient each rank computes only part of (a norm under sequence
parallelism, a scalar inside a sharded module, a LoRA factor kept whole): tagged Replicate with
`grad_summed`, and given a gradient hook that sums the gradient over the group as it is computed,
so every rank holds the whole of it. The hook is restored wherever torch drops it: a tensor assigned
in by `load_state_dict(assign=True)`, a deep copy, a meta parameter materialised."""

import weakref

import torch
from torch.distributed.tensor import Replicate

from tplayers.functional import comm
from tplayers.placement import placement_or_none, set_placement


def summed_grads(params, group):
    """Replicated parameters whose gradient each rank holds only part of: tagged Replicate and
    summed over the group as the gradient is computed, so every rank holds the whole of it."""
    for p in params:
        if placement_or_none(p) is None:
            set_placement(p, group, Replicate(), grad_summed=True)
            _sum_hook(p, group)


# The tensors whose gradient hook sums them over the group, by identity: a copy of one (deepcopy
# copies a tensor's Python attributes, never its hooks) is not among them.
_HOOKED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _sum_hook(p, group):
    trainable = p.requires_grad  # a frozen weight (an inactive adapter) may be trained later:
    p.requires_grad_(True)  # its hook goes on now, and stays through requires_grad_ toggles
    p.register_hook(lambda g: _summed(g, group))
    p.requires_grad_(trainable)
    _HOOKED[id(p)] = p


def is_hooked(p) -> bool:
    return _HOOKED.get(id(p)) is p


def forget_hook(p) -> None:
    """`p`'s summing hook was taken off (a refused parallelize put its hooks back as they were)."""
    if is_hooked(p):
        del _HOOKED[id(p)]


def carry_sum_hook(old, new) -> None:
    """`new` replaces `old` with `old`'s hooks copied onto it (a meta parameter materialised): it
    has the summing hook too, if `old` had it."""
    if _HOOKED.get(id(old)) is old:
        _HOOKED[id(new)] = new


def rehook_summed(module, *_):
    """Every parameter whose gradient is summed over the group (its record says so) has its summing
    hook: a tensor put in its slot (`load_state_dict(assign=True)`) or a deep copy of the model
    (`copy.deepcopy` drops tensor hooks) gets it again, from the slot's record (`tplayers.placement`);
    without it each rank would keep its own part of that gradient, silently. Run after every
    load_state_dict and before every forward of the parallelized model."""
    for p in module.parameters():
        if is_hooked(p):
            continue
        record = placement_or_none(p)
        if record is not None and record.grad_summed:
            _sum_hook(p, record.group)


def _summed(grad, group):
    """The gradient summed over `group` (a replicated weight that saw part of the sequence)."""
    grad = grad.contiguous().clone()
    comm.all_reduce(grad, group)
    return grad
