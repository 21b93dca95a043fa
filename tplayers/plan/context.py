"""Context parallelism in the estimate: `Layout(cp=...)` priced from the layout it resembles.

Each of the cp ranks of a context-parallel group holds the weights whole (as a data-parallel
replica does: gradients reduced, ZeRO sharded, over dp x cp) and 1/cp of every sequence, through
every layer (`tplayers.hf.context`). So a (tp, pp, dp, cp) layout is first priced as the (tp, pp,
dp x cp) layout of sequences 1/cp long (its weights, activations, TP / PP / DP traffic and linear
FLOPs), then corrected for what that leaves out:

    attention FLOPs  each local query attends to all S keys, not S / cp: the attention scores and
                     their backward cost cp times what the short sequence prices (a balanced
                     causal split gives every rank the same share)
    the ring         per layer per micro-batch, forward cp - 1 hops of the local K / V
                     (2 x S/cp x kv_hidden activation bytes each), backward cp - 1 again with
                     cp hops of their fp32 gradients; each hop overlaps the attention of the block
                     before it, so only what exceeds that attention is exposed
    ring buffers     the K / V block in flight beside the one attended, per layer in backward
    no score matrix  tplayers' context attention saves q, k, v, o and the log-sum-exp, never the
                     S/cp x S scores: the layer's activations are those of selective recompute
    FLOPs, tokens    the whole job's model FLOPs and tokens per step are the original model's
"""

from __future__ import annotations

import dataclasses
import math

from tplayers.plan.comm import group_link
from tplayers.plan.flops import training_flops
from tplayers.plan.specs import LINK_CLASSES


def ring_bytes_per_layer(model, micro_batch: int, cp: int, activation_bytes: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per layer per micro-batch: K / V never expanded."""
    block = 2 * math.ceil(model.seq_len / cp) * micro_batch * model.kv_heads * model.head_dim
    forward = (cp - 1) * block * activation_bytes
    return forward, forward + cp * block * 4  # the gradients travel in fp32


def attention_flops_per_layer(model, micro_batch: int, cp: int, tp: int) -> float:
    """Forward FLOPs of one rank's attention scores and weighted sum per layer per micro-batch
    (q k^T and p v over all S keys, its S/cp queries, its heads)."""
    heads = math.ceil(model.heads / tp)
    return 4 * math.ceil(model.seq_len / cp) * model.seq_len * heads * model.head_dim * micro_batch


def context_estimate(model, cluster, layout, precision, assumptions, estimate_fn, activation_bytes_per_rank):
    """`estimate_fn` (estimate's own) on the layout it resembles, corrected (module docstring);
    `activation_bytes_per_rank` estimate's (passed in: this module is imported by it)."""
    cp = layout.cp
    local = dataclasses.replace(model, seq_len=math.ceil(model.seq_len / cp))
    inner = dataclasses.replace(layout, dp=layout.dp * cp, cp=1)
    est = estimate_fn(local, cluster, inner, precision, assumptions)
    if not est.valid or not model.has_dims:
        return dataclasses.replace(est, layout=layout)
    layers = model.layers // layout.pp
    mb, m = layout.micro_batch, layout.num_microbatches
    d = precision.activation_bytes
    forward, backward = ring_bytes_per_layer(model, mb, cp, d)
    ring = layers * m * (forward + backward)
    # the short sequence priced 1/cp of each query's keys: the rest of fwd + bwd (3 passes)
    attention = attention_flops_per_layer(model, mb, cp, layout.tp)
    extra_flops = layers * m * 3 * attention * (1 - 1 / cp)
    rate = cluster.peak_flops * assumptions.compute_efficiency
    link = group_link(cluster, inner, "tp") if layout.tp > 1 else "intra_node"
    bandwidth = cluster.intra_node_bandwidth if link == "intra_node" else cluster.inter_node_bandwidth
    hop_attention = 3 * attention / cp / rate  # one block's fwd + bwd attention: what a hop hides behind
    hop_bytes = (forward + backward) / (2 * (cp - 1) + cp)
    exposed = layers * m * (2 * (cp - 1) + cp) * max(0.0, hop_bytes / bandwidth - hop_attention)
    buffers = layers * 2 * (forward / (cp - 1))  # one K / V block in flight per layer (backward)
    times = dict(est.time_breakdown, compute=est.time_breakdown["compute"] + extra_flops / rate, cp=exposed)
    activations = est.memory.activations or 0.0
    if layout.recompute == "none":
        activations = activation_bytes_per_rank(local, dataclasses.replace(inner, recompute="selective"), precision,
                                                assumptions=assumptions, stage=est.memory.stage)  # fmt: skip
    memory = dataclasses.replace(est.memory, activations=activations + buffers)
    by_group = dict(est.comm_bytes_by_group, cp=ring)
    comm = dict(est.comm_bytes or dict.fromkeys(LINK_CLASSES, 0.0))
    comm[link] = comm.get(link, 0.0) + ring
    step = sum(times.values())
    model_flops = training_flops(model, layout.global_batch)
    hardware = (est.hardware_flops or 0.0) + extra_flops * layout.num_gpus
    notes = (*est.notes, f"context parallelism over {cp} ranks: each holds 1/{cp} of every sequence; "
             f"{ring / 1e6:.1f} MB of K / V ring traffic per step, {exposed * 1e3:.2f} ms of it exposed")  # fmt: skip
    usable = est.usable_hbm_bytes
    reasons = () if memory.total <= usable else (
        f"needs {memory.total / 1e9:.1f} GB per GPU (stage {memory.stage}) > {usable / 1e9:.1f} GB usable on "
        f"{cluster.name}",)  # fmt: skip
    return dataclasses.replace(
        est, layout=layout, memory=memory, comm_bytes=comm, comm_bytes_by_group=by_group,
        comm_links=dict(est.comm_links or {}, cp=link), time_breakdown=times, step_time_s=step,
        model_flops=model_flops, hardware_flops=hardware, notes=notes, reasons=reasons,
        mfu=model_flops / (step * cluster.num_gpus * cluster.peak_flops),
    )  # fmt: skip
