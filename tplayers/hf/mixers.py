"""State-space and linear-attention mixers split by heads, as attention is (Megatron-Core splits
its Mamba layers the same way). The model's own forward runs on each rank's heads:

    Gated DeltaNet (Qwen3-Next: in_proj_qkvz / in_proj_ba; Qwen3.5: in_proj_qkv / z / b / a;
    OLMo hybrid: q / k / v / a / b / g_proj)
        every projection by key heads, each carrying its value heads; the convolution over
        [q; k; v] by the same heads' channels; A_log and dt_bias by value head; the gated norm
        acts on each head alike (replicated, its gradient summed); out_proj row-parallel.
    Mamba 1 (Mamba, Falcon-Mamba, Jamba)
        in_proj's [x; z] rows, the convolution, A_log / D, dt_proj's rows and out_proj's columns
        by channel; x_proj by its input channels, its partial products summed over the group
        (forward and backward: every rank's channels read the whole dt / B / C); Jamba's and
        Falcon-Mamba's norms on dt / B / C replicated, their gradient summed.
    Kimi Delta Attention (Kimi-Linear, Bailing hybrid)
        q / k / v_proj, the forget gate's and output gate's up projections (f_b / g_b, or f / g
        whole), b_proj and the convolution over [q; k; v] by head; the gates' low-rank down
        projections (f_a / g_a) whole on every rank, their gradient summed; dt_bias and A_log by
        head; the gated norm on each head alike; o_proj row-parallel.
    MiniMax's lightning attention
        qkv_proj (per head [q, k, v]) and output_gate column-parallel by heads, the per-head decay
        buffers cut to each rank's heads, the norm over every head's output a ParallelRMSNorm
        (sum of squares over the group), out_proj row-parallel.
    LFM2's short convolution (LFM2, LFM2-MoE)
        in_proj's [B; C; x] rows, the convolution and out_proj's columns by channel: every
        operation between them is channel by channel.
    Mamba 2 (Mamba2, Bamba, Nemotron-H, Granite-4 hybrid, Falcon-H1)
        in_proj's z / x / dt rows and the convolution's x channels by head, A_log / D / dt_bias
        by head; B / C (rows and channels) by group with their heads where every rank gets whole
        groups, else (one group over every head) whole on every rank with their gradient summed;
        the gated norm by group with them, or (one group) a sum of squares over the group
        (`ParallelGatedRMSNorm`); out_proj row-parallel.

The input is prepared once per mixer (its gradient summed over the group, or the sequence
gathered under sequence parallelism) by the hook parallelize puts before it, as for attention.
The scan needs the whole sequence, which that gather gives it. The cache (generate()) holds each
rank's own heads' states: transformers builds it from the shapes it is given.
"""

import inspect
import sys

import torch
import torch.distributed as dist
from torch import nn

from tplayers.functional.collectives import all_gather_any, own_slice
from tplayers.hf import pieces
from tplayers.hf.attention import head_split, localize_attributes, split_per_head
from tplayers.hf.fused import SummedRowLinear, fused_column, multi_query_column, part_rows, split_and_gathered_column
from tplayers.hf.norms import rms_norm_eps
from tplayers.hf.shard import ShardingPass, copy_in, gather, has_linears, on_device
from tplayers.hf.source import forward_source, same_forward
from tplayers.hf.state_dict import ExportRecord
from tplayers.nn.conv import ChannelParallelConv1d
from tplayers.nn.norm import ParallelGatedRMSNorm, ParallelRMSNorm, gated_rms_norm
from tplayers.placement import even_sizes, shard_range

QWEN3_NEXT = ("in_proj_qkvz", "in_proj_ba", "out_proj")
QWEN3_5 = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
OLMO_HYBRID = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj")
GATED_DELTANET_PARAMS = {"A_log", "dt_bias"}
MAMBA2_PARAMS = {"A_log", "D", "dt_bias"}


def _depthwise(module) -> bool:
    conv = getattr(module, "conv1d", None)
    return isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels


def _own_params(module) -> set[str]:
    return {k for k, p in module._parameters.items() if p is not None}


