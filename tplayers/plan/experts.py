"""Mixture-of-experts layers: what one rank holds, computes, stores and sends for the experts of a
`ModelSpec` with `experts` > 0, as `tplayers.nn.ParallelExperts` runs them.

E routed experts of width F (`expert_ffn`), k per token (`experts_per_token`), go whole over
`ep` expert-parallel ranks (`Layout.ep`, folded over the data-parallel replicas): rank r holds
`expert_share(E, ep, r)` of them (6 over 4: 2, 2, 1, 1; the first rank the most). Their features
split over TP in 16-byte-aligned blocks (`expert_ffn_share`). The router (E x h) and the shared
experts (`shared_ffn` wide together, a dense MLP split over TP) sit with the dense weights.

Routing is priced at a stated balance (`Assumptions.routing_imbalance`: the most loaded
expert-parallel rank's pairs over the mean; 1.0 is uniform routing). Under uniform routing a token
picks k distinct experts of E at random, so it reaches rank r unless all k avoid r's experts:
P(r) = 1 - C(E - E_r, k) / C(E, k) (`destinations`). tplayers sends each token once per
destination rank (DeepEP's count), never to its own rank.
"""

from __future__ import annotations

import functools
import math

from tplayers.plan.specs import ModelSpec, ceil_share, expert_ffn_share, expert_share

INDEX_BYTES = 4  # each sent row's k local expert indices (int32)
COUNT_BYTES = 8  # the per-rank-pair row counts exchanged before each dispatch (int64)


def expert_tensors(model: ModelSpec, tp: int, ep: int, layers: int, tp_rank: int = 0) -> list[tuple[int, int, bool]]:
    """(rows, columns, summed) of the routed experts' tensors one rank holds over `layers` MoE
    layers: gate|up (E_r, 2f x h) and down (E_r, h x f), the layout FSDP2 shards by its first dim
    (the experts) over the expert-data-parallel group; biases (E_r, 2f) and (E_r, h)."""
    if not layers or not model.experts:
        return []
    e, h, f = expert_share(model.experts, ep), model.hidden, expert_ffn_share(model.expert_ffn, tp, tp_rank)
    up = 2 * f if model.gated_mlp else f
    block = [(e, up * h, False), (e, h * f, False)]
    if model.linear_bias:
        block += [(e, up, False), (e, h, False)]
    return layers * block


@functools.cache  # search prices thousands of layouts
def destinations(experts: int, k: int, ep: int) -> float:
    """Expected expert-parallel ranks one token reaches under uniform routing (k distinct experts
    of E, rank r holding E_r): sum over r of 1 - C(E - E_r, k) / C(E, k)."""
    every = math.comb(experts, k)
    return sum(1 - math.comb(experts - expert_share(experts, ep, r), k) / every for r in range(ep))


def remote_destinations(experts: int, k: int, ep: int) -> float:
    """Expected ranks other than its own that one token is sent to (its own rank's share left
    out: by symmetry of the ranks, (ep - 1) / ep of `destinations`)."""
    return destinations(experts, k, ep) * (ep - 1) / ep


def ep_bytes_per_layer(
    model: ModelSpec,
    tokens: float,
    ep: int,
    activation_bytes: float,
    *,
    imbalance: float = 1.0,
    recompute: str = "none",
) -> float:
    """Bytes one rank sends over its expert-parallel group in one MoE layer's forward and backward
    for `tokens` routed tokens (tplayers' dispatch, `tplayers.functional.dispatch`): each row sent
    to another rank carries the token (d h), its k local expert indices (int32) and routing
    weights (d); each received row goes back as the result (d h). Backward runs the same rows the
    other way: the results' gradients (d h) out, the tokens' (d h) and weights' (d k) back. Plus
    the row counts (8 bytes per rank pair) once per forward. The most loaded rank receives
    `imbalance` x the mean rows; full recomputation repeats the forward."""
    if ep == 1:
        return 0.0
    k, h, d = model.experts_per_token, model.hidden, activation_bytes
    rows = tokens * remote_destinations(model.experts, k, ep)
    sent_forward = rows * (d * h + k * (INDEX_BYTES + d)) + imbalance * rows * d * h
    sent_backward = rows * d * h + imbalance * rows * (d * h + d * k)
    passes = 2 if recompute == "full" else 1
    return passes * (sent_forward + COUNT_BYTES * (ep - 1)) + sent_backward


def moe_tp_bytes_per_layer(model: ModelSpec, tokens: float, tp: int, ep: int, activation_bytes: float) -> float:
    """Under sequence parallelism with ep > 1, the MLP's TP bytes of one MoE layer: each TP rank
    dispatches its own `tokens` (T / tp), the rows its TP group received are gathered over the
    group and the partial outputs reduce-scattered back, forward and backward: four passes of
    (tp - 1) x the received rows x h x d (the dense MLP's all-gather / reduce-scatter pair when
    every token stays here)."""
    rows = tokens * destinations(model.experts, model.experts_per_token, ep)
    return 4 * (tp - 1) * rows * model.hidden * activation_bytes


def moe_mlp_flops_per_token(model: ModelSpec, tp: int = 1, *, imbalance: float = 1.0) -> float:
    """Forward matmul FLOPs of one MoE layer's MLP per token on the most loaded rank: the router
    (2 h E), the shared experts (2 h x its share x (3 | 2)) and k routed pairs of 2 h f (3 | 2)
    each, `imbalance` x the mean pairs. Expert parallelism does not change them: its ranks feed
    different tokens, so a rank runs as many pairs as its own tokens pick (on average)."""
    h, mats = model.hidden, 3 if model.gated_mlp else 2
    shared = 2 * h * ceil_share(model.shared_ffn, tp) * mats
    routed = model.experts_per_token * imbalance * 2 * h * expert_ffn_share(model.expert_ffn, tp) * mats
    return 2 * h * model.experts + shared + routed


def moe_mlp_activation_bytes(
    model: ModelSpec, tokens: float, tp: int, ep: int, d: float, *, imbalance: float = 1.0
) -> float:
    """Activation bytes one MoE layer's MLP keeps for backward for `tokens` tokens on the most
    loaded rank: the router's fp32 logits (4 E per token); the shared experts' gate and up outputs
    and product (3 d per column, 2 non-gated, as a dense MLP); per routed pair the grouped GEMM's
    pre-activation gate|up and SwiGLU product (3 d f); with ep > 1 the received rows (d h each)."""
    mats = 3 if model.gated_mlp else 2
    pairs = tokens * model.experts_per_token * imbalance
    out = tokens * (4 * model.experts + d * mats * ceil_share(model.shared_ffn, tp))
    out += pairs * d * mats * expert_ffn_share(model.expert_ffn, tp)
    if ep > 1:
        out += imbalance * tokens * destinations(model.experts, model.experts_per_token, ep) * d * model.hidden
    return out
