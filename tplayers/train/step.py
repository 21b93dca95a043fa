"""`train_step`: one optimizer step composed from gradient accumulation, loss scaling, global
gradient clipping and (optionally) fp32 master weights, in the order that keeps them correct.

    opt = tplayers.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    scaler = tplayers.DynamicLossScaler()                 # fp16; bf16 needs no scaling
    for batch in loader:
        result = tplayers.train_step(model, opt, batch.chunk(4), loss_fn, scaler=scaler, max_grad_norm=1.0)

The order, and why:
1. each micro-batch's loss is divided by their number (the step sees the mean) and scaled
   before `backward()`; the gradients accumulate (in fp32 with master weights). On a
   data-parallel model (`tplayers.data_parallel`, or any module with torch's
   `set_requires_gradient_sync`: DDP, FSDP2) the replicas reduce once, in the last micro-batch's
   backward: the others accumulate locally. With `dp_group`, the gradients are averaged over
   the replicas after the last backward (one all-reduce per dtype, on the master gradients),
   before anything reads them;
2. `scaler.unscale_` divides the gradients by the scale and agrees on overflow across every rank
   holding part of the model; clipping must come after it, or it would clip scaled gradients;
3. `clip_grad_norm_` over the optimizer's parameters: the norm of the full unsharded gradient
   (sharded parts summed over their group, replicated ones once, `clip_group` combining
   pipeline stages); with a scaler on the Triton backend the fused unscale pass has already
   measured the gradients, so clipping does not read them again (`DynamicLossScaler.clip_grad_norm_`);
4. `scaler.step` steps, or skips on every rank together; `scaler.update` adjusts the scale;
5. the gradients are cleared for the next step.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from tplayers.distributed import resolve_group
from tplayers.functional import comm
from tplayers.placement import get_placement, refuse_overlap
from tplayers.train.clip import clip_grad_norm_


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean of the micro-batch losses, unscaled
    grad_norm: float | None  # total norm before clipping (None without clipping)
    skipped: bool  # the step was skipped on every rank (an overflow somewhere)
    scale: float  # the loss scale used for this step (1.0 without a scaler)


def _optimizer_parameters(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def train_step(
    model: torch.nn.Module,
    optimizer,
    micro_batches: Iterable,
    loss_fn: Callable,
    *,
    scaler=None,
    max_grad_norm: float | None = None,
    norm_type: float = 2.0,
    clip_group=None,
    dp_group=None,
) -> StepResult:
    """One optimizer step over `micro_batches`; `loss_fn(model, micro_batch)` returns a scalar loss.

    `model` may be a pipeline schedule (`tplayers.Schedule1F1B(...)` and the others): then pass
    `micro_batches=[(x, target)]` and `loss_fn=None`; the schedule's micro-batches are the
    accumulation and its loss function the loss (scaled by the scaler's scale for backward).
    `optimizer`: a torch optimizer or a `MixedPrecisionOptimizer`; `scaler`: a
    `DynamicLossScaler` (None: no loss scaling); `max_grad_norm`: clip to this global norm
    (None: no clipping); `clip_group`: passed to `clip_grad_norm_` as `group` (ranks holding
    disjoint parts of the model, e.g. pipeline stages); `dp_group`: data-parallel replicas whose
    gradients are averaged (each rank passes its own micro-batches; the loss reported is this
    rank's). The scaler's default group (every rank) already spans the replicas, so they skip or
    step together. Returns a `StepResult`.
    """
    batches = list(micro_batches)
    if not batches:
        raise ValueError("train_step needs at least one micro-batch")
    wrapped = any(getattr(get_placement(p), "dp_group", None) for p in _optimizer_parameters(optimizer))
    if dp_group is not None and wrapped:
        raise ValueError(
            "train_step: the model is already data-parallel (tplayers.data_parallel averages its gradients); "
            "passing dp_group would average them twice"
        )
    if dp_group is not None:
        refuse_overlap(_optimizer_parameters(optimizer), dp_group, "train_step", ("tp", "pp"),
                       "replicas must hold the same shards of the same stage (pass mesh['dp'])",
                       role="dp_group")  # fmt: skip
    scale = scaler.get_scale() if scaler is not None else 1.0
    total = None
    if hasattr(model, "forward_backward"):  # a pipeline schedule: its micro-batches are the accumulation
        if len(batches) != 1 or not isinstance(batches[0], tuple | list) or len(batches[0]) != 2 or loss_fn is not None:
            raise ValueError(
                "train_step with a pipeline schedule: pass micro_batches=[(x, target)] (the schedule splits it "
                "into its micro-batches) and loss_fn=None (the schedule's own)"
            )
        total = model.forward_backward(*batches[0], loss_scale=scale)  # scale: 1.0 unless a scaler is on
        batches = [None]  # one mean loss, already over the micro-batches
    syncing = gradient_syncing_modules(model) if total is None else []
    try:
        for i, batch in enumerate(batches if total is None else ()):
            for module in syncing:  # one reduction over the replicas per step: in the last backward
                module.set_requires_gradient_sync(i == len(batches) - 1)
            loss = loss_fn(model, batch)
            if not (torch.is_tensor(loss) and loss.numel() == 1):
                raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
            total = loss.detach().float() if total is None else total + loss.detach().float()
            loss = loss / len(batches)
            (scaler.scale(loss) if scaler is not None else loss).backward()
    finally:
        for module in syncing:
            module.set_requires_gradient_sync(True)

    if dp_group is not None:
        _average_gradients(_optimizer_parameters(optimizer), resolve_group(dp_group))
    grad_norm = None
    if max_grad_norm is not None:
        if scaler is not None:
            grad_norm = scaler.clip_grad_norm_(optimizer, max_grad_norm, norm_type, group=clip_group)
        else:
            grad_norm = clip_grad_norm_(_optimizer_parameters(optimizer), max_grad_norm, norm_type, group=clip_group)
    if scaler is not None:
        scaler.step(optimizer)
        skipped = scaler.last_step_skipped if scaler.is_enabled() else False
        scaler.update()
    else:
        optimizer.step()
        skipped = False
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss=total.item() / len(batches),
        grad_norm=None if grad_norm is None else grad_norm.item(),
        skipped=skipped,
        scale=scale,
    )


def gradient_syncing_modules(model) -> list:
    """The data-parallel engines' modules in `model` that take torch's gradient-sync switch
    (composable DDP's root, FSDP2's root and units: the root's call covers its units)."""
    if not isinstance(model, torch.nn.Module):
        return []
    return [m for m in model.modules() if callable(getattr(m, "set_requires_gradient_sync", None))]


@torch.no_grad()
def _average_gradients(params: list, group) -> None:
    """Mean of every gradient over `group`: one flat all-reduce per (device, dtype)."""
    n = torch.distributed.get_world_size(group)
    if n == 1:
        return
    buckets: dict = {}
    for p in dict.fromkeys(params):  # a tied parameter once
        if p.grad is not None:
            buckets.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for grads in buckets.values():  # the same keys in the same order on every replica
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group, axis="dp")
        flat.div_(n)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
