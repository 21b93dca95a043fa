"""The validity rules of a layout: when `validate_layout` says a `Layout` cannot run a `ModelSpec`
on a `ClusterSpec` (GPU count, TP within a node, divisibility, schedule requirements)."""

from __future__ import annotations

from tplayers.plan.grid import grid_refusals
from tplayers.plan.layout import Layout
from tplayers.plan.specs import ClusterSpec, ModelSpec


def validate_layout(
    model: ModelSpec, cluster: ClusterSpec, layout: Layout, *, global_batch: int | None = None
) -> list[str]:
    """Reasons `layout` cannot run `model` on `cluster` (empty when it can).

    Checks the GPU count, TP within a node, a head per TP rank, layer divisibility, the
    interleaved schedule's requirements, a token per rank under sequence parallelism, and (with
    `global_batch`) dp * micro_batch * num_microbatches == global_batch. Widths never are:
    Megatron pads the vocabulary, tplayers splits it, the heads and ffn unevenly (priced at the
    most loaded rank).
    """
    reasons = []
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    if layout.num_gpus != cluster.num_gpus:
        reasons.append(f"tp*pp*dp = {tp}*{pp}*{dp} = {layout.num_gpus} != {cluster.num_gpus} GPUs in the cluster")
    if layout.tp_grid:
        reasons += _grid_reasons(cluster, layout)
    elif tp > cluster.gpus_per_node:
        reasons.append(f"tp={tp} > {cluster.gpus_per_node} GPUs per node: tensor parallelism must stay within a node")
    elif cluster.num_gpus > cluster.gpus_per_node and cluster.gpus_per_node % tp:
        reasons.append(
            f"tp={tp} does not divide {cluster.gpus_per_node} GPUs per node: some TP groups would span two nodes"
        )
    if global_batch is not None and layout.global_batch != global_batch:
        reasons.append(
            f"dp*micro_batch*num_microbatches = {dp}*{layout.micro_batch}*{layout.num_microbatches} = "
            f"{layout.global_batch} != global batch {global_batch}"
        )
    v = layout.virtual_stages
    if layout.schedule == "interleaved":
        if pp < 2:
            reasons.append(f"the interleaved schedule needs pp >= 2, got pp={pp}")
        if v < 2:
            reasons.append(f"the interleaved schedule needs virtual_stages >= 2, got {v}")
        if layout.num_microbatches % pp:
            reasons.append(
                f"num_microbatches ({layout.num_microbatches}) not divisible by pp ({pp}) "
                "(the interleaved schedule runs micro-batches in groups of pp)"
            )
    elif v != 1:
        reasons.append(f"virtual_stages={v} needs schedule='interleaved', got {layout.schedule!r}")
    if model.has_dims:
        reasons += _model_reasons(model, layout)
        if layout.tp_grid:
            reasons += grid_refusals(model, layout.tp_grid)
    return reasons + _expert_reasons(model, layout)


def _expert_reasons(model: ModelSpec, layout: Layout) -> list[str]:
    """What tplayers refuses for a mixture of experts: expert parallelism without experts, and a 2-D
    grid (`tplayers.hf.grid` takes a dense gated MLP)."""
    experts = model.has_dims and model.experts
    reasons = []
    if layout.ep > 1 and not experts:
        reasons.append(f"ep={layout.ep} needs a mixture of experts (ModelSpec.experts with its dimensions)")
    if experts and layout.tp_grid:
        reasons.append("a 2-D tensor-parallel grid takes dense models only (tplayers.hf.grid refuses experts)")
    return reasons


def _grid_reasons(cluster: ClusterSpec, layout: Layout) -> list[str]:
    """A grid: its tp_c rows (consecutive ranks) within a node, its tp_r columns may span nodes."""
    r, c = layout.tp_grid
    reasons = []
    if c > cluster.gpus_per_node or (cluster.num_gpus > cluster.gpus_per_node and cluster.gpus_per_node % c):
        reasons.append(f"tp_c={c} does not divide {cluster.gpus_per_node} GPUs per node: a grid row must stay in one")
    return reasons


def _model_reasons(model: ModelSpec, layout: Layout) -> list[str]:
    tp, pp, v = layout.tp, layout.pp, layout.virtual_stages
    reasons = []
    # Heads, key/value heads, ffn and vocabulary need not divide tp (uneven splits, priced at the most
    # loaded rank); a rank needs one query head for an HF attention forward to run.
    if model.heads < tp and not layout.tp_grid:  # a grid splits its heads over tp_r only
        reasons.append(f"heads ({model.heads}) < tp ({tp}): a rank would hold no attention head")
    if model.layers % pp:
        reasons.append(f"layers ({model.layers}) not divisible by pp ({pp})")
    elif layout.schedule == "interleaved" and model.layers % (pp * v):
        reasons.append(f"layers ({model.layers}) not divisible by pp*virtual_stages ({pp}*{v} = {pp * v})")
    split, over = (layout.tp_grid[0], "tp_r") if layout.tp_grid else (tp, "tp")
    if layout.sequence_parallel and model.seq_len < split:  # any length splits (tplayers.hf.sequence_split)
        reasons.append(f"sequence parallelism: seq_len ({model.seq_len}) < {over} ({split}): a rank holds no token")
    return reasons
