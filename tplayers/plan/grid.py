"""2-D tensor parallelism in the planner: what rank (i, j) of an r x c grid holds, stores, computes
and sends per transformer layer, as `tplayers.parallelize(model, group=init_mesh(tp=(r, c))
["tp_r", "tp_c"])` lays out a Llama-style decoder (`tplayers.hf.grid`, `tplayers.nn.grid`):

    q / k / v    column-type: whole heads over tp_r, the hidden features over tp_c
    o_proj       row-type: the hidden features (its output) over tp_c, the heads over tp_r
    gate | up    column-type: ffn rows over tp_r (gate / up pairs together), hidden over tp_c
    down         row-type: hidden over tp_c, ffn over tp_r
    norms        the hidden features over tp_c (whole over tp_r)
    the edges    the word embedding and LM head vocabulary-parallel over all r x c ranks (the
                 grid flattened, as over a 1-D group), the final norm whole on every rank; the
                 residual stream split over tp_c between the blocks' entry and exit
    sequence     with sequence parallelism the residual stream's sequence split over tp_r too:
                 (T/r, H/c) per rank; the column-type layers gather it, the row-type ones
                 reduce-scatter (the same bytes as the all-reduces they replace), the norms'
                 weight gradients are summed over tp_r, and the entry / exit move both axes

The attention core of a rank's heads runs on each of the c ranks of its row (c x the 1-D
compute per head, no bytes). Rank (0, 0) holds the largest share of every split (torch.chunk),
whose step the others wait for; `tp_rank` t of the flattened grid is (t // c, t % c), tp_c
fastest, as `init_mesh` orders them.

Pure Python, like the rest of the estimator.
"""

from __future__ import annotations

import math

from tplayers.plan.comm import all_gather_bytes, all_reduce_bytes
from tplayers.plan.memory import MASK_BYTES
from tplayers.plan.specs import ModelSpec, ceil_share

AXES = ("tp_r", "tp_c")


def grid_rank(tp_rank: int, c: int) -> tuple[int, int]:
    """(i, j) of flattened tensor-parallel rank `tp_rank` on a grid of c columns."""
    return tp_rank // c, tp_rank % c


def grid_refusals(model: ModelSpec, grid: tuple[int, int]) -> list[str]:
    """Why `tplayers.parallelize` on this grid would refuse `model` (empty when it takes it)."""
    r, _ = grid
    reasons = []
    if not (model.gated_mlp and model.norm == "rmsnorm" and model.position_embedding == "rope"):
        reasons.append("a 2-D grid takes Llama-style models (gated MLP, RMSNorm, rotary positions)")
    if model.linear_bias:
        reasons.append("a 2-D grid's gated MLP has no biases (linear_bias)")
    for what, count in (("heads", model.heads), ("kv_heads", model.kv_heads)):
        if ceil_share(count, r, r - 1) == 0:
            reasons.append(f"{what} ({count}) over tp_r = {r} leave a rank none")
    group = model.heads // model.kv_heads
    if not reasons and [ceil_share(model.heads, r, i) for i in range(r)] != [
        group * ceil_share(model.kv_heads, r, i) for i in range(r)
    ]:
        reasons.append(f"{model.heads} heads in {model.kv_heads} key/value groups do not split over tp_r = {r}")
    return reasons


def _widths(model: ModelSpec, grid, tp_rank: int) -> tuple[int, int, int, int]:
    """(q, kv, ffn, h): rank (i, j)'s query rows, key (value) rows, ffn rows, hidden columns."""
    r, c = grid
    i, j = grid_rank(tp_rank, c)
    q = ceil_share(model.heads, r, i) * model.head_dim
    kv = ceil_share(model.kv_heads, r, i) * model.head_dim
    return q, kv, ceil_share(model.ffn_hidden, r, i), ceil_share(model.hidden, c, j)


def grid_layer_tensors(model: ModelSpec, grid, tp_rank: int = 0) -> list[tuple[int, int, bool]]:
    """(rows, columns, summed) of the tensors rank `tp_rank` holds of one layer (none is summed:
    every gradient on a grid is complete where it is held)."""
    q, kv, f, h = _widths(model, grid, tp_rank)
    return [(q, h, False), (kv, h, False), (kv, h, False), (h, q, False), (2 * f, h, False), (h, f, False),
            (h, 1, False), (h, 1, False)]  # fmt: skip


