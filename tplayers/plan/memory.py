"""Memory formulas: model-state bytes under ZeRO (Rajbhandari et al. 2020) and the activation bytes
of a transformer layer and of the model's edges (Korthikanti et al. 2022)."""

from __future__ import annotations

from tplayers.plan.experts import moe_mlp_activation_bytes
from tplayers.plan.specs import (
    IMPLEMENTATION_CHOICES,
    RECOMPUTE_CHOICES,
    ZERO_STAGES,
    ModelSpec,
    Precision,
    _choice,
    _positive_int,
    ceil_share,
    local_dims,
)

# Dropout masks are stored as 1 byte per element (Korthikanti et al. 2022, Sec. 4.1).
MASK_BYTES = 1
# Cross-entropy keeps the logits in fp32 (Korthikanti et al. 2022, Sec. 4.3: 4sbv/t).
LOGITS_BYTES = 4


def model_state_bytes(num_params: float, precision: Precision | None = None, *, zero_stage: int = 0, dp: int = 1):
    """(params, grads, optimizer) bytes per GPU for `num_params` parameters on one model replica slice.

    ZeRO paper (Rajbhandari et al. 2020), Sec. 3.1 and Figure 1: unsharded (2 + 2 + K) * psi;
    stage 1 (P_os) shards the optimizer states over the dp ranks, stage 2 (P_os+g) also the
    gradients, stage 3 (P_os+g+p) also the parameters:
        params = psi * param_bytes / (dp if stage >= 3 else 1)
        grads = psi * grad_bytes / (dp if stage >= 2 else 1)
        optimizer = psi * optimizer_bytes / (dp if stage >= 1 else 1)
    E.g. psi = 7.5e9, dp = 64, K = 12: 120, 31.4, 16.6, 1.9 GB for stages 0-3.
    """
    precision = Precision() if precision is None else precision
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"unknown zero_stage {zero_stage!r}; valid: 0, 1, 2, 3")
    _positive_int("model_state_bytes", "dp", dp)
    params = num_params * precision.param_bytes / (dp if zero_stage >= 3 else 1)
    grads = num_params * precision.grad_bytes / (dp if zero_stage >= 2 else 1)
    optimizer = num_params * precision.optimizer_bytes / (dp if zero_stage >= 1 else 1)
    return params, grads, optimizer


def stage_tensors(
    model: ModelSpec, *, tp: int, vocab: int, layers: int, first: bool, last: bool, lm_head: bool,
    sequence_parallel: bool = False, tp_rank: int = 0, moe_layers: int = 0,
) -> list[tuple[int, int, bool]]:  # fmt: skip
    """(rows, columns, summed) of every parameter tensor TP rank `tp_rank` (0: the most loaded) of
    a stage holds, as tplayers
    lays out a Llama-style model: q, k, v, o; the MLP's gate|up fused into one (2f/t, h) tensor;
    norms (h, 1); biases (n, 1). `summed`: a replicated weight in the blocks that sees part of the
    sequence (a norm under sequence parallelism), which tplayers keeps whole under ZeRO 2-3.
    ZeRO's engines shard along the rows. `moe_layers` of the `layers` have experts: their router
    (E, h; summed like a norm) and shared experts here, the routed experts in
    `tplayers.plan.experts.expert_tensors` (reduced over another group)."""
    h, local = model.hidden, local_dims(model, tp, tp_rank)
    q, kv, f, v = local.q, local.kv, local.ffn, ceil_share(vocab, tp, tp_rank)
    norm = [(h, 1, sequence_parallel)] * (2 if model.norm == "layernorm" else 1)
    attention = [(q, h, False), (kv, h, False), (kv, h, False), (h, q, False)]
    if model.linear_bias:
        attention += [(q, 1, False), (kv, 1, False), (kv, 1, False), (h, 1, False)]
    attention += 2 * norm
    moe = [(model.experts, h + model.linear_bias, sequence_parallel)] + _mlp_tensors(
        model, ceil_share(model.shared_ffn, tp, tp_rank)
    )
    front, back = [], []
    if first:
        front.append((v, h, False))
        if model.position_embedding == "learned":
            front.append((model.max_positions, h, False))
    if last:
        back += [(r, c, False) for r, c, _ in norm]  # the final norm sees the whole sequence
        if lm_head:
            back.append((v, h, False))
    return front + (layers - moe_layers) * (attention + _mlp_tensors(model, f)) + moe_layers * (attention + moe) + back


