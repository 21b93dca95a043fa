"""Communication: bytes each rank sends in ring collectives, the DP traffic under ZeRO, the TP traffic
of a layer, and which link (NVLink or network) each parallel group runs over."""

from __future__ import annotations

import math

from tplayers.plan.layout import Layout
from tplayers.plan.specs import GROUPS, ClusterSpec, ModelSpec, Precision, _choice


def all_reduce_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `size` bytes: 2*(n-1)/n * size."""
    return 2 * (n - 1) / n * size


def all_gather_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-gather whose output is `size` bytes: (n-1)/n * size."""
    return (n - 1) / n * size


def reduce_scatter_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter of a `size`-byte input: (n-1)/n * size."""
    return (n - 1) / n * size


def dp_bytes_per_step(params: float, dp: int, zero_stage: int, num_microbatches: int, precision: Precision) -> float:
    """Data-parallel bytes sent per GPU per step for `params` local parameters.

    ZeRO paper Sec. 7: stage 0 all-reduces the gradients once per step (2*psi); stages 1-2
    reduce-scatter gradients and all-gather parameters (same 2*psi); stage 3 all-gathers the
    parameters in forward and again in backward (3*psi, 1.5x). Sharded gradients cannot be
    accumulated locally, so stage 2 reduce-scatters every micro-batch and stage 3 gathers and
    reduces every micro-batch (m = num_microbatches; with m = 1 these are the paper's ratios).
    """
    grads, weights = params * precision.grad_bytes, params * precision.param_bytes
    m = num_microbatches
    if zero_stage == 0:
        return all_reduce_bytes(grads, dp)
    if zero_stage == 1:
        return reduce_scatter_bytes(grads, dp) + all_gather_bytes(weights, dp)
    if zero_stage == 2:
        return m * reduce_scatter_bytes(grads, dp) + all_gather_bytes(weights, dp)
    return m * (reduce_scatter_bytes(grads, dp) + 2 * all_gather_bytes(weights, dp))


def tp_bytes_per_layer(model: ModelSpec, micro_batch: int, tp: int, recompute: str, activation_bytes: float) -> float:
    """TP bytes sent per GPU per layer per micro-batch.

    Megatron (Shoeybi et al. 2019, Sec. 3): two all-reduces of the s*b*h activations in the
    forward (after attention and after the MLP) and two in the backward. With sequence
    parallelism each becomes an all-gather + reduce-scatter pair, the same bytes (Korthikanti
    Sec. 4.2.2; the extra backward re-gather of the stored sharded input is not counted).
    Full recomputation repeats the forward's two.
    """
    size = model.seq_len * micro_batch * model.hidden * activation_bytes
    collectives = 4 + (2 if recompute == "full" else 0)
    return collectives * all_reduce_bytes(size, tp)


def group_link(cluster: ClusterSpec, layout: Layout, group: str) -> str:
    """The link class of `group` ("tp" | "pp" | "dp"): "intra_node" if each of its groups lies
    within one node, else "inter_node".

    Ranks are ordered by `layout.rank_order` (fastest first); a group of size n and stride
    (product of the faster sizes) lies within nodes iff gpus_per_node is a multiple of n*stride.
    """
    _choice(group, GROUPS, "group")
    sizes = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}
    order = layout.rank_order.split("-")
    stride = math.prod(sizes[g] for g in order[: order.index(group)])
    n = sizes[group]
    if n == 1 or cluster.num_gpus <= cluster.gpus_per_node:
        return "intra_node"
    return "intra_node" if cluster.gpus_per_node % (n * stride) == 0 else "inter_node"


def _link_bandwidth(cluster: ClusterSpec, link: str) -> float:
    return cluster.intra_node_bandwidth if link == "intra_node" else cluster.inter_node_bandwidth