def is_gated_deltanet(module) -> bool:
    return (
        any(has_linears(module, layout) for layout in (QWEN3_NEXT, QWEN3_5, OLMO_HYBRID))
        and _depthwise(module)
        and _own_params(module) == GATED_DELTANET_PARAMS
    )


def is_mamba2(module) -> bool:
    return (
        has_linears(module, ("in_proj", "out_proj"))
        and _depthwise(module)
        and _own_params(module) == MAMBA2_PARAMS
        and all(isinstance(getattr(module, k, None), int) for k in ("num_heads", "head_dim", "n_groups"))
    )


# ---- pieces shared by the mixers -------------------------------------------------------------


def _rows(segments, start, count) -> torch.Tensor:
    """The unsharded rows of units [start, start + count) of each (offset, rows per unit) segment."""
    return torch.cat([torch.arange(o + start * w, o + (start + count) * w) for o, w in segments])


def channel_split_conv(sp: ShardingPass, name, conv, channels: list[torch.Tensor], whole: torch.Tensor | None = None):
    """The depthwise conv1d split by channel: rank r computes `channels[r]`; the channels in
    `whole` (None: none) every rank holds, their gradient summed over the group."""
    rank = dist.get_rank(sp.group)
    mask = [torch.isin(c, whole) if whole is not None else torch.zeros_like(c, dtype=torch.bool) for c in channels]
    layer = on_device(ChannelParallelConv1d(conv, channels[rank], mask[rank], group=sp.group), conv.weight.device)
    sp.swap(name, layer)
    if layer.whole_weight is not None:
        sp.partial_grads.extend(p for p in (layer.whole_weight, layer.whole_bias) if p is not None)
    total = conv.in_channels
    split_order = torch.cat([c[~m] for c, m in zip(channels, mask, strict=True)])
    own_split, own_whole = channels[rank][~mask[rank]], channels[rank][mask[rank]]
    keys = ("weight", "bias") if conv.bias is not None else ("weight",)

    def export(pick, group):
        out = {}
        for key in keys:
            split = gather(pick(getattr(layer, f"split_{key}")), 0, group)
            if split is None:
                continue
            full = split.new_zeros((total, *split.shape[1:]))
            full[split_order.to(full.device)] = split
            if own_whole.numel():
                full[own_whole.to(full.device)] = pick(getattr(layer, f"whole_{key}"))
            out[key] = full
        return out

    def load(full_tensors):
        for key in keys:
            t = full_tensors[key]
            copy_in(getattr(layer, f"split_{key}"), t[own_split.to(t.device)])
            if own_whole.numel():
                copy_in(getattr(layer, f"whole_{key}"), t[own_whole.to(t.device)])

    def layout():
        out = []
        for key in keys:
            out.append(pieces.rows(key, getattr(layer, f"split_{key}"), own_split, total))
            if own_whole.numel():
                out.append(pieces.rows(key, getattr(layer, f"whole_{key}"), own_whole, total, unit=own_whole.numel()))
        return out

    sp.exports.append(ExportRecord(name, export, load, layout))


def _ranges(sp: ShardingPass, heads, split):
    return [shard_range(heads, sp.n, r, split) for r in range(sp.n)]


def _head_wise_norm(sp: ShardingPass, name, norm, width):
    """A norm acting on each head's `width` features alike: replicated, each rank's heads giving
    part of its gradient (summed over the group); anything else is refused by name."""
    params = list(norm.parameters())
    if any(tuple(p.shape) != (width,) for p in params):
        raise ValueError(
            f"parallelize: {name} ({type(norm).__name__}) holds weights of shapes "
            f"{[tuple(p.shape) for p in params]}, not one per head feature ({width}); pass a plan for this model"
        )
    sp.partial_grads.extend(params)


def _refuse_unknown_children(name, module, known):
    extra = [c for c, m in module.named_children() if c not in known and next(m.parameters(), None) is not None]
    if extra:
        raise ValueError(
            f"parallelize: {name} ({type(module).__name__}) holds {', '.join(f'{name}.{c}' for c in extra)}, which "
            "tplayers does not know how to split; pass a plan for this model"
        )


# ---- Gated DeltaNet --------------------------------------------------------------------------


