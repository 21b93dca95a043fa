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

from tplayers.hf.attention import head_split, localize_attributes, split_per_head
from tplayers.hf.mixers import channel_split_conv
from tplayers.hf.shard import ShardingPass
from tplayers.hf.source import same_forward
from tplayers.placement import even_sizes, shard_range

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
