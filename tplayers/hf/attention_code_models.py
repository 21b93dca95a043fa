"""Attention adapters of three code models' fused projections: GPTBigCode's `c_attn` (multi-query
or per-head [q, k, v]), CodeGen's `qkv_proj` in the 4 blocks its forward hard-codes, MPT's `Wqkv`
with its ALiBi bias; each rank holds its own heads' rows, the output projection row-parallel.
"""

import torch.distributed as dist

from tplayers.hf.attention import _finish_attention, _heads_and_widths, _local_head_bias, _local_heads
from tplayers.hf.fused import codegen_rows, fused_column, multi_query_column, part_rows
from tplayers.hf.shard import ShardingPass
from tplayers.placement import even_sizes


def bigcode_attention(sp: ShardingPass, name, attn):
    """GPTBigCode: c_attn is [q; k; v] with one key/value head (multi_query) or per-head
    [q, k, v] interleaved; c_proj row-parallel."""
    heads, head_dim = attn.num_heads, attn.head_dim
    if getattr(attn, "is_cross_attention", False):
        raise ValueError(f"parallelize: {name} is a cross-attention; tplayers does not shard it")
    split, _, local = _local_heads(name, heads, sp)
    if attn.multi_query:
        multi_query_column(sp, f"{name}.c_attn", attn.c_attn, heads * head_dim, head_dim=head_dim, split=split)
        attn.num_key_value_groups = local
    else:
        sp.shared_input_column(f"{name}.c_attn", attn.c_attn, split_unit=3 * head_dim, split_sizes=split)
    sp.row(f"{name}.c_proj", attn.c_proj, split_unit=head_dim, split_sizes=split)
    sizes = _heads_and_widths(attn, heads, head_dim, local)
    if not attn.multi_query:
        sizes.update(kv_heads=local, kv_dim=local * head_dim, num_key_value_groups=1)
    _finish_attention(sp, name, attn, sizes)


def codegen_attention(sp: ShardingPass, name, attn):
    """CodeGen: qkv_proj in the 4 blocks of [q; v; k] its forward hard-codes; each rank holds its
    heads in 4 local blocks of the same layout (`codegen_rows`); out_proj row-parallel."""
    heads, head_dim, blocks = attn.num_attention_heads, attn.head_dim, 4
    if heads // blocks < sp.n:
        raise ValueError(
            f"parallelize: {name}: CodeGen's forward splits each rank's qkv_proj into {blocks} blocks of heads, so "
            f"each rank needs {blocks} heads; {heads} heads go to at most {heads // blocks} ranks"
        )
    per_block = even_sizes(heads // blocks, sp.n)  # each rank's heads in each of the 4 blocks
    fused_column(sp, f"{name}.qkv_proj", attn.qkv_proj, codegen_rows(heads, head_dim, sp.n, blocks, per_block))
    split = [blocks * s for s in per_block]
    sp.row(f"{name}.out_proj", attn.out_proj, split_unit=head_dim, split_sizes=split)
    local = split[dist.get_rank(sp.group)]
    _finish_attention(sp, name, attn, _heads_and_widths(attn, heads, head_dim, local))


def mpt_attention(sp: ShardingPass, name, attn):
    """MPT: Wqkv holding [q; k; v] (rank r holds [q_r; k_r; v_r]), out_proj row-parallel, the
    ALiBi position bias sliced to each rank's heads."""
    heads, head_dim = attn.n_heads, attn.head_dim
    split, start, local = _local_heads(name, heads, sp)
    width = heads * head_dim
    fused_column(sp, f"{name}.Wqkv", attn.Wqkv, part_rows([width] * 3, sp.n, head_dim, split))
    sp.row(f"{name}.out_proj", attn.out_proj, split_unit=head_dim, split_sizes=split)
    _local_head_bias(sp, attn, "position_bias", heads, start, local)
    _finish_attention(sp, name, attn, _heads_and_widths(attn, heads, head_dim, local))
