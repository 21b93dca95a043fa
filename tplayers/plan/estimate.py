"""`estimate`: the memory, FLOPs, communication and step time of one layout, stage by stage
(`MemoryBreakdown`, `StageEstimate`, `Estimate`), from the formulas of the other modules."""

from __future__ import annotations

from dataclasses import dataclass

from tplayers.plan.comm import (
    _link_bandwidth,
    all_gather_bytes,
    all_reduce_bytes,
    by_link,
    dp_bytes_from_tensors,
    dp_bytes_per_step,
    grid_links,
    group_link,
    tp_bytes_per_layer,
)
from tplayers.plan.context import context_estimate
from tplayers.plan.experts import ep_bytes_per_layer, expert_tensors, moe_mlp_flops_per_token, moe_tp_bytes_per_layer
from tplayers.plan.flops import _forward_flops_per_token, _recompute_flops_per_token, _TokenFlops, training_flops
from tplayers.plan.grid import (
    grid_flops_per_token,
    grid_imbalance,
    grid_layer_activation_bytes,
    grid_layer_params,
    grid_stage_tensors,
    grid_tp_bytes_per_microbatch,
)
from tplayers.plan.layout import Assumptions, Layout
from tplayers.plan.memory import (
    LOGITS_BYTES,
    _embedding_activation_bytes,
    _output_activation_bytes,
    gathered_param_bytes,
    layer_activation_bytes,
    model_state_bytes,
    stage_tensors,
    zero_state_bytes_per_rank,
)
from tplayers.plan.results import Estimate, MemoryBreakdown, StageEstimate
from tplayers.plan.rules import validate_layout
from tplayers.plan.schedule import bubble_fraction, microbatches_in_flight
from tplayers.plan.specs import (
    GROUPS,
    ClusterSpec,
    GiB,
    ModelSpec,
    Precision,
    _layer_params,
    _norm_params,
    ceil_share,
    kv_rows_exchanged,
    moe_layers,
    padded_vocab,
    tp_imbalance,
)

# Megatron-Core DDP's default gradient bucket: max(40M, 1M * dp) parameters.
DP_BUCKET_PARAMS = 40_000_000
DP_BUCKET_PARAMS_PER_RANK = 1_000_000
# Backward of a matmul costs two forwards (dgrad + wgrad), so it is 2/3 of fwd + bwd.
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class _Context:
    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    precision: Precision
    assumptions: Assumptions
    tp_rank: int = 0  # whose share of uneven splits: the most loaded (`_most_loaded_rank`), unless asked per rank

    def layers(self, stage: int) -> tuple[int, int]:
        """(dense layers, MoE layers) of pipeline `stage`: its chunks, round-robin when interleaved."""
        pp, v = self.layout.pp, self.layout.virtual_stages
        per_stage, per_chunk = self.model.layers // pp, self.model.layers // (pp * v)
        if not self.model.has_dims:
            return per_stage, 0
        moe = sum(moe_layers(self.model, (stage + i * pp) * per_chunk, per_chunk) for i in range(v))
        return per_stage - moe, moe

    @property
    def imbalance(self) -> float:
        return self.assumptions.routing_imbalance

    @property
    def vocab(self) -> int:
        """The rows the vocabulary-parallel layers split: Megatron pads them to a multiple,
        tplayers splits the vocabulary as it is (uneven rows)."""
        if self.assumptions.implementation == "tplayers" or self.layout.tp_grid:
            return self.model.vocab
        return padded_vocab(self.model.vocab, self.layout.tp, self.assumptions.vocab_divisible_by)


def _stage_params(ctx: _Context, stage: int) -> float:
    """Parameters one GPU of `stage` holds after TP sharding (before ZeRO).

    A count-only model splits evenly: num_params / (tp*pp)."""
    model, layout = ctx.model, ctx.layout
    if not model.has_dims:
        return model.num_params / (layout.tp * layout.pp)
    if layout.tp_grid:
        return sum(r * c for r, c, _ in _stage_tensors(ctx, stage))
    tp, pp = layout.tp, layout.pp
    word = ceil_share(ctx.vocab, tp) * model.hidden
    dense, moe = ctx.layers(stage)
    params = dense * _layer_params(model, tp) + (moe and moe * _layer_params(model, tp, ep=layout.ep, moe=True))
    if stage == 0:
        params += word + (model.max_positions * model.hidden if model.position_embedding == "learned" else 0)
    if stage == pp - 1:
        params += _norm_params(model)
        if not model.tied_embeddings or pp > 1:
            params += word
    return params


