"""Communication: bytes each rank sends in ring collectives, the DP traffic under ZeRO, the TP traffic
of a layer, and which link (NVLink or network) each parallel group runs over."""

from __future__ import annotations

import math

from tplayers.data_parallel import compress
from tplayers.data_parallel.compress import Compression
from tplayers.plan.layout import Layout
from tplayers.plan.specs import GROUPS, LINK_CLASSES, ClusterSpec, ModelSpec, Precision, _choice


def all_reduce_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `size` bytes: 2*(n-1)/n * size."""
    return 2 * (n - 1) / n * size


def all_gather_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-gather whose output is `size` bytes: (n-1)/n * size."""
    return (n - 1) / n * size


def reduce_scatter_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter of a `size`-byte input: (n-1)/n * size."""
    return (n - 1) / n * size


def rank_ordered_mean_bytes(entries: int, dp: int, entry_bytes: int) -> float:
    """tplayers' compressors' mean (an all-to-all of n chunks, then an all-gather of the mean):
    an all-reduce's bytes, the entries padded to n equal chunks."""
    return 2 * (dp - 1) * math.ceil(entries / dp) * entry_bytes


def compressed_mean_bytes(shapes: list[tuple[int, int]], dp: int, compression: Compression) -> float:
    """Bytes each replica sends to average the gradients of `shapes` ((rows, columns), as one DDP
    bucket) under `compression` (`tplayers.data_parallel.compress`), exactly as the hook sends
    them: bf16 the rank-ordered mean in bf16; int8 its blocks of 64 entries plus a 4-byte scale
    each; top-k (n-1) x (4-byte value + 4-byte index) per kept entry, at least one per tensor;
    PowerSGD two fp32 means, [P of every factored matrix, every tensor sent whole] then [Q].
    A model over several buckets pads each bucket to n chunks (a few entries each)."""
    sizes = [r * c for r, c in shapes]
    if compression.kind == "bf16":
        return rank_ordered_mean_bytes(sum(sizes), dp, 2)
    if compression.kind == "int8":
        _, chunk = compress.blocked(sizes, dp)
        return rank_ordered_mean_bytes(dp * chunk, dp, compress.BLOCK + 4)
    if compression.kind == "topk":
        return (dp - 1) * 8 * sum(min(s, max(1, math.ceil(compression.fraction * s))) for s in sizes)
    factors = [compress.low_rank((r, c), compression.rank) if c > 1 else None for r, c in shapes]
    first = sum(f[0] * f[2] if f else size for f, size in zip(factors, sizes, strict=True))
    second = sum(f[1] * f[2] for f in factors if f)
    return rank_ordered_mean_bytes(first, dp, 4) + rank_ordered_mean_bytes(second, dp, 4)


def _gradient_mean_bytes(params: float, dp: int, precision: Precision, compression: Compression | None) -> float:
    """The stage 0-1 gradient mean of `params` entries with no shapes known (one flat tensor)."""
    if compression is None:
        return all_reduce_bytes(params * precision.grad_bytes, dp)
    if compression.kind == "powersgd":
        raise ValueError(
            "plan: PowerSGD's bytes depend on every weight's shape; give the ModelSpec its dimensions "
            "(hidden, heads, ffn_hidden, ...) rather than only a parameter count"
        )
    return compressed_mean_bytes([(math.ceil(params), 1)], dp, compression)


def dp_bytes_per_step(
    params: float, dp: int, zero_stage: int, num_microbatches: int, precision: Precision,
    compression: Compression | None = None,
) -> float:  # fmt: skip
    """Data-parallel bytes sent per GPU per step for `params` local parameters, as tplayers'
    engines run a step of m = num_microbatches (`train_step` reduces once, in the last
    micro-batch's backward; the others accumulate locally):

        stage 0  one all-reduce of the gradients (2*psi, ZeRO paper Sec. 7)
        stage 1  the same all-reduce (torch's ZeroRedundancyOptimizer on DDP), then each
                 replica's updated partition to the others: an all-gather of the parameters (3*psi)
        stage 2  one reduce-scatter of the gradients, one all-gather of the parameters, held
                 whole through the accumulation (2*psi)
        stage 3  one reduce-scatter; the parameters gathered for every micro-batch's forward and
                 again for its backward (psi + 2*m*psi)

    `compression` (stages 0-1: `compressed_mean_bytes` in place of the all-reduce; bf16 at 2-3
    halves the reduce-scatter). With the model's tensors, `dp_bytes_from_tensors` adds FSDP2's
    padding, the weights it leaves to tplayers, and prices PowerSGD (which needs the shapes)."""
    grads, weights = params * precision.grad_bytes, params * precision.param_bytes
    m = num_microbatches
    if zero_stage <= 1:
        mean = _gradient_mean_bytes(params, dp, precision, compression)
        return mean + (all_gather_bytes(weights, dp) if zero_stage == 1 else 0)
    if compression is not None:  # bf16, FSDP2's reduce dtype (check_stage refuses the others)
        grads = params * 2
    if zero_stage == 2:
        return reduce_scatter_bytes(grads, dp) + all_gather_bytes(weights, dp)
    return reduce_scatter_bytes(grads, dp) + 2 * m * all_gather_bytes(weights, dp)


