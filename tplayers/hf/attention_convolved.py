"""Attention whose keys and values pass a short convolution by channel, with a relative-position
bias per head (Inkling): split by heads like a q/k/v/o attention.

    q_proj, k_proj, v_proj   column-parallel by heads (whole key/value heads on every rank)
    k_sconv, v_sconv         depthwise convolutions over the key / value channels: this rank's
                             heads' channels (`channel_split_conv`); the cache keeps their states
    r_proj                   each head's relative-position features (d_rel a head): split with the
                             query heads
    rel_logits_proj          the bank of bias profiles every head mixes: replicated, its gradient
                             summed; the per-head q / k norms likewise
    o_proj                   row-parallel

The decoder layer's own convolutions of the attention's and the MLP's outputs (over the whole
hidden state) stay whole; under sequence parallelism they would read across the split: refused
(parallelize refuses every convolution left whole in a block under sequence parallelism).

The convolution reads each key/value channel's own history only, so it splits by channel with no
exchange, where every rank holds whole key/value heads of its own. Key/value heads shared by several
ranks (fewer than ranks) would make the same channels' states and gradients shared too: refused by
name, naming the TP sizes that work.
"""

import torch

from tplayers.hf.attention import _finish_attention, _heads_and_widths
from tplayers.hf.mixers import channel_split_conv
from tplayers.hf.shard import ShardingPass
from tplayers.hf.source import same_forward

CONVOLUTIONS = ("k_sconv", "v_sconv")


def is_convolved_attention(module) -> bool:
    """Inkling's attention, with transformers' forward line for line."""
    if type(module).__name__ != "InklingAttention":
        return False
    from transformers.models.inkling.modeling_inkling import InklingAttention

    return same_forward(module, InklingAttention)


def convolved_attention(sp: ShardingPass, name, attn):
    head_dim, heads, kv_heads = attn.head_dim, attn.num_heads, attn.num_key_value_heads
    if heads % sp.n or kv_heads % sp.n:
        raise ValueError(
            f"parallelize: {name} ({type(attn).__name__}): its keys and values pass a short convolution by channel, "
            f"which tplayers splits with whole key/value heads on every rank; {heads} query and {kv_heads} key/value "
            f"heads do not split over {sp.n} ranks. Use a tensor-parallel size dividing {kv_heads} and {heads}"
        )
    d_rel = attn.r_proj.out_features // heads
    for proj in ("q_proj", "k_proj", "v_proj"):
        sp.shared_input_column(f"{name}.{proj}", getattr(attn, proj), split_unit=head_dim)
    sp.shared_input_column(f"{name}.r_proj", attn.r_proj, split_unit=d_rel)
    local_kv = kv_heads // sp.n
    width = local_kv * head_dim
    channels = [torch.arange(r * width, (r + 1) * width) for r in range(sp.n)]
    for conv in CONVOLUTIONS:
        module = getattr(attn, conv)
        channel_split_conv(sp, f"{name}.{conv}.conv1d", module.conv1d, channels)
        sp.done.add(f"{name}.{conv}")
    sp.row(f"{name}.o_proj", attn.o_proj, split_unit=head_dim)
    for shared in ("rel_logits_proj", "q_norm", "k_norm"):  # act alike on every head: each rank's heads give part
        sp.partial_grads.extend(getattr(attn, shared).parameters())
        sp.done.add(f"{name}.{shared}")
    local = heads // sp.n
    _finish_attention(sp, name, attn, _heads_and_widths(attn, heads, head_dim, local, local_kv))


# Decoder layers holding short convolutions on the residual stream, over the sequence
RESIDUAL_CONVOLUTIONS = {"InklingDecoderLayer": ("attn_sconv", "mlp_sconv")}


def holds_residual_convolutions(module) -> bool:
    return type(module).__name__ in RESIDUAL_CONVOLUTIONS


def residual_convolutions(sp: ShardingPass, name, layer):
    """Inkling's convolutions of the attention's and the MLP's outputs over the sequence: whole on
    every rank, where every rank has the whole sequence. Under sequence parallelism a rank has its
    part of the sequence only, and each token's convolution would read the tokens before it across
    the split: parallelize refuses any convolution left whole in a block then, by name."""
    for child in RESIDUAL_CONVOLUTIONS[type(layer).__name__]:
        sp.done.add(f"{name}.{child}")
        sp.whole.add(f"{name}.{child}")
