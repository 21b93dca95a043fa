"""Recurrent blocks split by heads: RecurrentGemma's (Griffin's) recurrent block, xLSTM's mLSTM layers.

    linear_x, linear_y   column-parallel by heads (`block_width` features a head)
    conv_1d              the depthwise convolution over linear_x's features: this rank's heads'
                         channels (`channel_split_conv`)
    rg_lru               the RG-LRU: its gates are block-diagonal, one (block_width x block_width)
                         block per head (`input_gate_weight`, `recurrent_gate_weight` and their
                         biases: cut to this rank's heads along dim 0), its recurrence diagonal
                         (`recurrent_param`: this rank's heads' features); so each rank runs the
                         model's own scan over its heads' features, whole sequence, no exchange
    linear_out           row-parallel by the same heads

RWKV (v4): its time mixing split by channel, its channel mixing by features (`rwkv_block`).

xLSTM's mLSTM layer: q / k / v, the output gate's and the input / forget gates' rows by heads, the
per-head norm's weights with them, `out_proj` row-parallel; its gated feed-forward by features. The
backbone and its layers read a copy of the config with this rank's head count (and widths), which
the cache's recurrent states are built from. (transformers 5.24 cannot build the fused weight mode.)

Under sequence parallelism a block's input is gathered along the sequence first and its output
reduce-scattered, as for attention; the recurrence sees the whole sequence. The cache's states
(the convolution's and the recurrence's) hold this rank's features.
"""

import copy
import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

from tplayers.functional.collectives import own_slice
from tplayers.functional.sequence import scattered_sizes
from tplayers.hf.attention import head_split, localize_attributes, split_per_head
from tplayers.hf.mixers import channel_split_conv
from tplayers.hf.shard import ShardingPass
from tplayers.hf.source import same_forward, source
from tplayers.placement import even_sizes, set_placement, shard_range

RG_LRU_PER_HEAD = ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias")


def is_recurrent_block(module) -> bool:
    """RecurrentGemma's recurrent block and RG-LRU, with transformers' forwards line for line."""
    if type(module).__name__ != "RecurrentGemmaRecurrentBlock":
        return False
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as hf

    pairs = ((module, hf.RecurrentGemmaRecurrentBlock), (module.rg_lru, hf.RecurrentGemmaRglru))
    return all(same_forward(mine, theirs) for mine, theirs in pairs)


def recurrent_block(sp: ShardingPass, name, block):
    lru = block.rg_lru
    heads, width = lru.num_attention_heads, lru.block_width
    split = head_split(f"{name}.rg_lru", heads, sp.n)
    for proj in ("linear_x", "linear_y"):
        sp.shared_input_column(f"{name}.{proj}", getattr(block, proj), split_unit=width, split_sizes=split)
    channels = [torch.arange(s * width, (s + c) * width) for s, c in (shard_range(heads, sp.n, r, split)
                                                                        for r in range(sp.n))]  # fmt: skip
    channel_split_conv(sp, f"{name}.conv_1d", block.conv_1d, channels)
    for key in RG_LRU_PER_HEAD:
        split_per_head(sp, f"{name}.rg_lru", lru, key, 1, split)
    split_per_head(sp, f"{name}.rg_lru", lru, "recurrent_param", width, split)
    sp.row(f"{name}.linear_out", block.linear_out, split_unit=width, split_sizes=split)
    local = split[dist.get_rank(sp.group)]
    localize_attributes(f"{name}.rg_lru", lru, dict(num_attention_heads=local))
    block.lru_width = local * width  # the cache's recurrent state, this rank's features
    sp.done.add(f"{name}.rg_lru")
    sp.shared_input.append(block)
    sp.done.add(name)


# ---- xLSTM's mLSTM layers ------------------------------------------------------------------------


def is_xlstm_model(module) -> bool:
    """xLSTM's backbone, its mLSTM layers and feed-forwards with transformers' forwards line for line."""
    if type(module).__name__ != "xLSTMModel":
        return False
    from transformers.models.xlstm import modeling_xlstm as hf

    return all(same_forward(b.mlstm_layer, hf.xLSTMLayer) and same_forward(b.ffn, hf.xLSTMFeedForward)
               for b in module.blocks)  # fmt: skip