def gated_deltanet(sp: ShardingPass, name, m):
    """Qwen3-Next's, Qwen3.5's and OLMo hybrid's Gated DeltaNet split by key heads (see the module
    docstring)."""
    nk, nv, hk, hv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    per = nv // nk  # value heads per key head: contiguous (the rule repeats q / k with repeat_interleave)
    layout = next(layout for layout in (QWEN3_NEXT, QWEN3_5, OLMO_HYBRID) if has_linears(m, layout))
    norm, out = ("o_norm", "o_proj") if layout == OLMO_HYBRID else ("norm", "out_proj")
    _refuse_unknown_children(name, m, (*layout, "conv1d", norm))
    kd, vd = nk * hk, nv * hv
    if per * nk != nv or m.conv1d.in_channels != 2 * kd + vd:
        raise ValueError(
            f"parallelize: {name}'s widths do not hold {nk} key heads of {hk} and {nv} value heads of {hv}"
        )
    split = head_split(name, nk, sp.n)
    ranges = _ranges(sp, nk, split)
    qkv = [_rows([(0, hk), (kd, hk), (2 * kd, per * hv)], s, c) for s, c in ranges]
    if layout == QWEN3_NEXT:  # per key head: [q, k, v of its value heads, z of them] rows, then [b, a] of them
        sp.shared_input_column(f"{name}.in_proj_qkvz", m.in_proj_qkvz, split_unit=2 * hk + 2 * per * hv,
                               split_sizes=split)  # fmt: skip
        sp.shared_input_column(f"{name}.in_proj_ba", m.in_proj_ba, split_unit=2 * per, split_sizes=split)
    elif layout == QWEN3_5:
        fused_column(sp, f"{name}.in_proj_qkv", m.in_proj_qkv, qkv)
        sp.shared_input_column(f"{name}.in_proj_z", m.in_proj_z, split_unit=per * hv, split_sizes=split)
        for key in ("in_proj_b", "in_proj_a"):
            sp.shared_input_column(f"{name}.{key}", getattr(m, key), split_unit=per, split_sizes=split)
    else:  # one projection per part, its rows by head
        units = dict(q_proj=hk, k_proj=hk, v_proj=per * hv, g_proj=per * hv, a_proj=per, b_proj=per)
        for key, unit in units.items():
            sp.shared_input_column(f"{name}.{key}", getattr(m, key), split_unit=unit, split_sizes=split)
    channel_split_conv(sp, f"{name}.conv1d", m.conv1d, qkv)
    for key in ("A_log", "dt_bias"):
        split_per_head(sp, name, m, key, per, split)
    _head_wise_norm(sp, f"{name}.{norm}", getattr(m, norm), hv)
    sp.row(f"{name}.{out}", getattr(m, out), split_unit=per * hv, split_sizes=split)
    c = ranges[dist.get_rank(sp.group)][1]
    localize_attributes(name, m, dict(num_k_heads=c, num_v_heads=c * per, key_dim=c * hk, value_dim=c * per * hv,
                                      conv_dim=2 * c * hk + c * per * hv))  # fmt: skip
    sp.shared_input.append(m)
    sp.done.add(name)


# ---- Kimi Delta Attention ------------------------------------------------------------------------
KDA = ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj")


def is_kimi_delta_attention(module) -> bool:
    gate = getattr(module, "forget_gate", None)
    return has_linears(module, KDA) and _depthwise(module) and _own_params(gate) == GATED_DELTANET_PARAMS