def dp_bytes_from_tensors(
    tensors: list, dp: int, zero_stage: int, num_microbatches: int, precision: Precision,
    compression: Compression | None = None,
) -> float:  # fmt: skip
    """`dp_bytes_per_step` exactly, tensor by tensor ((rows, columns, summed), as `stage_tensors`
    lists them): FSDP2 pads each tensor's rows to a multiple of dp; the weights kept out of it
    (summed, `tplayers.data_parallel`) are all-reduced; stage 3 gathers every unit, the root
    included, for each micro-batch's forward and again for its backward."""
    pb, gb, m = precision.param_bytes, precision.grad_bytes, num_microbatches
    every = sum(r * c for r, c, _ in tensors)
    if zero_stage <= 1:
        if compression is None:
            mean = all_reduce_bytes(every * gb, dp)
        else:
            mean = compressed_mean_bytes([(r, c) for r, c, _ in tensors], dp, compression)
        return mean + (all_gather_bytes(every * pb, dp) if zero_stage == 1 else 0)

    summed = sum(r * c for r, c, s in tensors if s)
    sharded = sum(-(-r // dp) * dp * c for r, c, s in tensors if not s)
    reduced = 2 if compression is not None else gb  # bf16: FSDP2's reduce dtype; the summed stay fp32
    out = reduce_scatter_bytes(sharded * reduced, dp) + all_reduce_bytes(summed * gb, dp)
    if zero_stage == 2:
        return out + all_gather_bytes(sharded * pb, dp)
    return out + 2 * m * all_gather_bytes(sharded * pb, dp)


def line_mlp_bytes(tokens: int, hidden: int, tp: int, activation_bytes: float) -> float:
    """The same MLP on a 1-D group of `tp` (Megatron's pair): the output all-reduced forward, the
    input gradient backward, T x H each."""
    return 2 * all_reduce_bytes(tokens * hidden * activation_bytes, tp)


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
    """The link class of `group` ("tp" | "pp" | "dp" | "ep"): "intra_node" if each of its groups lies
    within one node, else "inter_node". The expert-parallel group is `layout.ep` consecutive dp ranks.

    Ranks are ordered by `layout.rank_order` (fastest first); a group of size n and stride
    (product of the faster sizes) lies within nodes iff gpus_per_node is a multiple of n*stride.
    """
    _choice(group, GROUPS, "group")
    sizes = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}
    order = layout.rank_order.split("-")
    stride = math.prod(sizes[g] for g in order[: order.index("dp" if group == "ep" else group)])
    n = layout.ep if group == "ep" else sizes[group]
    if n == 1 or cluster.num_gpus <= cluster.gpus_per_node:
        return "intra_node"
    return "intra_node" if cluster.gpus_per_node % (n * stride) == 0 else "inter_node"


def grid_links(cluster: ClusterSpec, layout: Layout) -> dict[str, str]:
    """{"tp_r": link, "tp_c": link} of a grid layout: tp_c is c consecutive ranks, tp_r r ranks
    c apart (`init_mesh`'s order), so with tp_c inside a node tp_r crosses nodes once r x c
    exceeds the node."""
    r, c = layout.tp_grid
    if cluster.num_gpus <= cluster.gpus_per_node:
        return {"tp_r": "intra_node", "tp_c": "intra_node"}
    links = {}
    for axis, n, stride in (("tp_r", r, c), ("tp_c", c, 1)):
        links[axis] = "intra_node" if n == 1 or cluster.gpus_per_node % (n * stride) == 0 else "inter_node"
    return links


def _link_bandwidth(cluster: ClusterSpec, link: str) -> float:
    return cluster.intra_node_bandwidth if link == "intra_node" else cluster.inter_node_bandwidth


def by_link(by_group: dict[str, float | None], links: dict[str, str]) -> dict[str, float]:
    """Bytes per link class from bytes per group (unknown groups count as 0)."""
    out = dict.fromkeys(LINK_CLASSES, 0.0)
    for group, nbytes in by_group.items():
        out[links[group]] += nbytes or 0.0
    return out