@functools.cache
def _local_config_class(cls):
    """`cls` (xLSTM's config) whose qk_dim / v_dim are its head count times `head_widths` (this rank's
    heads): in transformers they are properties of the hidden size, which stays whole."""
    return type(cls.__name__, (cls,), {
        "qk_dim": property(lambda self: self.num_heads * self.head_widths[0]),
        "v_dim": property(lambda self: self.num_heads * self.head_widths[1]),
    })  # fmt: skip


def xlstm_model(sp: ShardingPass, name, model):
    """xLSTM: every block's mLSTM layer split by heads (q / k / v / output-gate rows and the input /
    forget gates' by head, the per-head norm's weights with them, out_proj row-parallel) and its
    gated feed-forward by features; the backbone and its layers then read a copy of the config with
    this rank's head count and widths, so the recurrent state the cache holds is this rank's heads'."""
    config = model.config
    if config.weight_mode != "single":  # transformers 5.24 cannot build the fused layout unsharded to compare
        raise ValueError(
            f"parallelize: {name or type(model).__name__}: xLSTM's {config.weight_mode!r} weight mode (q / k / v / "
            "output gate in one projection) is not split by tplayers; weight_mode='single' is"
        )
    heads = config.num_heads
    first = model.blocks[0].mlstm_layer
    qk_head, v_head = first.qk_dim // heads, first.v_dim // heads
    split = head_split(f"{name}.blocks.0.mlstm_layer", heads, sp.n)
    local = split[dist.get_rank(sp.group)]
    local_config = copy.copy(config)
    local_config.__class__ = _local_config_class(type(config))
    local_config.num_heads, local_config.head_widths = local, (qk_head, v_head)
    for i, block in enumerate(model.blocks):
        prefix = f"{name}.blocks.{i}" if name else f"blocks.{i}"
        _mlstm_layer(sp, f"{prefix}.mlstm_layer", block.mlstm_layer, split, qk_head, v_head)
        _gated_ffn(sp, f"{prefix}.ffn", block.ffn)
        for module in (block, block.mlstm_layer, block.mlstm_layer.mlstm_backend, block.ffn):
            module.config = local_config
    model.config = local_config


def _mlstm_layer(sp: ShardingPass, name, layer, split, qk_head, v_head):
    local = split[dist.get_rank(sp.group)]
    units = dict(q=qk_head, k=qk_head, v=v_head, ogate_preact=v_head, igate_preact=1, fgate_preact=1)
    for proj, unit in units.items():
        sp.shared_input_column(f"{name}.{proj}", getattr(layer, proj), split_unit=unit, split_sizes=split)
    norm = layer.multihead_norm
    for key in ("weight", "bias"):
        if getattr(norm, key, None) is not None:
            split_per_head(sp, f"{name}.multihead_norm", norm, key, v_head, split)
    norm.num_heads, norm.num_features = local, local * v_head
    sp.done.add(f"{name}.multihead_norm")
    sp.row(f"{name}.out_proj", layer.out_proj, split_unit=v_head, split_sizes=split)
    layer.qk_dim, layer.v_dim = local * qk_head, local * v_head
    sp.shared_input.append(layer)
    sp.done.add(name)


def _gated_ffn(sp: ShardingPass, name, ffn):
    split = even_sizes(ffn.up_proj_dim, sp.n)
    for proj in ("proj_up_gate", "proj_up"):
        sp.shared_input_column(f"{name}.{proj}", getattr(ffn, proj), split_sizes=split)
    sp.row(f"{name}.proj_down", ffn.proj_down, split_sizes=split)
    ffn.up_proj_dim = split[dist.get_rank(sp.group)]
    sp.shared_input.append(ffn)
    sp.done.add(name)


# ---- RWKV (v4) -------------------------------------------------------------------------------------