def kimi_delta_attention(sp: ShardingPass, name, m):
    """Kimi Delta Attention split by heads (see the module docstring)."""
    heads, width, gate = m.num_heads, m.head_dim, m.forget_gate
    low_rank = [(m, "g_a_proj", "g_b_proj"), (gate, "f_a_proj", "f_b_proj")]
    _refuse_unknown_children(name, m, (*KDA, "conv1d", "forget_gate", "g_a_proj", "g_b_proj", "g_proj", "o_norm"))
    _refuse_unknown_children(f"{name}.forget_gate", gate, ("f_a_proj", "f_b_proj", "f_proj"))
    dim = heads * width
    if m.conv1d.in_channels != 3 * dim or any(getattr(m, k).out_features != dim for k in KDA[:3]):
        raise ValueError(f"parallelize: {name}'s widths do not hold {heads} heads of {width} for q, k and v")
    split = head_split(name, heads, sp.n)
    ranges = _ranges(sp, heads, split)
    for owner, down, up in low_rank:  # the down projection's output feeds every head: whole, gradient summed
        if isinstance(getattr(owner, up, None), nn.Linear):
            sp.partial_grads.extend(getattr(owner, down).parameters())
    units = dict(q_proj=width, k_proj=width, v_proj=width, g_b_proj=width, g_proj=width, b_proj=1)
    for owner, prefix, keys in ((m, name, units), (gate, f"{name}.forget_gate", dict(f_b_proj=width, f_proj=width))):
        for key, unit in keys.items():
            if isinstance(getattr(owner, key, None), nn.Linear):
                sp.shared_input_column(f"{prefix}.{key}", getattr(owner, key), split_unit=unit, split_sizes=split)
    qkv = [_rows([(0, width), (dim, width), (2 * dim, width)], s, c) for s, c in ranges]
    channel_split_conv(sp, f"{name}.conv1d", m.conv1d, qkv)
    split_per_head(sp, f"{name}.forget_gate", gate, "dt_bias", width, split)
    split_per_head(sp, f"{name}.forget_gate", gate, "A_log", 1, split, dim=list(gate.A_log.shape).index(heads))
    _head_wise_norm(sp, f"{name}.o_norm", m.o_norm, width)
    sp.row(f"{name}.o_proj", m.o_proj, split_unit=width, split_sizes=split)
    c = ranges[dist.get_rank(sp.group)][1]
    localize_attributes(name, m, dict(num_heads=c, qkv_dim=c * width, conv_dim=3 * c * width))
    localize_attributes(f"{name}.forget_gate", gate, dict(num_heads=c, qkv_dim=c * width))
    sp.shared_input.append(m)
    sp.done.add(name)


# ---- MiniMax's lightning attention -------------------------------------------------------------
# Buffers holding one entry per head along a dim (the decays the forward reads per block)
LIGHTNING_BUFFERS = {"slope_rate": 0, "query_decay": 0, "key_decay": 0, "diagonal_decay": 1}


def is_lightning_attention(module) -> bool:
    return has_linears(module, ("qkv_proj", "output_gate", "out_proj")) and all(
        isinstance(getattr(module, b, None), torch.Tensor) for b in LIGHTNING_BUFFERS
    )


def _split_buffer(sp: ShardingPass, name, module, key, dim, sizes):
    """A per-head buffer (one entry per head along `dim`) cut to this rank's heads, exported and
    loaded whole under its own name (buffers carry no gradient)."""
    full = getattr(module, key)
    persistent = key not in module._non_persistent_buffers_set
    module.register_buffer(key, own_slice(full, dim, sp.group, 1, sizes).clone(), persistent=persistent)
    if not persistent:
        return

    def export(pick, group):
        value = pick(getattr(module, key))
        return {"": all_gather_any(value.contiguous(), dim, group)} if value is not None else {}

    def load(tensors):
        getattr(module, key).copy_(own_slice(tensors[""], dim, sp.group, 1, sizes))

    def layout():
        return [pieces.split("", getattr(module, key), dim, sp.group, total=full.shape[dim], sizes=sizes)]

    sp.exports.append(ExportRecord(f"{name}.{key}", export, load, layout))


def lightning_attention(sp: ShardingPass, name, m):
    """MiniMax's lightning attention split by heads (see the module docstring)."""
    _refuse_unknown_children(name, m, ("qkv_proj", "output_gate", "out_proj", "norm", "act_fn"))
    heads, hd = m.num_attention_heads, m.head_dim
    if m.qkv_proj.out_features != 3 * heads * hd or m.norm.weight.shape[0] != heads * hd:
        raise ValueError(f"parallelize: {name}'s projections do not hold {heads} heads of {hd}")
    eps = rms_norm_eps(m.norm)
    if eps is None:
        raise ValueError(f"parallelize: {name}.norm ({type(m.norm).__name__}) is not an RMSNorm tplayers knows")
    split = head_split(name, heads, sp.n)
    sp.shared_input_column(f"{name}.qkv_proj", m.qkv_proj, split_unit=3 * hd, split_sizes=split)
    sp.shared_input_column(f"{name}.output_gate", m.output_gate, split_unit=hd, split_sizes=split)
    for key, dim in LIGHTNING_BUFFERS.items():
        _split_buffer(sp, name, m, key, dim, split)
    norm = ParallelRMSNorm.from_weight(m.norm.weight, eps, group=sp.group, split_unit=hd, split_sizes=split)
    sp.swap(f"{name}.norm", on_device(norm, m.norm.weight.device))
    sp.record(f"{name}.norm", norm, dim=0)
    sp.row(f"{name}.out_proj", m.out_proj, split_unit=hd, split_sizes=split)
    localize_attributes(name, m, dict(num_attention_heads=split[dist.get_rank(sp.group)]))
    sp.shared_input.append(m)
    sp.done.add(name)


