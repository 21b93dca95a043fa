"""TRL's fused LM head on a parallelized model.

TRL's trainers (SFT, GRPO, KTO, RLOO, ...) patch the model's forward with `add_fused_lm_head`:
called with `fused_lm_head=True`, it multiplies the backbone's hidden states by the LM head's
weight in tiles and returns per-token log-probabilities, entropies and top-1 hits. On a model
tplayers parallelized, that weight is this rank's slice of the vocabulary, so each rank would
score the labels against part of the vocabulary: a wrong loss, without an error.

`unfuse_lm_head` replaces TRL's forward with one that returns the same `FusedCausalLMOutput`,
computed in fp32 from the model's own logits, which tplayers already gives whole (the vocabulary
gathered over the tensor-parallel group, any logit scaling and softcapping applied). It costs the
full logits of a batch that TRL's tiles avoid; a vocabulary-parallel version would not.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from types import MethodType

import torch
from torch import nn


def _trl_settings(module: nn.Module) -> dict | None:
    """The settings TRL's fused forward on `module` closes over, or None if it has none. (TRL
    wraps it with the class forward's name and signature: its code object tells it apart.)"""
    forward = module.__dict__.get("forward")
    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    if code is None or code.co_name != "_fused_forward" or Path(code.co_filename).parts[-3:-1] != ("trl", "trainer"):
        return None
    return inspect.getclosurevars(forward.__func__).nonlocals


def unfuse_lm_head(model: nn.Module) -> bool:
    """Replace TRL's fused LM head on `model` (peft: on its base model) as the module docstring
    says; True if there was one."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    settings = _trl_settings(target)
    if settings is None:
        return False
    original, temperature = settings["original_forward"], float(settings["temperature"])
    text_config = target.config.get_text_config()

    @functools.wraps(type(target).forward)  # generate() validates its kwargs against this signature
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return original(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        from trl.trainer.utils import FusedCausalLMOutput

        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        out = original(*args, **kwargs)
        if shift_labels is None:
            logits, labels = out.logits[:, :-1], labels[:, 1:]
        else:
            logits, labels = out.logits, shift_labels
        labels = labels.to(logits.device)
        mask = labels != -100
        logits = logits.float() / temperature
        log_softmax = logits.log_softmax(-1)
        log_probs = log_softmax.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1).masked_fill(~mask, 0)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1).masked_fill(~mask, 0)
        with torch.no_grad():
            is_top1 = (logits.argmax(-1) == labels) & mask  # bool, as TRL gives it (DPO ands it with a mask)
            log_sum_sq_probs = torch.logsumexp(2 * log_softmax, -1).masked_fill(~mask, 0)
            mean_logits = logits.mean(-1).masked_fill(~mask, 0)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / count
        aux_loss = getattr(out, "aux_loss", None) if kwargs.get("output_router_logits") else None
        if aux_loss is not None:
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(
            loss=loss, log_probs=log_probs, entropy=entropy, log_sum_sq_probs=log_sum_sq_probs,
            mean_logits=mean_logits, is_top1=is_top1, label_mask=mask, aux_loss=aux_loss,
        )  # fmt: skip

    target.forward = MethodType(forward, target)
    return True