def grid_stage_tensors(
    model: ModelSpec, grid, *, vocab: int, layers: int, first: bool, last: bool, lm_head: bool, tp_rank: int = 0
) -> list:  # fmt: skip
    """`stage_tensors` on a grid: the stage's layers' blocks; the first stage the embedding's
    vocabulary rows over the r x c ranks, the last the final norm (whole) and the LM head's rows."""
    rows = ceil_share(vocab, grid[0] * grid[1], tp_rank)
    front = [(rows, model.hidden, False)] if first else []
    back = ([(model.hidden, 1, False)] + ([(rows, model.hidden, False)] if lm_head else [])) if last else []
    return front + layers * grid_layer_tensors(model, grid, tp_rank) + back


def grid_layer_params(model: ModelSpec, grid, tp_rank: int = 0) -> int:
    return sum(r * c for r, c, _ in grid_layer_tensors(model, grid, tp_rank))


def grid_imbalance(model: ModelSpec, grid) -> float:
    """The most loaded rank's layer parameters over the mean rank's."""
    per_rank = [grid_layer_params(model, grid, t) for t in range(grid[0] * grid[1])]
    return max(per_rank) * len(per_rank) / sum(per_rank)


def grid_layer_activation_bytes(
    model: ModelSpec, micro_batch: int, grid, *, recompute: str, activation_bytes: float, tp_rank: int = 0,
    sequence_parallel: bool = False,
) -> float:  # fmt: skip
    """`layer_activation_bytes` on a grid: what sits in the residual stream (two norm inputs, the
    q / k / v and MLP inputs, dropout masks) holds h / c features per token; Q, K, V, the
    attention output and the MLP's three intermediates their tp_r shares; the attention core its
    heads (whole sequence) on every rank of the row. With sequence parallelism the norm inputs,
    the masks and the layer input (full recompute) hold T / r tokens; the q / k / v and MLP
    inputs are kept gathered (whole sequence) for the weight gradients."""
    q, kv, f, h = _widths(model, grid, tp_rank)
    tokens, d = model.seq_len * micro_batch, activation_bytes
    split = grid[0] if sequence_parallel else 1
    if recompute == "full":
        return d * tokens * h / split
    mask = MASK_BYTES if model.dropout else 0
    stored = ((2 * d + 2 * mask) / split + 2 * d) * tokens * h + d * tokens * (2 * q + 2 * kv + 3 * f)
    if recompute == "selective":
        return stored
    core_bytes = d + (mask + d if model.dropout else 0)
    return stored + core_bytes * (q // model.head_dim) * model.seq_len * tokens


def grid_flops_per_token(model: ModelSpec, grid, vocab: int) -> tuple[float, float, float]:
    """(dense, attention core, logits) forward matmul FLOPs per token of one layer on rank (0, 0)."""
    q, kv, f, h = _widths(model, grid, 0)
    dense = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * h * f * 3
    return dense, 4 * model.seq_len * q, 2 * model.hidden * ceil_share(vocab, grid[0] * grid[1])


def grid_tp_bytes_per_layer(
    model: ModelSpec, micro_batch: int, r: int, c: int, activation_bytes: float, norm_bytes: float = 4,
    recompute: str = "none", sequence_parallel: bool = False, grad_bytes: float = 4,
) -> dict[str, float]:  # fmt: skip
    """{"tp_r": ..., "tp_c": ...}: bytes each rank sends over each grid axis per transformer layer
    per micro-batch (forward + backward), as `parallelize` on a 2-D mesh runs a Llama-style layer
    (T = seq_len x micro_batch tokens, widths at the largest share):

        tp_c  forward: q, k, v and the MLP's gate|up partial outputs (T x width / r each) all-reduced;
              backward: o_proj's and down_proj's input gradients (T x q / r, T x F / r); each of the
              two RMSNorms' sums of squares forward and backward (T fp32 values; T / r with
              sequence parallelism)
        tp_r  forward: o_proj's and down_proj's partial outputs (T x H / c);
              backward: the attention's input gradient (q, k, v's summed once) and gate|up's
              (T x H / c each). With sequence parallelism each all-reduce is a reduce-scatter and
              an all-gather of the same size (the same bytes), and the two norms' weight
              gradients (H / c each, in `grad_bytes`) are all-reduced over tp_r

    Full recomputation repeats the forward's collectives in backward."""
    t, d = model.seq_len * micro_batch, activation_bytes
    q, kv, f, h = _widths(model, (r, c), 0)
    norm_tokens = t / r if sequence_parallel else t
    forward_c = t * (q + 2 * kv + 2 * f) * d + 2 * norm_tokens * norm_bytes
    backward_c = t * (q + f) * d + 2 * norm_tokens * norm_bytes
    forward_r = backward_r = 2 * t * h * d
    again = 2 if recompute == "full" else 1
    norm_grads = all_reduce_bytes(2 * h * grad_bytes, r) if sequence_parallel else 0.0
    return {
        "tp_r": all_reduce_bytes(again * forward_r + backward_r, r) + norm_grads,
        "tp_c": all_reduce_bytes(again * forward_c + backward_c, c),
    }


def grid_tp_bytes_at_the_edges(
    model: ModelSpec, micro_batch: int, r: int, c: int, activation_bytes: float, *, entry: bool = True,
    exit: bool = True, sequence_parallel: bool = False,
) -> dict[str, float]:  # fmt: skip
    """{"tp_r", "tp_c"}: the blocks' entry (backward, first stage) and exit (forward, last stage)
    on a grid: T x H all-gathered over tp_c each; with sequence parallelism T / r x H over tp_c,
    then T x H over tp_r."""
    tokens, times = model.seq_len * micro_batch, entry + exit
    size = tokens * model.hidden * activation_bytes
    if not sequence_parallel:
        return {"tp_r": 0.0, "tp_c": times * all_gather_bytes(size, c)}
    return {"tp_r": times * all_gather_bytes(size, r), "tp_c": times * all_gather_bytes(size / r, c)}


def grid_tp_bytes_per_microbatch(
    model: ModelSpec, layout, activation_bytes: float, stage: int = 0, grad_bytes: float = 4
) -> dict[str, float]:  # fmt: skip
    """{"tp_r", "tp_c"}: one micro-batch's bytes per axis of pipeline `stage`'s layers and edges
    (`grad_bytes`: the parameters' gradient bytes, for the norms' sums under sequence parallelism)."""
    r, c = layout.tp_grid
    sp = layout.sequence_parallel
    layers = model.layers // layout.pp
    layer = grid_tp_bytes_per_layer(model, layout.micro_batch, r, c, activation_bytes, recompute=layout.recompute,
                                    sequence_parallel=sp, grad_bytes=grad_bytes)  # fmt: skip
    edges = grid_tp_bytes_at_the_edges(model, layout.micro_batch, r, c, activation_bytes, entry=stage == 0,
                                       exit=stage == layout.pp - 1, sequence_parallel=sp)  # fmt: skip
    return {axis: layers * layer[axis] + edges[axis] for axis in AXES}


def grid_mlp_bytes(
    tokens: int, hidden: int, ffn: int, r: int, c: int, activation_bytes: float, gated: bool = True
) -> dict[str, float]:
    """{"tp_r": ..., "tp_c": ...}: bytes each rank sends over each axis of an r x c grid for one
    MLP forward and backward on `tokens` tokens, as tplayers runs it (`tplayers.nn.GridLinear`'s
    column-type / row-type pair; ParallelMLP on a 2-D mesh):

        tp_c  forward: the first layer's partial output, T x F_in / r (F_in = 2F gated) all-reduced;
              backward: the second layer's input gradient, T x F / r
        tp_r  forward: the second layer's partial output, T x H / c;
              backward: the first layer's input gradient, T x H / c

    Sizes that do not divide are priced at the largest share (ceil)."""
    f_in = (2 if gated else 1) * ffn
    over_c = tokens * (math.ceil(f_in / r) + math.ceil(ffn / r)) * activation_bytes
    over_r = 2 * tokens * math.ceil(hidden / c) * activation_bytes
    return {"tp_r": all_reduce_bytes(over_r, r), "tp_c": all_reduce_bytes(over_c, c)}
