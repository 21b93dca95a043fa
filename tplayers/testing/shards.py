"""Compare a parallelized HF model's parameters or gradients with an unsharded reference rank by
rank, without gathering them.

`gather_grads` / `gather_state_dict` all-gather every sharded tensor (two collectives each): on
gloo with more ranks than cores a collective costs milliseconds, and a sweep over hundreds of
models spends a quarter of its time there. `expected_shards` slices the reference instead, with
the model's own load path (`load_full_state_dict`, which needs no communication), so each rank
compares what it holds, every rank's copy of a row several hold included. The export path these
skip is checked by the state-dict round trips."""

from __future__ import annotations

import torch

from tplayers.hf import load_full_state_dict
from tplayers.placement import local_tensor
from tplayers.tolerances import tolerance


def grads_as_state_dict(model) -> dict:
    """An unsharded model's state dict with every parameter's gradient in its place (zeros where
    it has none), buffers as they are: what `expected_shards` slices to compare gradients."""
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter):
            value = value.grad if value.grad is not None else torch.zeros_like(value)
        out[key] = value.detach()
    return out


def expected_shards(model, full: dict) -> dict[str, torch.Tensor]:
    """{parameter name in the parallelized `model`: what this rank holds of it (its ZeRO shard
    under ZeRO 2-3)} for `full`, a complete state dict under the unsharded model's names: the
    slices `load_full_state_dict` copies in. The model is left as it was (its state is copied in,
    read, and copied back)."""
    current = model.state_dict(keep_vars=True)
    saved = {key: local_tensor(value).detach().clone() for key, value in current.items()}
    try:
        load_full_state_dict(model, full)
        return {name: local_tensor(p).detach().clone() for name, p in model.named_parameters()}
    finally:
        with torch.no_grad():
            for key, value in current.items():
                local_tensor(value).copy_(saved[key])


def differing_grads(model, full_grads: dict, **tol) -> list[str]:
    """The parameters of the parallelized `model` whose gradient on this rank differs from its part
    of `full_grads` (`grads_as_state_dict` of the unsharded reference; a missing gradient counts as
    zeros), beyond `tol` (torch.allclose's rtol / atol; default the tolerance table's for the dtype)."""
    expected = expected_shards(model, full_grads)
    wrong = []
    for name, p in model.named_parameters():
        grad = local_tensor(p.grad) if p.grad is not None else torch.zeros_like(expected[name])
        if grad.shape != expected[name].shape or not torch.allclose(
            grad, expected[name], **(tol or tolerance(grad.dtype))
        ):
            wrong.append(name)
    return wrong
