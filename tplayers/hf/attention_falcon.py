"""Falcon's fused query_key_value in its three layouts (the new decoder architecture's key/value
groups, multi-query, per-head [q, k, v]), split by heads or key/value groups."""

import torch
import torch.distributed as dist

from tplayers.hf.attention import _finish_attention, _heads_and_widths, _local_head_bias, _local_heads
from tplayers.hf.fused import multi_query_column
from tplayers.hf.shard import ShardingPass
from tplayers.placement import even_sizes, shard_range


def falcon_attention(sp: ShardingPass, name, attn):
    """Falcon's query_key_value in its three layouts: the new decoder architecture's key/value
    groups ([q x heads/groups, k, v] group by group: split by whole groups, or with fewer groups
    than ranks by query heads, see `_falcon_grouped_by_heads`), multi-query ([q; k; v] with one
    key/value head: the queries split, k and v whole on every rank), and per-head [q, k, v] (split
    by heads). dense row-parallel; ALiBi sliced to each rank's heads."""
    heads, head_dim, qkv = attn.num_heads, attn.head_dim, f"{name}.query_key_value"
    if attn.new_decoder_architecture and attn.num_kv_heads >= sp.n:
        groups = attn.num_kv_heads
        per_group = heads // groups
        group_split = even_sizes(groups, sp.n)
        sp.shared_input_column(
            qkv, attn.query_key_value, split_unit=(per_group + 2) * head_dim, split_sizes=group_split
        )
        split = [g * per_group for g in group_split]
        start, local = shard_range(heads, sp.n, dist.get_rank(sp.group), split)
        local_kv = local // per_group
    elif attn.new_decoder_architecture:
        split, start, local = _falcon_grouped_by_heads(sp, qkv, attn)
        local_kv = local
    elif attn.multi_query:
        split, start, local = _local_heads(name, heads, sp)
        multi_query_column(sp, qkv, attn.query_key_value, heads * head_dim, head_dim=head_dim, split=split)
        local_kv = 1  # the one key/value head, on every rank
    else:
        split, start, local = _local_heads(name, heads, sp)
        sp.shared_input_column(qkv, attn.query_key_value, split_unit=3 * head_dim, split_sizes=split)
        local_kv = local
    sp.row(f"{name}.dense", attn.dense, split_unit=head_dim, split_sizes=split)
    _local_head_bias(sp, attn, "alibi", heads, start, local)
    _finish_attention(sp, name, attn, _heads_and_widths(attn, heads, head_dim, local, local_kv))


def _falcon_grouped_by_heads(sp: ShardingPass, name, attn):
    """Falcon's grouped query_key_value with fewer key/value groups than ranks: the query heads
    split whole (`head_split`), each rank holding the key / value rows of its heads' groups
    (`SharedKVProjection`), and
    each rank lays out, for each of its query heads, [q, k, v] of that head's group: the model's
    own forward then reads its local heads as groups of one."""
    heads, head_dim, groups = attn.num_heads, attn.head_dim, attn.num_kv_heads
    per_group = heads // groups
    split, start, local = _local_heads(name, heads, sp)
    block = torch.arange(head_dim)

    def hf_rows(group, slot):  # slot j < per_group: query head j of the group; per_group: k; +1: v
        return (group * (per_group + 2) + slot) * head_dim + block

    queries = [hf_rows(*divmod(h, per_group)) for h in range(heads)]
    keys_values = [hf_rows(g, per_group + i) for g in range(groups) for i in (0, 1)]  # [k0; v0; k1; v1; ...]
    order = torch.cat(queries + keys_values)
    kv_rows = []  # every rank's [k, v] rows of its query heads' groups
    for r in range(sp.n):
        first, count = shard_range(heads, sp.n, r, split)
        groups_read = (torch.arange(first, first + count) // per_group).tolist()
        kv_rows.append(torch.cat([2 * g * head_dim + torch.arange(2 * head_dim) for g in groups_read]))
    # local output [q_0 .. q_{L-1}; k_0, v_0, k_1, v_1, ...] -> [q_0, k_0, v_0, q_1, k_1, v_1, ...]
    interleave = torch.cat(
        [
            torch.cat([i * head_dim + block, (local + 2 * i) * head_dim + torch.arange(2 * head_dim)])
            for i in range(local)
        ]
    )
    multi_query_column(
        sp, name, attn.query_key_value, heads * head_dim, head_dim=head_dim, kv_rows=kv_rows, split=split,
        order=order, interleave=interleave,
    )  # fmt: skip
    return split, start, local
