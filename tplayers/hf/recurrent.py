"""Recurrent blocks split by heads: RecurrentGemma's (Griffin's) recurrent block.

    linear_x, linear_y   column-parallel by heads (`block_width` features a head)
    conv_1d              the depthwise convolution over linear_x's features: this rank's heads'
                         channels (`channel_split_conv`)
    rg_lru               the RG-LRU: its gates are block-diagonal, one (block_width x block_width)
                         block per head (`input_gate_weight`, `recurrent_gate_weight` and their
                         biases: cut to this rank's heads along dim 0), its recurrence diagonal
                         (`recurrent_param`: this rank's heads' features); so each rank runs the
                         model's own scan over its heads' features, whole sequence, no exchange
    linear_out           row-parallel by the same heads

Under sequence parallelism the block's input is gathered along the sequence first and its output
reduce-scattered, as for attention; the recurrence sees the whole sequence. The cache's states
(the convolution's and the recurrence's) hold this rank's features.
"""

import inspect

import torch
import torch.distributed as dist

from tplayers.hf.attention import head_split, localize_attributes, split_per_head
from tplayers.hf.mixers import channel_split_conv
from tplayers.hf.shard import ShardingPass
from tplayers.placement import shard_range

RG_LRU_PER_HEAD = ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias")


def is_recurrent_block(module) -> bool:
    """RecurrentGemma's recurrent block and RG-LRU, with transformers' forwards line for line."""
    if type(module).__name__ != "RecurrentGemmaRecurrentBlock":
        return False
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as hf

    pairs = ((module, hf.RecurrentGemmaRecurrentBlock), (module.rg_lru, hf.RecurrentGemmaRglru))
    return all(inspect.getsource(type(mine).forward) == inspect.getsource(theirs.forward) for mine, theirs in pairs)


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