def _zero3_buffer(ctx: _Context, stage: int) -> float:
    """ZeRO-3 gathers one unit at a time: the largest of a layer, the embedding, the LM head.
    ZeRO-2 (FSDP2) gathers every parameter once per step and holds them through backward."""
    model, layout = ctx.model, ctx.layout
    if layout.zero_stage < 2 or layout.dp == 1 or not model.has_dims:
        return 0.0
    if layout.zero_stage == 2:
        experts = gathered_param_bytes(_stage_expert_tensors(ctx, stage), ctx.precision, dp=layout.dp // layout.ep)
        return gathered_param_bytes(_stage_tensors(ctx, stage), ctx.precision, dp=layout.dp) + experts
    units = [grid_layer_params(model, layout.tp_grid) if layout.tp_grid else _layer_params(model, layout.tp)]
    if ctx.layers(stage)[1]:  # a MoE layer: its block and its experts, gathered together
        units.append(_layer_params(model, layout.tp, ep=layout.ep, moe=True))
    if stage in (0, layout.pp - 1):
        units.append(ceil_share(ctx.vocab, layout.tp) * model.hidden)
    return max(units) * ctx.precision.param_bytes


def _stage_activations(ctx: _Context, stage: int) -> float | None:
    """Peak activation bytes of one GPU of `stage` (see `layer_activation_bytes`).

    layers_per_stage * micro-batches in flight * per-layer bytes, plus, during the backward of a
    recomputed layer, that layer's rematerialised activations (once); stage 0 adds the embedding
    dropout mask per micro-batch in flight (Korthikanti's s*b*h*p/t, min(p, m) for 1F1B), the
    last stage the output layer and fp32 logits per micro-batch in flight."""
    model, layout, precision = ctx.model, ctx.layout, ctx.precision
    if not model.has_dims:
        return None
    kw = dict(
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        activation_bytes=precision.activation_bytes,
        implementation=ctx.assumptions.implementation,
        tp_rank=ctx.tp_rank,
    )
    mb, tp, sp, pp, m = layout.micro_batch, layout.tp, layout.sequence_parallel, layout.pp, layout.num_microbatches
    if layout.tp_grid:  # a grid's edges: tplayers' at tp = r x c, whole sequence (gathered at the exit)
        kw = dict(grid=layout.tp_grid, activation_bytes=precision.activation_bytes, tp_rank=ctx.tp_rank,
                  sequence_parallel=sp)  # fmt: skip
        layer_bytes, sp = grid_layer_activation_bytes, False
    else:
        layer_bytes = layer_activation_bytes
    in_flight = microbatches_in_flight(layout.schedule, stage, pp, m, layout.virtual_stages)
    total = rematerialised = 0.0
    for moe, layers in zip((False, True), ctx.layers(stage), strict=True):
        if not layers:
            continue
        if moe:
            kw.update(moe=True, ep=layout.ep, routing_imbalance=ctx.imbalance)
        per_layer = layer_bytes(model, mb, recompute=layout.recompute, **kw)
        total += layers * in_flight * per_layer
        rematerialised = max(rematerialised, layer_bytes(model, mb, recompute="none", **kw) - per_layer)
    total += rematerialised
    micro_batches_held = m if layout.schedule == "gpipe" else min(pp - stage, m)
    if stage == 0:
        total += micro_batches_held * _embedding_activation_bytes(model, mb, tp, sp)
    if stage == pp - 1:
        implementation = "tplayers" if layout.tp_grid else ctx.assumptions.implementation
        out = _output_activation_bytes(
            model, mb, tp, sp, precision.activation_bytes, ctx.vocab, implementation, ctx.tp_rank
        )
        total += micro_batches_held * out
    return total


def _stage_tensors(ctx: _Context, stage: int) -> list:
    model, layout = ctx.model, ctx.layout
    if layout.tp_grid:
        return grid_stage_tensors(
            model, layout.tp_grid, vocab=ctx.vocab, layers=model.layers // layout.pp, first=stage == 0,
            last=stage == layout.pp - 1, lm_head=not model.tied_embeddings or layout.pp > 1, tp_rank=ctx.tp_rank,
        )  # fmt: skip
    return stage_tensors(
        model, tp=layout.tp, vocab=ctx.vocab, layers=model.layers // layout.pp, first=stage == 0,
        last=stage == layout.pp - 1, lm_head=not model.tied_embeddings or layout.pp > 1,
        sequence_parallel=layout.sequence_parallel, tp_rank=ctx.tp_rank, moe_layers=ctx.layers(stage)[1],
    )  # fmt: skip


def _stage_expert_tensors(ctx: _Context, stage: int) -> list:
    """The routed experts' tensors of `stage` (reduced over the dp / ep expert-data-parallel replicas)."""
    return expert_tensors(ctx.model, ctx.layout.tp, ctx.layout.ep, ctx.layers(stage)[1], ctx.tp_rank)


def _state_bytes(ctx: _Context, stage: int) -> list[tuple]:
    """(params, grads, optimizer) bytes of each data-parallel replica: the dense tensors over dp,
    the experts over their dp / ep replicas (replica d holds expert-data-parallel shard d // ep);
    under ZeRO-1 with experts the dense optimizer state too (one ZeroRedundancyOptimizer over them)."""
    layout, precision, edp = ctx.layout, ctx.precision, ctx.layout.dp // ctx.layout.ep
    over = edp if layout.zero_stage == 1 and layout.ep > 1 else layout.dp
    dense = zero_state_bytes_per_rank(_stage_tensors(ctx, stage), precision, zero_stage=layout.zero_stage, dp=over)
    experts = zero_state_bytes_per_rank(_stage_expert_tensors(ctx, stage), precision, zero_stage=layout.zero_stage,
                                        dp=edp)  # fmt: skip
    step = layout.ep if over == edp else 1
    return [tuple(a + b for a, b in zip(dense[d // step], experts[d // layout.ep], strict=True))
            for d in range(layout.dp)]  # fmt: skip


def _dp_bytes(ctx: _Context, stage: int) -> float:
    layout, m, p, c = ctx.layout, ctx.layout.num_microbatches, ctx.precision, ctx.layout.compression
    edp, tensors = layout.dp // layout.ep, _stage_tensors(ctx, stage)
    if layout.zero_stage == 1 and layout.ep > 1:  # the gradients' mean over dp, the updated weights over edp
        dense = dp_bytes_from_tensors(tensors, layout.dp, 0, m, p, c)
        dense += all_gather_bytes(sum(r * k for r, k, _ in tensors) * p.param_bytes, edp)
    else:
        dense = dp_bytes_from_tensors(tensors, layout.dp, layout.zero_stage, m, p, c)
    return dense + dp_bytes_from_tensors(_stage_expert_tensors(ctx, stage), edp, layout.zero_stage, m, p, c)


def _stage_memory(ctx: _Context, stage: int, params: float) -> MemoryBreakdown:
    """Model states of the most loaded data-parallel replica: with the model's dimensions, tensor by
    tensor as tplayers' ZeRO engines hold them (padding, whole-tensor optimizer partitions; see
    `zero_state_bytes_per_rank`), else the ZeRO paper's even split of `params`."""
    layout = ctx.layout
    if ctx.model.has_dims:
        p, g, o = max(_state_bytes(ctx, stage), key=sum)
    else:
        p, g, o = model_state_bytes(params, ctx.precision, zero_stage=layout.zero_stage, dp=layout.dp)
    return MemoryBreakdown(p, g, o, _stage_activations(ctx, stage), _zero3_buffer(ctx, stage), stage)


def model_state_bytes_per_rank(
    model: ModelSpec, layout: Layout, precision: Precision | None = None, *, assumptions=None, stage: int = 0,
    tp_rank: int = 0,
) -> list[tuple]:  # fmt: skip
    """(params, grads, optimizer) bytes of each data-parallel replica of pipeline `stage` on TP rank
    `tp_rank` (0 by default; `estimate` prices the most loaded), tensor by tensor
    (`zero_state_bytes_per_rank`); needs the model's dimensions."""
    ctx = _Context(model, None, layout, _resolve_precision(precision), assumptions or Assumptions(), tp_rank)
    return _state_bytes(ctx, stage)


def dp_bytes_per_rank(
    model: ModelSpec, layout: Layout, precision: Precision | None = None, *, assumptions=None, stage: int = 0,
    tp_rank: int = 0,
) -> float:  # fmt: skip
    """Data-parallel bytes per step of pipeline `stage` on TP rank `tp_rank` (its tensors' padding:
    `dp_bytes_from_tensors`); needs the model's dimensions."""
    ctx = _Context(model, None, layout, _resolve_precision(precision), assumptions or Assumptions(), tp_rank)
    return _dp_bytes(ctx, stage)


def activation_bytes_per_rank(
    model: ModelSpec, layout: Layout, precision: Precision | None = None, *, assumptions=None, stage: int = 0,
    tp_rank: int = 0,
) -> float | None:  # fmt: skip
    """Peak activation bytes of pipeline `stage` on TP rank `tp_rank` (`estimate(...).memory.
    activations` is the most loaded stage's rank 0); needs the model's dimensions."""
    ctx = _Context(model, None, layout, _resolve_precision(precision), assumptions or Assumptions(), tp_rank)
    return _stage_activations(ctx, stage)


def _stage_flops_per_microbatch(ctx: _Context, stage: int) -> float:
    """Hardware matmul FLOPs of one GPU of `stage` for one micro-batch (fwd + bwd + recompute)."""
    model, layout = ctx.model, ctx.layout
    if layout.tp_grid:
        dense, attention, logits = grid_flops_per_token(model, layout.tp_grid, ctx.vocab)
        kinds = [(_TokenFlops(dense, attention, logits), model.layers // layout.pp)]
    else:  # the most loaded rank's
        kinds = [(_forward_flops_per_token(model, ctx.vocab, layout.tp, moe=moe, imbalance=ctx.imbalance), n)
                 for moe, n in zip((False, True), ctx.layers(stage), strict=True) if n]  # fmt: skip
    flops = sum(n * (3 * f.layer + _recompute_flops_per_token(f, layout.recompute)) for f, n in kinds)
    per_token = kinds[0][0]
    if stage == layout.pp - 1:
        flops += 3 * per_token.logits
    return flops * model.seq_len * layout.micro_batch


def _stage_routed_flops_per_microbatch(ctx: _Context, stage: int) -> float:
    """Of `_stage_flops_per_microbatch`, the routed experts' grouped GEMMs (fwd + bwd + recompute)."""
    model, layout = ctx.model, ctx.layout
    moe = ctx.layers(stage)[1]
    if not moe:
        return 0.0
    routed = moe_mlp_flops_per_token(model, layout.tp, imbalance=ctx.imbalance)
    routed -= moe_mlp_flops_per_token(model, layout.tp, imbalance=0)
    passes = 3 + (layout.recompute == "full")
    return moe * passes * routed * model.seq_len * layout.micro_batch


def _stage_ep_bytes_per_microbatch(ctx: _Context, stage: int) -> float:
    """The dispatch and combine all-to-alls of the stage's MoE layers (`ep_bytes_per_layer`), each
    TP rank dispatching its sequence slice under sequence parallelism, all its tokens otherwise."""
    layout = ctx.layout
    # the rank holding most of the sequence (the first ones, where tp does not divide it)
    tokens = -(-ctx.model.seq_len // (layout.tp if layout.sequence_parallel else 1)) * layout.micro_batch
    per_layer = ep_bytes_per_layer(ctx.model, tokens, layout.ep, ctx.precision.activation_bytes,
                                   imbalance=ctx.imbalance, recompute=layout.recompute)  # fmt: skip
    return ctx.layers(stage)[1] * per_layer


def _moe_tp_bytes_per_layer(ctx: _Context) -> float:
    """What a MoE layer's TP bytes differ by from a dense layer's (whose MLP is one pair of
    all-reduces, or of all-gather + reduce-scatter under sequence parallelism): the routed
    experts' own pair, or with ep > 1 and sequence parallelism the received rows gathered and
    reduce-scattered (`moe_tp_bytes_per_layer`); the shared experts' pair besides (an MLP of
    their own); under sequence parallelism the router's gradient all-reduced (it saw a slice)."""
    model, layout, d = ctx.model, ctx.layout, ctx.precision.activation_bytes
    tp, tokens = layout.tp, model.seq_len * layout.micro_batch
    passes = 1 + (layout.recompute == "full") / 2  # the forward's two of the four again
    pair = 2 * all_reduce_bytes(tokens * model.hidden * d, tp)
    routed = pair
    if layout.sequence_parallel and layout.ep > 1:
        routed = moe_tp_bytes_per_layer(model, tokens / tp, tp, layout.ep, d)
    extra = passes * (routed - pair + (pair if model.shared_ffn else 0))
    if layout.sequence_parallel:
        extra += all_reduce_bytes(model.experts * model.hidden * ctx.precision.param_bytes, tp)
    return extra


def _stage_tp_bytes_per_microbatch(ctx: _Context, stage: int) -> float:
    """TP bytes per GPU per micro-batch: the layers' collectives (`tp_bytes_per_layer`), plus,
    where key/value heads are shared by several ranks, the exchange of their gradients in each
    backward (`kv_rows_exchanged`: all-to-all with the ranks sharing them, or an all-reduce where
    all hold the same one); under sequence parallelism the
    all-reduce of the gradients of the replicated weights that saw a sequence slice (the two
    norms; Megatron also its row-parallel biases); the vocab-parallel embedding's forward
    all-reduce (stage 0); the LM head's backward all-reduce and the cross-entropy's three
    all-reduces of s*b fp32 values (last stage). These weight gradients are all-reduced as
    autograd produces them, in the parameter's dtype (param_bytes). `Assumptions.implementation`
    "tplayers": the cross-entropy all-gathers 4 fp32 statistics and the target id per row
    instead, and under sequence parallelism the first block's entry (backward) and the last
    block's exit (forward) each all-gather s*b*h."""
    model, layout = ctx.model, ctx.layout
    tp, mb, d = layout.tp, layout.micro_batch, ctx.precision.activation_bytes
    if tp == 1:
        return 0.0
    if layout.tp_grid:
        return sum(_grid_tp_bytes_per_microbatch(ctx, stage).values())
    tplayers = ctx.assumptions.implementation == "tplayers"
    per_layer = tp_bytes_per_layer(model, mb, tp, layout.recompute, d)
    grad_bytes = ctx.precision.param_bytes
    rows, same = kv_rows_exchanged(model, tp)
    if rows:  # the shared key/value heads' gradients, k and v: all-reduced, or exchanged with each sharer
        kv_bytes = 2 * rows * (model.hidden + (1 if model.linear_bias else 0)) * grad_bytes
        per_layer += all_reduce_bytes(kv_bytes, tp) if same else kv_bytes
    if layout.sequence_parallel:
        seq_sliced = 2 * _norm_params(model) + (2 * model.hidden if model.linear_bias and not tplayers else 0)
        per_layer += all_reduce_bytes(seq_sliced * grad_bytes, tp)
    dense, moe = ctx.layers(stage)
    total = (dense + moe) * per_layer + (moe * _moe_tp_bytes_per_layer(ctx) if moe else 0.0)
    return total + _edge_bytes(ctx, stage, tp, tplayers, layout.sequence_parallel)


def _edge_bytes(ctx: _Context, stage: int, tp: int, tplayers: bool, sequence_parallel: bool) -> float:
    """The vocabulary-parallel edges over a group of `tp`: the embedding's forward all-reduce
    (stage 0), the LM head's backward all-reduce and the cross-entropy (last stage); under
    sequence parallelism (tplayers) the blocks' entry and exit all-gathers."""
    model, mb, d = ctx.model, ctx.layout.micro_batch, ctx.precision.activation_bytes
    sbh = model.seq_len * mb * model.hidden * d
    sp_edge = all_gather_bytes(sbh, tp) if tplayers and sequence_parallel else 0.0
    rows, total = model.seq_len * mb, 0.0
    if stage == 0:
        total += all_reduce_bytes(sbh, tp) + sp_edge
    if stage == ctx.layout.pp - 1:
        if tplayers:
            # every rank's (rows + 1, 5) fp32: 4 statistics and the target per row, then its split
            cross_entropy = all_gather_bytes(tp * (rows + 1) * 5 * 4, tp)
        else:
            cross_entropy = 3 * all_reduce_bytes(rows * LOGITS_BYTES, tp)
        total += all_reduce_bytes(sbh, tp) + sp_edge + cross_entropy
    return total


def _grid_tp_bytes_per_microbatch(ctx: _Context, stage: int) -> dict[str, float]:
    """A grid's TP bytes per micro-batch by the group they cross: "tp_r", "tp_c" (the blocks,
    `grid_tp_bytes_per_microbatch`) and "tp_all", the vocabulary-parallel edges over every rank
    of the grid (tplayers' edges at tp = r x c)."""
    axes = grid_tp_bytes_per_microbatch(
        ctx.model, ctx.layout, ctx.precision.activation_bytes, stage, grad_bytes=ctx.precision.param_bytes
    )
    return {**axes, "tp_all": _edge_bytes(ctx, stage, ctx.layout.tp, True, False)}


def _stage_pp_bytes_per_microbatch(ctx: _Context, stage: int) -> float:
    """Point-to-point bytes one GPU sends per micro-batch: the s*b*h activation to the next
    stage and its gradient to the previous; v sends each way per micro-batch when interleaved.
    Megatron splits them over the TP ranks (Narayanan et al. 2021 Sec. 4.1, scatter/gather
    optimisation); tplayers' stages (torch's) send the whole activation from every TP rank,
    sequence-sharded under sequence parallelism; on a 2-D grid its tp_c share of the hidden
    features (the grid's residual stream between blocks)."""
    model, layout = ctx.model, ctx.layout
    pp, v = layout.pp, layout.virtual_stages
    if pp == 1:
        return 0.0
    split = layout.tp if ctx.assumptions.implementation != "tplayers" or layout.sequence_parallel else 1
    hidden = model.hidden / split
    if layout.tp_grid:  # (T, H / c), or (T / r, H / c) with sequence parallelism
        r, c = layout.tp_grid
        hidden = ceil_share(model.hidden, c) / (r if layout.sequence_parallel else 1)
    size = model.seq_len * layout.micro_batch * hidden * ctx.precision.activation_bytes
    forward_sends = v - (1 if stage == pp - 1 else 0)
    backward_sends = v - (1 if stage == 0 else 0)
    return (forward_sends + backward_sends) * size


def _dp_exposed_time(ctx: _Context, dp_time: float, params: float, compute_per_mb: float) -> float:
    """DP time not hidden by compute (see `Assumptions.overlap_dp_comm`)."""
    layout = ctx.layout
    if not ctx.assumptions.overlap_dp_comm or dp_time == 0:
        return dp_time
    if layout.zero_stage >= 2:
        hideable = layout.num_microbatches * compute_per_mb
    else:
        hideable = BACKWARD_SHARE * compute_per_mb
    bucket = max(DP_BUCKET_PARAMS, DP_BUCKET_PARAMS_PER_RANK * layout.dp)
    last_bucket = dp_time * min(1.0, bucket / params)
    return min(dp_time, max(dp_time - hideable, last_bucket))


def _optimizer_time(ctx: _Context, params: float, stage: int) -> float:
    """The optimizer step is HBM-bound: it reads and writes its states (2x optimizer bytes),
    reads the gradients and writes the parameters, for its share under ZeRO >= 1 (1/dp; the
    experts' 1/(dp / ep), and the dense ones' too under ZeRO-1 with experts)."""
    precision, layout, edp = ctx.precision, ctx.layout, ctx.layout.dp // ctx.layout.ep
    experts = sum(r * c for r, c, _ in _stage_expert_tensors(ctx, stage)) if ctx.model.has_dims else 0
    dense_over = edp if layout.zero_stage == 1 and layout.ep > 1 else layout.dp
    local = (params - experts) / dense_over + experts / edp if layout.zero_stage >= 1 else params
    touched = local * (2 * precision.optimizer_bytes + precision.grad_bytes + precision.param_bytes)
    return touched / ctx.cluster.hbm_bandwidth


def _stage_estimate(ctx: _Context, stage: int, links: dict[str, str], bubble: float) -> StageEstimate:
    model, layout, cluster = ctx.model, ctx.layout, ctx.cluster
    params = _stage_params(ctx, stage)
    memory = _stage_memory(ctx, stage, params)
    m = layout.num_microbatches
    if model.has_dims:
        dp_bytes = _dp_bytes(ctx, stage)
    else:
        dp_bytes = dp_bytes_per_step(params, layout.dp, layout.zero_stage, m, ctx.precision, layout.compression)
    if not model.has_dims:
        comm = {"tp": None, "pp": None, "dp": dp_bytes, "ep": None}
        return StageEstimate(stage, params, memory, None, comm, None)
    flops_mb = _stage_flops_per_microbatch(ctx, stage)
    # a grid's bytes by the axis they cross, each on its own link (computed once: search prices thousands)
    by_axis = _grid_tp_bytes_per_microbatch(ctx, stage) if layout.tp_grid else None
    tp_mb = sum(by_axis.values()) if by_axis else _stage_tp_bytes_per_microbatch(ctx, stage)
    pp_mb = _stage_pp_bytes_per_microbatch(ctx, stage)
    ep_mb = _stage_ep_bytes_per_microbatch(ctx, stage)
    comm = {"tp": m * tp_mb, "pp": m * pp_mb, "dp": dp_bytes, "ep": m * ep_mb}
    assume = ctx.assumptions
    routed_mb = _stage_routed_flops_per_microbatch(ctx, stage)
    grouped = assume.grouped_gemm_efficiency or assume.compute_efficiency
    compute_mb = (flops_mb - routed_mb) / (cluster.peak_flops * assume.compute_efficiency)
    compute_mb += routed_mb / (cluster.peak_flops * grouped)
    timed = by_axis or {"tp": tp_mb}
    tp_time_mb = sum(b / _link_bandwidth(cluster, links[a]) for a, b in timed.items()) * (1 - assume.tp_comm_overlap)
    pp_time_mb = pp_mb / _link_bandwidth(cluster, links["pp"]) * (1 - assume.pp_comm_overlap)
    ep_time_mb = ep_mb / _link_bandwidth(cluster, links["ep"])  # exposed: the experts wait for their tokens
    dp_time = dp_bytes / _link_bandwidth(cluster, links["dp"])
    times = {
        "compute": m * compute_mb,
        "tp": m * tp_time_mb,
        "pp": m * pp_time_mb,
        "ep": m * ep_time_mb,
        "bubble": bubble * m * (compute_mb + tp_time_mb + pp_time_mb + ep_time_mb),
        "dp": _dp_exposed_time(ctx, dp_time, params, compute_mb),
        "optimizer": _optimizer_time(ctx, params, stage),
    }
    axes = {a: m * b for a, b in by_axis.items()} if by_axis else None
    return StageEstimate(stage, params, memory, m * flops_mb, comm, times, axes)


def estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    layout: Layout,
    precision: Precision | None = None,
    *,
    assumptions: Assumptions | None = None,
) -> Estimate:
    """Memory, FLOPs, communication and step time of `layout` (see the `tplayers.plan` docstring).

    An invalid layout (GPU count, divisibility, TP across nodes, schedule rules: see
    `validate_layout`) is bad input: ValueError listing every reason. One that is valid but
    does not fit in memory comes back with its numbers, `fits=False` and a reason naming the
    bytes needed and available. `precision` is a `Precision` or a preset name.
    """
    est = _estimate(model, cluster, layout, precision, assumptions)
    if not est.valid:
        raise ValueError(f"invalid layout {layout.describe()}: " + "; ".join(est.reasons))
    return est


def _most_loaded_rank(model: ModelSpec, layout: Layout) -> int:
    """The TP rank holding the most of a layer (the first of them): rank 0 for ceil shares, another
    where its query heads read more key/value heads (28 heads / 4 over 8: rank 1's read two)."""
    if layout.tp_grid or not model.has_dims or layout.tp == 1:
        return 0
    per_rank = [_layer_params(model, layout.tp, r) for r in range(layout.tp)]
    return per_rank.index(max(per_rank))


def _estimate(model, cluster, layout, precision, assumptions) -> Estimate:
    """`estimate`, returning an invalid layout as `valid=False` with its reasons (for `search`)."""
    precision = _resolve_precision(precision)
    assumptions = Assumptions() if assumptions is None else assumptions
    if layout.cp > 1:  # priced from the dp x cp layout of 1/cp-long sequences (tplayers.plan.context)
        return context_estimate(model, cluster, layout, precision, assumptions, _estimate, activation_bytes_per_rank)
    usable = cluster.hbm_bytes * (1 - assumptions.hbm_reserve_fraction)
    base = dict(layout=layout, num_gpus=cluster.num_gpus, num_params=model.num_params, usable_hbm_bytes=usable)
    invalid = validate_layout(model, cluster, layout)
    if invalid:
        return Estimate(**base, reasons=tuple(invalid), valid=False)
    ctx = _Context(model, cluster, layout, precision, assumptions, _most_loaded_rank(model, layout))
    links = {g: group_link(cluster, layout, g) for g in GROUPS}
    if layout.tp_grid:
        links.update(grid_links(cluster, layout))
        links["tp"] = links["tp_all"] = "inter_node" if "inter_node" in (links["tp_r"], links["tp_c"]) else "intra_node"
    bubble = bubble_fraction(layout.pp, layout.num_microbatches, layout.schedule, layout.virtual_stages)
    stages = tuple(_stage_estimate(ctx, i, links, bubble) for i in range(layout.pp))
    memory = max((s.memory for s in stages), key=lambda mem: mem.total)
    reasons, notes = [], []
    if memory.total > usable:
        reasons.append(
            f"needs {memory.total / 1e9:.1f} GB per GPU (stage {memory.stage}) > {usable / 1e9:.1f} GB usable "
            f"of {cluster.hbm_bytes / 1e9:.1f} GB ({cluster.hbm_bytes / GiB:.0f} GiB) on {cluster.name}"
        )
    timed = model.has_dims
    critical = max(stages, key=lambda s: s.step_time_s) if timed else stages[0]
    if not timed:
        notes.append("model given by num_params only: activations, FLOPs, TP/PP traffic and time unknown")
    imbalance = None
    if timed:
        imbalance = grid_imbalance(model, layout.tp_grid) if layout.tp_grid else tp_imbalance(model, layout.tp)
    if imbalance is not None and imbalance > 1 + 1e-9:
        notes.append(
            f"uneven tensor-parallel split (heads {model.heads}, kv heads {model.kv_heads}, ffn {model.ffn_hidden} "
            f"over tp {layout.describe().split()[0][3:]}): the most loaded rank holds {imbalance:.3f}x the mean "
            "rank's share of each layer; "
            "memory, FLOPs and time are that rank's"
        )
    by_group = dict(critical.comm_bytes_by_group)
    if critical.comm_bytes_by_axis:  # a grid's tp bytes on their axes' links
        by_group = {**{g: b for g, b in by_group.items() if g != "tp"}, **critical.comm_bytes_by_axis}
    comm = by_link(by_group, links)
    if layout.tp_grid and timed:
        r, c = layout.tp_grid
        notes.append(
            f"2-D grid {r}x{c} (tplayers.hf.grid): each row's {c} ranks repeat its heads' attention core; "
            f"tp_r over {links['tp_r']}, tp_c over {links['tp_c']}, the vocabulary-parallel edges over all {r * c}"
        )
    tokens = layout.global_batch * model.seq_len if timed else None
    model_flops = training_flops(model, layout.global_batch) if timed else None
    hardware_flops = sum(s.hardware_flops for s in stages) * layout.dp * layout.tp if timed else None
    step = critical.step_time_s
    mfu = model_flops / (step * cluster.num_gpus * cluster.peak_flops) if timed else None
    return Estimate(
        **base,
        reasons=tuple(reasons),
        valid=True,
        memory=memory,
        stages=stages,
        model_flops=model_flops,
        hardware_flops=hardware_flops,
        bubble_fraction=bubble,
        comm_bytes=comm,
        comm_bytes_by_group=dict(critical.comm_bytes_by_group),
        comm_links=links,
        comm_bytes_by_axis=critical.comm_bytes_by_axis,
        critical_stage=critical.stage,
        time_breakdown=critical.time_breakdown,
        step_time_s=step,
        mfu=mfu,
        tokens_per_step=tokens,
        notes=tuple(notes),
        tp_imbalance=imbalance,
    )


def _resolve_precision(precision) -> Precision:
    if precision is None:
        return Precision()
    if isinstance(precision, str):
        return Precision.preset(precision)
    if not isinstance(precision, Precision):
        raise ValueError(f"precision must be a Precision or a preset name, got {precision!r}")
    return precision
