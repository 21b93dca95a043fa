"""Multi-head latent attention (DeepSeek-V2 / V3, Kimi K2, MiniCPM3, GLM-4-MoE-Lite, LongCat-Flash,
Youtu, A.X K1 / K2), with DeepSeek Sparse Attention's indexer (DeepSeek-V3.2, GLM-5, Hunyuan V4, Dots 3)
and per-head output gates, split by heads as its math splits (`mla_attention`); DeepSeek-V4's
compressed attention split by its groups of heads (`deepseek_v4_attention`)."""

import copy

from torch import nn

from tplayers.hf.attention import (
    HEAD_COUNTS,
    _finish_attention,
    _held_per_head,
    _local_heads,
    _split_output_gate,
    localize_attributes,
    output_gate,
    split_per_head,
)
from tplayers.hf.shard import ShardingPass, has_linears

# Children by role. The latent (down) side is shared by every head, the up side is per head.
# Dots 3's k_rope_only_layernorm normalizes the decoupled RoPE key, shared by every head. A sparse-attention
# indexer picks the keys every head attends to from scores summed over its own scoring heads before a
# top-k: split, it would need those sums over every rank, so it stays whole on every rank, fed the whole
# hidden states and query latent, and picks the same keys there (its forward runs without gradients in
# transformers; were one to flow, it would be partial like the latent's and is summed with it).
MLA_LATENT = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "k_rope_only_layernorm", "indexer")
MLA_PER_HEAD = ("q_proj", "q_b_proj", "q_gate_proj", "kv_b_proj", "o_proj")
# The query's up projection: q_b_proj from the query latent, q_proj without one, A.X K2's q_gate_proj
# (from [latent, compressed latent], each head's [query | output gate] rows)
QUERIES = ("q_b_proj", "q_proj", "q_gate_proj")


# Per-head values an MLA module holds in a child of its own: Mistral Large 4's softmax scaling (a scale
# and a bias per head, by the log of the position), cut to each rank's heads
PER_HEAD_CHILDREN = {"softmax_scaling": ("scale", "bias")}


def is_mla(module) -> bool:
    """MLA: its latent key / value projection, or none in a layer that reuses an earlier layer's
    latents (Mistral Large 4's KV sharing: whole on every rank, as the latents are)."""
    latent = has_linears(module, ("kv_a_proj_with_mqa",)) or (
        getattr(module, "is_kv_shared_layer", False) is True and getattr(module, "kv_a_proj_with_mqa", 0) is None
    )
    return latent and has_linears(module, ("kv_b_proj", "o_proj")) and any(has_linears(module, (q,)) for q in QUERIES)


def mla_attention(sp: ShardingPass, name, attn):
    """Multi-head latent attention, split as its math splits: the query's up projection (q_b_proj,
    or q_proj without a query latent) and kv_b_proj column-parallel by whole heads (each head's
    [nope | rope] query rows, its [k_nope | v] rows), o_proj row-parallel by the same heads. The
    latent side (q_a_proj, kv_a_proj_with_mqa with the decoupled RoPE key shared by all heads, and
    their norms) is whole on every rank: each rank's heads give part of its gradient, summed over
    the group. The KV cache holds the latents, which are whole, so generate() runs as it is.
    An output gate (`gate_proj` / `g_proj`, per head or per head element of the value) splits with
    the heads; a sparse-attention indexer stays whole (see MLA_LATENT). A child in any other role is
    refused by name."""
    heads, nope, v_dim = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    split, _, local = _local_heads(name, heads, sp)
    width = attn.o_proj.out_features  # the hidden size
    known = MLA_LATENT + MLA_PER_HEAD + tuple(PER_HEAD_CHILDREN) + (output_gate(attn, heads, v_dim, width),)
    extra = [c for c, m in attn.named_children() if c not in known and next(m.parameters(), None) is not None]
    if extra:
        raise ValueError(
            f"parallelize: {name} ({type(attn).__name__}) is multi-head latent attention with "
            f"{', '.join(f'{name}.{c}' for c in extra)}, which tplayers does not know how to split; pass a plan "
            "for this model"
        )
    query = next(q for q in QUERIES if isinstance(getattr(attn, q, None), nn.Linear))
    qk_dim = getattr(attn, query).out_features // heads
    if qk_dim * heads != getattr(attn, query).out_features or attn.kv_b_proj.out_features != heads * (nope + v_dim):
        raise ValueError(f"parallelize: {name}'s projections do not hold {heads} heads of MLA's widths")
    sp.shared_input_column(f"{name}.{query}", getattr(attn, query), split_unit=qk_dim, split_sizes=split)
    _split_output_gate(sp, name, attn, heads, v_dim, split, width)
    # the latent is computed whole on every rank: its gradient stays partial here, summed with the rest
    # of the block's input gradient by the shared-input hook (each latent weight's gradient by its own sum)
    sp.shared_input_column(f"{name}.kv_b_proj", attn.kv_b_proj, split_unit=nope + v_dim, split_sizes=split)
    sp.row(f"{name}.o_proj", attn.o_proj, split_unit=v_dim, split_sizes=split)
    for child, keys in PER_HEAD_CHILDREN.items():
        module = getattr(attn, child, None)
        if isinstance(module, nn.Module):
            if any(p.shape[:1] != (heads,) for p in module.parameters()) or {
                k for k, _ in module.named_parameters()
            } != set(keys):
                raise ValueError(f"parallelize: {name}.{child} does not hold one value per head in {keys}")
            for key in keys:
                split_per_head(sp, f"{name}.{child}", module, key, 1, split)
            sp.done.add(f"{name}.{child}")
    for child in MLA_LATENT:
        module = getattr(attn, child, None)
        if isinstance(module, nn.Module):
            sp.partial_grads.extend(module.parameters())
    _held_per_head(sp, name, attn, heads, split)
    _finish_attention(sp, name, attn, dict.fromkeys(HEAD_COUNTS, local))


