"""Matmul FLOPs: per token of one layer and of the logits, and per training step with
recomputation (Narayanan et al. 2021, Korthikanti et al. 2022)."""

from __future__ import annotations

from dataclasses import dataclass

from tplayers.plan.experts import moe_mlp_flops_per_token
from tplayers.plan.specs import RECOMPUTE_CHOICES, ModelSpec, _choice, ceil_share, local_dims, moe_layers


@dataclass(frozen=True)
class _TokenFlops:
    """Forward matmul FLOPs per token: dense part and attention core of one layer, and logits."""

    layer_dense: float
    layer_attention: float
    logits: float

    @property
    def layer(self) -> float:
        return self.layer_dense + self.layer_attention


def _forward_flops_per_token(
    model: ModelSpec, vocab: int | None = None, tp: int = 1, *, moe: bool = False, imbalance: float = 1.0
) -> _TokenFlops:
    """2 FLOPs per multiply-add. Per layer: QKV 2*h*(q + 2k), attention scores and
    attention over values 2*s*q each (no causal discount, as Narayanan eq. 3), output 2*q*h,
    MLP 2*h*f*(3 gated | 2). Logits 2*h*V. GPT (q = k = h, f = 4h): 24h^2 + 4sh per layer.
    `tp` > 1: the most loaded TP rank's share (`local_dims`: its query heads, the key/value heads
    it computes, its ffn columns and vocabulary rows), which the step waits for. `moe`: a MoE
    layer, its MLP `moe_mlp_flops_per_token` (`imbalance`: the most loaded rank's pairs over the mean)."""
    h, vocab = model.hidden, model.vocab if vocab is None else vocab
    local = local_dims(model, tp)
    q, kv = local.q, (model.kv_dim if tp == 1 else local.kv_heads_computed * model.head_dim)
    dense = 2 * h * (q + 2 * kv) + 2 * q * h
    if moe:
        dense += moe_mlp_flops_per_token(model, tp, imbalance=imbalance)
    else:
        dense += 2 * h * local.ffn * (3 if model.gated_mlp else 2)
    attention = 4 * model.seq_len * q
    return _TokenFlops(dense, attention, 2 * h * ceil_share(vocab, tp))


def _recompute_flops_per_token(flops: _TokenFlops, recompute: str) -> float:
    """Extra forward FLOPs per token per layer: full recompute reruns the layer's forward,
    selective only the attention core (Korthikanti et al. 2022 Sec. 5)."""
    return {"none": 0.0, "selective": flops.layer_attention, "full": flops.layer}[recompute]


def training_flops(model: ModelSpec, global_batch: int, recompute: str = "none", *, vocab: int | None = None) -> float:
    """Matmul FLOPs of one training step (whole job): 3 passes (forward, backward = 2x forward),
    plus the recomputed forward.

    Narayanan et al. 2021, Sec. 5.1, eq. 3, with full recomputation (4 passes of the layers,
    3 of the logit layer), B = global_batch sequences:
        F = 96*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h))
    without recomputation (model FLOPs, 3 passes everywhere):
        F = 72*B*s*l*h^2 * (1 + s/(6h) + V/(12*l*h))
    Generalised to GQA / gated MLPs through `_forward_flops_per_token`; a mixture of experts'
    MoE layers count the router, the shared experts and k experts per token.
    """
    _choice(recompute, RECOMPUTE_CHOICES, "recompute")
    if not model.has_dims:
        raise ValueError("FLOPs need the model's dimensions (this ModelSpec has num_params only)")
    flops = 0.0
    for moe, layers in ((False, model.layers - moe_layers(model)), (True, moe_layers(model))):
        if not layers:
            continue
        per_token = _forward_flops_per_token(model, vocab, moe=moe)
        flops += layers * (3 * per_token.layer + _recompute_flops_per_token(per_token, recompute))
    flops += 3 * per_token.logits
    return float(global_batch * model.seq_len * flops)