def is_rwkv_block(module) -> bool:
    """RWKV's block, its time mixing and channel mixing with transformers' code line for line."""
    if type(module).__name__ != "RwkvBlock":
        return False
    from transformers.models.rwkv import modeling_rwkv as hf

    attn, ffn = module.attention, module.feed_forward
    return (
        same_forward(module, hf.RwkvBlock)
        and same_forward(attn, hf.RwkvSelfAttention)
        and source(type(attn).extract_key_value) == source(hf.RwkvSelfAttention.extract_key_value)
        and same_forward(ffn, hf.RwkvFeedForward)
    )


def rwkv_block(sp: ShardingPass, name, block):
    """RWKV's time mixing splits by channel: key / value / receptance column-parallel over the
    attention channels, the WKV recurrence and its `time_decay` / `time_first` per channel, so each
    rank runs the model's own recurrence on its channels; `output` row-parallel. The token-shift
    mixes (`time_mix_*`) act on the whole hidden state before the projections: replicated, their
    gradients summed. The cache's WKV states are this rank's channels of the model's whole-width
    state tensors (`_local_wkv_state`).

    Channel mixing: `key` column-parallel, squared ReLU, `value` row-parallel, times
    sigmoid(receptance(x)) with `receptance` (hidden -> hidden) whole on every rank. Without
    sequence parallelism the block's output is whole: `key` sums its own input's gradient, so
    the receptance's whole gradient passes once. Under sequence parallelism the token shift needs
    the tokens before each: the module's input is gathered along the sequence, `value`
    reduce-scatters to this rank's tokens, and the receptance reads this rank's tokens of its
    input (so its input's gradient, summed over the ranks as the gather's backward does, holds
    each token once)."""
    attn, ffn = block.attention, block.feed_forward
    channels = attn.attention_hidden_size
    split = even_sizes(channels, sp.n)
    for proj in ("key", "value", "receptance"):
        sp.shared_input_column(f"{name}.attention.{proj}", getattr(attn, proj), split_sizes=split)
    for key in ("time_decay", "time_first"):
        split_per_head(sp, f"{name}.attention", attn, key, 1, split)
    sp.row(f"{name}.attention.output", attn.output, split_sizes=split)
    sp.partial_grads.extend(getattr(attn, f"time_mix_{k}") for k in ("key", "value", "receptance"))
    start, size = shard_range(channels, sp.n, dist.get_rank(sp.group), split)
    _local_wkv_state(attn, slice(start, start + size))
    sp.shared_input.append(attn)
    sp.done.add(f"{name}.attention")

    features = ffn.key.out_features
    ffn_split = even_sizes(features, sp.n)
    mixes = [ffn.time_mix_key, ffn.time_mix_receptance]
    if sp.sp:  # each rank's part of their gradients: summed
        sp.shared_input_column(f"{name}.feed_forward.key", ffn.key, split_sizes=ffn_split)
        group = sp.group
        ffn.receptance.register_forward_pre_hook(
            lambda mod, args: (own_slice(args[0], 1, group, sizes=scattered_sizes(args[0], 1, group)), *args[1:])
        )
        sp.shared_input.append(ffn)
        sp.partial_grads.extend(mixes)
    else:  # whole gradients: key's input gradient is summed before them
        sp.column(f"{name}.feed_forward.key", ffn.key, split_sizes=ffn_split)
        for p in mixes:
            set_placement(p, sp.group, Replicate())
    sp.row(f"{name}.feed_forward.value", ffn.value, split_sizes=ffn_split)
    sp.done.add(f"{name}.feed_forward.receptance")
    sp.whole.add(f"{name}.feed_forward.receptance")
    sp.done.add(f"{name}.feed_forward")


def _local_wkv_state(attn, channels: slice):
    """The cache's WKV states (state[2:], (batch, hidden, layers) each, whole width) seen by the time
    mixing as their `channels` (views: its in-place updates land there); the block gets the
    model's whole list back."""

    def local(mod, args, kwargs):
        state = kwargs.get("state")
        if state is None:
            return None
        mod._whole_state = state
        return args, {**kwargs, "state": [*state[:2], *(s[:, channels] for s in state[2:])]}

    def whole(mod, args, kwargs, out):
        state = mod.__dict__.pop("_whole_state", None)
        return out if state is None else (out[0], state)

    attn.register_forward_pre_hook(local, with_kwargs=True)
    attn.register_forward_hook(whole, with_kwargs=True)