# DeepSeek-V4's attention: a query latent up-projected per head, one key/value head shared by every
# head (K = V), a compressor of the sequence into extra key/value entries (with its own indexer in
# compressed sparse layers), per-head attention sinks, and a grouped low-rank output projection.
DSV4_WHOLE = ("q_a_proj", "q_a_norm", "kv_proj", "kv_norm", "compressor")


def deepseek_v4_attention(sp: ShardingPass, name, attn):
    """DeepSeek-V4 split by groups of heads: o_a_proj projects each group of heads on its own
    (`o_groups` of them) and o_b_proj mixes the groups, so each rank holds whole groups: q_b_proj's
    rows, the sinks and o_a_proj's rows by them, o_b_proj row-parallel by the same groups. The one
    key/value head, the query latent and the compressor (and its indexer) read the whole hidden
    states and are whole on every rank, each rank's heads giving part of their gradients, summed.
    The attention gets its own config with the local group count, which its forward reads."""
    config = attn.config
    heads, width, groups = attn.num_heads, attn.head_dim, config.o_groups
    known = (*DSV4_WHOLE, "q_b_proj", "q_b_norm", "o_a_proj", "o_b_proj")
    extra = [c for c, m in attn.named_children() if c not in known and next(m.parameters(), None) is not None]
    if extra or heads % groups or attn.o_a_proj.n_groups != groups:
        raise ValueError(
            f"parallelize: {name} ({type(attn).__name__}) holds {extra or 'heads not in its o_groups'}, which tplayers "
            "does not know how to split; pass a plan for this model"
        )
    per_group, rank_of_group = heads // groups, attn.o_a_proj.out_features // groups
    group_split, _, local = _local_heads(name, groups, sp)
    head_split = [g * per_group for g in group_split]
    for child in DSV4_WHOLE:
        module = getattr(attn, child, None)
        if isinstance(module, nn.Module):
            sp.partial_grads.extend(module.parameters())
    sp.shared_input_column(f"{name}.q_b_proj", attn.q_b_proj, split_unit=width, split_sizes=head_split)
    split_per_head(sp, name, attn, "sinks", 1, head_split)
    split_per_head(sp, f"{name}.o_a_proj", attn.o_a_proj, "weight", rank_of_group, group_split)
    attn.o_a_proj.n_groups, attn.o_a_proj.out_features = local, local * rank_of_group
    sp.row(f"{name}.o_b_proj", attn.o_b_proj, split_unit=rank_of_group, split_sizes=group_split)
    attn.config = copy.copy(config)  # this module's own: the model's config stays global
    attn.config.o_groups = local
    local_heads = local * per_group
    attn.num_key_value_groups = local_heads  # one key/value head for this rank's query heads
    localize_attributes(name, attn, dict(num_heads=local_heads), config_keys=("o_groups",))
    sp.shared_input.append(attn)
    sp.done.add(name)
