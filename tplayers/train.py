"""`train_step`: one optimizer step composed from gradient accumulation, loss scaling, global
gradient clipping and (optionally) fp32 master weights, in the order that keeps them correct.

    opt = tplayers.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    scaler = tplayers.DynamicLossScaler()                 # fp16; bf16 needs no scaling
    for batch in loader:
        result = tplayers.train_step(model, opt, batch.chunk(4), loss_fn, scaler=scaler, max_grad_norm=1.0)

The order, and why:
1. each micro-batch's loss is divided by their number (the step sees the mean) and scaled
   before `backward()`; the gradients accumulate (in fp32 with master weights);
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

from tplayers.clip import clip_grad_norm_


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
) -> StepResult:
    """One optimizer step over `micro_batches`; `loss_fn(model, micro_batch)` returns a scalar loss.

    `optimizer`: a torch optimizer or a `MixedPrecisionOptimizer`; `scaler`: a
    `DynamicLossScaler` (None: no loss scaling); `max_grad_norm`: clip to this global norm
    (None: no clipping); `clip_group`: passed to `clip_grad_norm_` as `group` (ranks holding
    disjoint parts of the model, e.g. pipeline stages). Returns a `StepResult`.
    """
    batches = list(micro_batches)
    if not batches:
        raise ValueError("train_step needs at least one micro-batch")
    scale = scaler.get_scale() if scaler is not None else 1.0
    total = None
    for batch in batches:
        loss = loss_fn(model, batch)
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        total = loss.detach().float() if total is None else total + loss.detach().float()
        loss = loss / len(batches)
        (scaler.scale(loss) if scaler is not None else loss).backward()

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