# ---- LFM2's short convolution ------------------------------------------------------------------


def is_short_conv(module) -> bool:
    conv = getattr(module, "conv", None)
    return (
        has_linears(module, ("in_proj", "out_proj"))
        and isinstance(conv, nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels
        and module.in_proj.out_features == 3 * conv.in_channels == 3 * module.out_proj.in_features
        and not _own_params(module)
    )


def short_conv(sp: ShardingPass, name, m):
    """LFM2's gated short convolution split by channel (see the module docstring)."""
    _refuse_unknown_children(name, m, ("in_proj", "conv", "out_proj"))
    width = m.conv.in_channels
    split = even_sizes(width, sp.n)
    fused_column(sp, f"{name}.in_proj", m.in_proj, part_rows([width] * 3, sp.n, split=split))
    ranges = _ranges(sp, width, split)
    channel_split_conv(sp, f"{name}.conv", m.conv, [torch.arange(s, s + c) for s, c in ranges])
    sp.row(f"{name}.out_proj", m.out_proj, split_sizes=split)
    localize_attributes(name, m, {})
    sp.shared_input.append(m)
    sp.done.add(name)


# ---- Mamba 1 ---------------------------------------------------------------------------------
MAMBA1_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def is_mamba1(module) -> bool:
    return (
        has_linears(module, ("in_proj", "x_proj", "dt_proj", "out_proj"))
        and _depthwise(module)
        and _own_params(module) == {"A_log", "D"}
        and module.A_log.dim() == 2
    )


def mamba1_mixer(sp: ShardingPass, name, m):
    """A Mamba 1 mixer split by channel (see the module docstring)."""
    _refuse_unknown_children(name, m, ("in_proj", "x_proj", "dt_proj", "out_proj", "conv1d", "act", *MAMBA1_NORMS))
    inner = m.conv1d.in_channels
    if m.in_proj.out_features != 2 * inner or m.x_proj.in_features != inner or m.dt_proj.out_features != inner:
        raise ValueError(f"parallelize: {name}'s projections do not hold [x; z] of {inner} channels")
    split = even_sizes(inner, sp.n)
    rank = dist.get_rank(sp.group)
    fused_column(sp, f"{name}.in_proj", m.in_proj, part_rows([inner, inner], sp.n, split=split))
    ranges = _ranges(sp, inner, split)
    channel_split_conv(sp, f"{name}.conv1d", m.conv1d, [torch.arange(s, s + c) for s, c in ranges])
    x_proj = on_device(SummedRowLinear(m.x_proj, group=sp.group, split_sizes=split), m.x_proj.weight.device)
    sp.swap(f"{name}.x_proj", x_proj)
    sp.record(f"{name}.x_proj", x_proj, dim=1)
    sp.partial_grads.extend([x_proj.bias] if x_proj.bias is not None else [])  # added once after the sum
    for key in ("weight", "bias"):  # read by the forward itself (dt_proj.weight @ dt): local rows
        if getattr(m.dt_proj, key, None) is not None:
            split_per_head(sp, f"{name}.dt_proj", m.dt_proj, key, 1, split)
    sp.done.add(f"{name}.dt_proj")
    for key in ("A_log", "D"):
        split_per_head(sp, name, m, key, 1, split)
    for norm in MAMBA1_NORMS:  # on the whole dt / B / C: each rank's channels give part of the gradient
        sp.partial_grads.extend(getattr(m, norm).parameters() if hasattr(m, norm) else ())
    sp.row(f"{name}.out_proj", m.out_proj, split_sizes=split)
    localize_attributes(name, m, dict(intermediate_size=split[rank]))
    if _fused_scan(m, "mamba_inner_fn"):
        m.register_forward_pre_hook(_refuse_fused_training(name, "mamba_inner_fn"), with_kwargs=True)
    sp.shared_input.append(m)
    sp.done.add(name)


ZAMBA_PARAMS = {"x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D"}


def is_zamba_mixer(module) -> bool:
    """Zamba's Mamba mixer, with transformers' forward line for line: Mamba 1 with its channels in
    heads, each head with its own x / dt projections (raw weights, one slice per head)."""
    if type(module).__name__ != "ZambaMambaMixer" or _own_params(module) != ZAMBA_PARAMS:
        return False
    from transformers.models.zamba.modeling_zamba import ZambaMambaMixer

    return same_forward(module, ZambaMambaMixer)


def zamba_mixer(sp: ShardingPass, name, m):
    """Zamba's mixer split by whole heads, as evenly as they go: in_proj's rows ([x_c; z_c] interleaved
    channel by channel), conv1d's channels, each head's x / dt projections, A_log and D; out_proj
    row-parallel by the same channels. Each head computes its dt, B and C from its own channels, so
    nothing inside is summed; the mixer's input is gathered along the sequence under SP."""
    _refuse_unknown_children(name, m, ("in_proj", "out_proj", "conv1d", "act"))
    heads, head_dim = m.n_mamba_heads, m.mamba_head_dim
    split = head_split(name, heads, sp.n)
    sp.shared_input_column(f"{name}.in_proj", m.in_proj, split_unit=2 * head_dim, split_sizes=split)
    channels = [
        torch.arange(start * head_dim, (start + count) * head_dim) for start, count in _ranges(sp, heads, split)
    ]
    channel_split_conv(sp, f"{name}.conv1d", m.conv1d, channels)
    for key in sorted(ZAMBA_PARAMS):
        split_per_head(sp, name, m, key, 1, split)
    sp.row(f"{name}.out_proj", m.out_proj, split_unit=head_dim, split_sizes=split)
    local = split[dist.get_rank(sp.group)]
    localize_attributes(name, m, dict(n_mamba_heads=local, intermediate_size=local * head_dim))
    sp.shared_input.append(m)
    sp.done.add(name)


# ---- Mamba 2 ---------------------------------------------------------------------------------


def _fused_scan(module, kernel="mamba2_split_conv1d_scan_combined") -> bool:
    """Whether the mixer's training forward would take a fused kernel of mamba_ssm's (`kernel`:
    Mamba 2's mamba_split_conv1d_scan_combined, Mamba 1's mamba_inner_fn), which reads out_proj's
    (and the norm's, x_proj's) weights itself."""
    fn = getattr(sys.modules.get(type(module).__module__), kernel, None)
    if fn is None:
        return kernel in forward_source(module)
    while fn is not None:
        nonlocals = inspect.getclosurevars(fn).nonlocals
        if "is_new_implementation" in nonlocals:
            return bool(nonlocals["is_new_implementation"])
        fn = getattr(fn, "__wrapped__", None)
    return True  # a wrapper tplayers does not know: assume it may


def _refuse_fused_training(name, kernel="mamba_split_conv1d_scan_combined"):
    def hook(module, args, kwargs):
        if module.training and kwargs.get("cache", kwargs.get("cache_params")) is None:
            raise RuntimeError(
                f"tplayers: {name} ({type(module).__name__}) would train through mamba_ssm's fused {kernel}, which "
                "applies its projections to this rank's heads without their tensor-parallel sums; uninstall "
                "mamba_ssm for training under tensor parallelism (its inference and the cached path are exact)"
            )

    return hook


def _gated_norm(norm, group_size) -> dict | None:
    """The options of `gated_rms_norm` computing `norm` over groups of `group_size` (eps, the gate
    before or after, the weight applied in fp32: transformers' MambaRMSNormGated or Falcon-H1's),
    checked on a probe with the module's own weight where it is materialised; None for anything
    else."""
    eps, weight = getattr(norm, "variance_epsilon", None), getattr(norm, "weight", None)
    if not isinstance(eps, float) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if getattr(norm, "group_size", None) == group_size:  # MambaRMSNormGated and its copies
        options = dict(eps=eps, norm_before_gate=False, weight_in_fp32=False)
    elif isinstance(getattr(norm, "n_groups", None), int) and weight.shape[0] // norm.n_groups == group_size:
        options = dict(eps=eps, norm_before_gate=bool(norm.norm_before_gate), weight_in_fp32=True)  # Falcon-H1
    else:
        return None
    if weight.is_meta:
        return options
    g = torch.Generator().manual_seed(0)
    x, z = (torch.randn(2, 3, weight.shape[0], generator=g).to(weight) for _ in range(2))
    with torch.no_grad():
        eps, before, fp32 = options["eps"], options["norm_before_gate"], options["weight_in_fp32"]
        expected = gated_rms_norm(x, z, weight, eps, group_size, norm_before_gate=before, weight_in_fp32=fp32)
        return options if torch.equal(norm(x, z), expected) else None


def mamba2_mixer(sp: ShardingPass, name, m):
    """A Mamba 2 mixer split by heads (see the module docstring)."""
    nh, hd, ng, ds, inner = m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size, m.intermediate_size
    _refuse_unknown_children(name, m, ("in_proj", "conv1d", "norm", "out_proj", "act"))
    bc = ng * ds
    if nh * hd != inner or m.in_proj.out_features != 2 * inner + 2 * bc + nh or m.conv1d.in_channels != inner + 2 * bc:
        raise ValueError(f"parallelize: {name}'s widths do not hold {nh} heads of {hd} and {ng} groups of state {ds}")
    if ng >= sp.n and nh % ng == 0:  # whole groups on every rank, each with its heads
        groups = head_split(name, ng, sp.n)
        split = [g * (nh // ng) for g in groups]
        group_ranges = _ranges(sp, ng, groups)
    elif ng == 1:  # one group over every head: B / C whole on every rank
        split = head_split(name, nh, sp.n)
        group_ranges = [(0, 1)] * sp.n
    else:
        raise ValueError(
            f"parallelize: {name} ({type(m).__name__}) has {ng} groups of heads for {sp.n} ranks: tplayers splits "
            "them only whole (at least one group per rank) or, with one group, keeps B / C whole on every rank"
        )
    ranges = _ranges(sp, nh, split)
    rank = dist.get_rank(sp.group)
    local_rows = [  # the HF rows of each rank's in_proj output, in the order the forward splits it
        torch.cat([_rows([(0, hd), (inner, hd)], s, c), _rows([(2 * inner, ds), (2 * inner + bc, ds)], gs, gc),
                   _rows([(2 * inner + 2 * bc, 1)], s, c)])
        for (s, c), (gs, gc) in zip(ranges, group_ranges, strict=True)
    ]  # fmt: skip
    channels = [  # the conv's channels over [x; B; C]
        torch.cat([_rows([(0, hd)], s, c), _rows([(inner, ds), (inner + bc, ds)], gs, gc)])
        for (s, c), (gs, gc) in zip(ranges, group_ranges, strict=True)
    ]
    whole_groups = ng < sp.n
    if whole_groups:
        _mamba2_in_proj_shared_bc(sp, f"{name}.in_proj", m, ranges, split)
        whole = torch.arange(inner, inner + 2 * bc)
    else:
        fused_column(sp, f"{name}.in_proj", m.in_proj, local_rows)
        whole = torch.zeros(0, dtype=torch.long)
    channel_split_conv(sp, f"{name}.conv1d", m.conv1d, channels, whole)
    if isinstance(getattr(m, "mup_vector", None), torch.Tensor):  # Falcon-H1's multipliers on in_proj's rows
        m.mup_vector = m.mup_vector[..., local_rows[rank].to(m.mup_vector.device)].clone()
    for key in sorted(MAMBA2_PARAMS):
        split_per_head(sp, name, m, key, 1, split)
    _mamba2_norm(sp, f"{name}.norm", m.norm, inner // ng, hd, split, group_ranges[rank][1], whole_groups)
    sp.row(f"{name}.out_proj", m.out_proj, split_unit=hd, split_sizes=split)
    c, gc = ranges[rank][1], group_ranges[rank][1]
    local = dict(num_heads=c, intermediate_size=c * hd, n_groups=gc, conv_dim=c * hd + 2 * gc * ds)
    if isinstance(getattr(m, "groups_time_state_size", None), int):
        local["groups_time_state_size"] = gc * ds
    localize_attributes(name, m, local)
    if _fused_scan(m):
        m.register_forward_pre_hook(_refuse_fused_training(name), with_kwargs=True)
    sp.shared_input.append(m)
    sp.done.add(name)


def _mamba2_in_proj_shared_bc(sp: ShardingPass, name, m, ranges, split):
    """in_proj with one group over every head: its z / x / dt rows regrouped head by head
    ([z_h; x_h; dt_h], whole heads split like queries); B / C, which every rank reads, computed 1/n
    on each rank and gathered (where their rows split evenly and no LoRA adapter is on in_proj),
    else held whole by every rank (their gradient summed); the output put back in the forward's
    [z; x; B; C; dt] order."""
    nh, hd, inner, bc = m.num_heads, m.head_dim, m.intermediate_size, m.n_groups * m.ssm_state_size
    per_head = [torch.cat([torch.arange(h * hd, (h + 1) * hd), torch.arange(inner + h * hd, inner + (h + 1) * hd),
                           torch.tensor([2 * inner + 2 * bc + h])]) for h in range(nh)]  # fmt: skip
    order = torch.cat([*per_head, torch.arange(2 * inner, 2 * inner + 2 * bc)])
    c, unit = ranges[dist.get_rank(sp.group)][1], 2 * hd + 1
    blocks = torch.arange(c) * unit
    within = torch.arange(hd)
    interleave = torch.cat([
        (blocks[:, None] + within).flatten(), (blocks[:, None] + hd + within).flatten(),
        c * unit + torch.arange(2 * bc), blocks + 2 * hd,
    ])  # fmt: skip
    device = m.in_proj.weight.device
    interleave = interleave.to(device if device.type != "meta" else "cpu")  # a buffer: real on a meta model
    if (2 * bc) % sp.n or sp.keeps(name.rpartition(".")[0], ("in_proj",)):
        # B / C whole on every rank, their gradient summed (LoRA adapters follow this layout)
        multi_query_column(sp, name, m.in_proj, nh * unit, head_dim=unit, split=split, order=order,
                           interleave=interleave)  # fmt: skip
    else:  # B / C computed once, 1/n on each rank, and gathered: no rank holds their rows whole
        split_and_gathered_column(sp, name, m.in_proj, order, nh * unit, unit=unit, split=split, interleave=interleave)


def _mamba2_norm(sp: ShardingPass, name, norm, group_size, hd, split, local_groups, whole_groups):
    """The gated norm: Identity (Falcon-H1 without mamba_rms_norm) stays; over groups each rank
    holds whole, its weight split with the heads (and Falcon-H1's group count made local); over one
    group spanning the ranks, a ParallelGatedRMSNorm (its sum of squares summed over the group)."""
    if isinstance(norm, nn.Identity):
        return
    options = _gated_norm(norm, group_size)
    if options is None:
        raise ValueError(
            f"parallelize: {name} ({type(norm).__name__}) is not a gated RMSNorm over groups of {group_size} that "
            "tplayers knows; pass a plan for this model"
        )
    if not whole_groups or sp.n == 1:
        split_per_head(sp, name, norm, "weight", hd, split)
        if isinstance(getattr(norm, "n_groups", None), int):
            norm.n_groups = local_groups
        return
    weight = own_slice(norm.weight.detach(), 0, sp.group, hd, split)
    eps = options.pop("eps")
    layer = on_device(ParallelGatedRMSNorm(weight, eps, group_size, group=sp.group, **options), norm.weight.device)
    layer.weight.requires_grad_(norm.weight.requires_grad)
    layer.hidden_size, layer.split_unit, layer.split_sizes = norm.weight.shape[0], hd, split  # for its record
    sp.swap(name, layer)
    sp.record(name, layer, dim=0)