def _mlp_tensors(model: ModelSpec, f: int) -> list[tuple[int, int, bool]]:
    """A dense MLP f columns wide on this rank: gate|up (or fc1) and down, with their biases."""
    if not f:
        return []
    up = (2 if model.gated_mlp else 1) * f
    tensors = [(up, model.hidden, False), (model.hidden, f, False)]
    return tensors + ([(up, 1, False), (model.hidden, 1, False)] if model.linear_bias else [])


def zero_state_bytes_per_rank(tensors, precision: Precision, *, zero_stage: int, dp: int) -> list[tuple]:
    """(params, grads, optimizer) bytes on each of the dp replicas, from `stage_tensors`, as
    tplayers' engines hold them (`tplayers.data_parallel`), padding included:

        stage 0  everything on every replica
        stage 1  the optimizer state of whole tensors, assigned largest first to the replica
                 holding the least so far (torch's ZeroRedundancyOptimizer)
        stage 2  FSDP2: params at rest the padded shard (each tensor's rows padded to a multiple
                 of dp: ceil(r/dp)*c; gathered once per step and held from forward through
                 backward, see `gathered_param_bytes`); grads the padded shard; the optimizer
                 state the unpadded shard of this replica (torch.chunk's rows)
        stage 3  as stage 2, the params gathered block by block (forward and again backward)
    `summed` tensors (kept out of FSDP2) are whole under stages 2-3."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"unknown zero_stage {zero_stage!r}; valid: 0, 1, 2, 3")
    pb, gb, ob = precision.param_bytes, precision.grad_bytes, precision.optimizer_bytes
    total = sum(r * c for r, c, _ in tensors)
    if zero_stage == 0 or dp == 1:
        return [(total * pb, total * gb, total * ob)] * dp
    if zero_stage == 1:
        loads = [0] * dp
        for numel in sorted((r * c for r, c, _ in tensors), reverse=True):
            loads[loads.index(min(loads))] += numel
        return [(total * pb, total * gb, load * ob) for load in loads]
    out = []
    for rank in range(dp):
        params = grads = optimizer = 0
        for rows, cols, summed in tensors:
            if summed:
                params, grads, optimizer = params + rows * cols, grads + rows * cols, optimizer + rows * cols
                continue
            chunk = -(-rows // dp)
            params += chunk * cols
            grads += chunk * cols
            optimizer += min(chunk, max(0, rows - rank * chunk)) * cols
        out.append((params * pb, grads * gb, optimizer * ob))
    return out


def gathered_param_bytes(tensors, precision: Precision, *, dp: int) -> float:
    """ZeRO 2 on FSDP2: the unsharded copies of every sharded tensor (rows padded to a multiple of
    dp), held from forward through backward."""
    return sum(-(-r // dp) * dp * c for r, c, summed in tensors if not summed) * precision.param_bytes


def layer_activation_bytes(
    model: ModelSpec,
    micro_batch: int = 1,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    activation_bytes: float = 2,
    implementation: str = "megatron",
    tp_rank: int = 0,
    moe: bool = False,
    ep: int = 1,
    routing_imbalance: float = 1.0,
) -> float:
    """Activation bytes one transformer layer stores per micro-batch on TP rank `tp_rank` (0: the
    most loaded); `moe`: a MoE layer, its MLP's terms `moe_mlp_activation_bytes` (experts over `ep`
    ranks, the most loaded receiving `routing_imbalance` x the mean).

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    Sec. 4 and Table 2 (s = seq_len, b = micro_batch, h = hidden, a = heads, t = tp; 16-bit
    activations, 1-byte dropout masks):
        no parallelism         s*b*h*(34 + 5*a*s/h)
        tensor parallel        s*b*h*(10 + 24/t + 5*a*s/(h*t))
        TP + sequence parallel s*b*h/t*(34 + 5*a*s/h)
        selective recompute    drops the 5*a*s/h term (FlashAttention stores the same)
        full recompute         2*s*b*h (the layer input; /t with sequence parallelism)

    Generalisation (d = activation_bytes, m = 1 if dropout else 0, q = heads*head_dim,
    k = local kv heads * head_dim, f = ffn_hidden). Outside the TP region (/t only with SP):
    the two norm inputs, the QKV input, the MLP input (4 d) and two dropout masks (2 m), i.e.
    Korthikanti's 10. Inside (per rank): Q, the attention output (2 d q / t), K and V (2 d k),
    the MLP intermediates: non-gated GeLU input and output (2 d f / t), gated gate and up
    outputs and their product (3 d f / t, a fused SwiGLU as in Megatron), i.e. Korthikanti's 24
    for q = k*t = h, f = 4h. Attention core per local head: softmax output d*s^2*b, plus its
    dropout mask and dropout output (m + d)*s^2*b when dropout, i.e. 5*a*s^2*b.

    implementation="tplayers" with sequence parallelism: the QKV and MLP inputs are kept
    all-gathered (whole sequence, not /t) for the weight gradients (see `Assumptions`).
    """
    if not model.has_dims:
        raise ValueError("activation memory needs the model's dimensions (this ModelSpec has num_params only)")
    _choice(recompute, RECOMPUTE_CHOICES, "recompute")
    _choice(implementation, IMPLEMENTATION_CHOICES, "implementation")
    s, b, h = model.seq_len, micro_batch, model.hidden
    d = activation_bytes
    sp_div = tp if sequence_parallel else 1
    if recompute == "full":
        return d * s * b * h / sp_div
    mask = MASK_BYTES if model.dropout else 0
    outside = (4 * d + 2 * mask) * s * b * h / sp_div
    if implementation == "tplayers" and sequence_parallel:  # the gathered QKV and MLP inputs
        outside += 2 * d * s * b * h * (1 - 1 / sp_div)
    mlp_tensors = 3 if model.gated_mlp else 2
    local = local_dims(model, tp, tp_rank)
    inside = d * s * b * (2 * local.q + 2 * local.kv_heads_computed * model.head_dim)
    if moe:
        inside += moe_mlp_activation_bytes(model, s * b, tp, ep, d, imbalance=routing_imbalance)
    else:
        inside += d * s * b * mlp_tensors * local.ffn
    if recompute == "selective":
        return outside + inside
    core_bytes = d + (mask + d if model.dropout else 0)
    core = core_bytes * local.heads * s * s * b
    return outside + inside + core


def _embedding_activation_bytes(model: ModelSpec, micro_batch: int, tp: int, sp: bool) -> float:
    """Input embedding: its dropout mask, s*b*h (/t with SP) bytes (Korthikanti Sec. 4.3)."""
    if not model.dropout:
        return 0.0
    return MASK_BYTES * model.seq_len * micro_batch * model.hidden / (tp if sp else 1)


def _output_activation_bytes(
    model: ModelSpec,
    micro_batch: int,
    tp: int,
    sp: bool,
    d: float,
    vocab: int,
    implementation: str = "megatron",
    tp_rank: int = 0,
) -> float:
    """Output layer: final-norm input and projection input (2*d*s*b*h, /t with SP) and the fp32
    logits 4*s*b*V/t kept by the cross-entropy: Korthikanti Sec. 4.3, 4*s*b*h/t*(1 + V/h).
    tplayers: the final norm and LM head see the whole sequence, the logits are kept in d bytes."""
    s, b = model.seq_len, micro_batch
    if implementation == "tplayers":
        return 2 * d * s * b * model.hidden + d * s * b * ceil_share(vocab, tp, tp_rank)
    return 2 * d * s * b * model.hidden / (tp if sp else 1) + LOGITS_BYTES * s * b * ceil_share(vocab, tp, tp_rank)
