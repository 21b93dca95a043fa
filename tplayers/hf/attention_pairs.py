"""Differential attention (DiffLlama): heads that pair across the two halves of the projections.

Its forward computes every query head against the key / value heads it reads (H query heads,
G of them per key/value head), with the values split in two halves of heads, then pairs query
head i with query head i + H/2:

    output pair i = groupnorm(o1_i - lambda * o2_i),  o_i = [softmax(q_i k) v_a | softmax(q_i k) v_b]

and o_proj reads the H/2 pairs, 2 head_dim columns each. A rank holds whole pairs (`head_split`
over H/2): query heads [a, a+c) and [a + H/2, a + H/2 + c), and for each its key / value head,
laid out so the model's own forward runs on them unchanged: local query heads [first half; second
half], one key / value head per query head (num_key_value_groups 1), whose halves are the
first-half and second-half values of the same heads. o_proj splits its input by the same pairs.

q, k and v are `SharedKVProjection`s over the heads interleaved by pair ([0, H/2, 1, H/2 + 1, ...]):
a rank's heads are then one contiguous run, shared with a neighbour only at its ends (a key/value
head whose query heads straddle two ranks has its gradient summed over both). The lambda vectors
act alike on every pair: replicated, their gradients summed.
"""

import torch
import torch.distributed as dist
from torch import nn

from tplayers.hf.attention import _finish_attention, _heads_and_widths, head_split
from tplayers.hf.fused import SharedKVProjection, shared_rows_record
from tplayers.hf.shard import ShardingPass, on_device
from tplayers.hf.source import same_forward
from tplayers.placement import shard_range

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def is_differential_attention(module) -> bool:
    """DiffLlama's attention, with transformers' forward line for line."""
    if type(module).__name__ != "DiffLlamaAttention":
        return False
    from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention

    return same_forward(module, DiffLlamaAttention)


def _by_pairs(heads) -> torch.Tensor:
    """Heads [0, heads/2, 1, heads/2 + 1, ...]: head i beside the head it pairs with."""
    return torch.arange(heads).view(2, heads // 2).t().flatten()


def _interleaved(linear: nn.Linear, order: torch.Tensor, head_dim) -> tuple[nn.Linear, torch.Tensor]:
    """(`linear` with its heads in `order`, the HF row of each of its rows): the same parameters'
    values, on the same device."""
    rows = (order[:, None] * head_dim + torch.arange(head_dim)).flatten()
    device = linear.weight.device
    out = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    out.weight = nn.Parameter(linear.weight.detach()[rows.to(device)])
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.detach()[rows.to(device)])
    return out, rows


def differential_attention(sp: ShardingPass, name, attn):
    head_dim = attn.head_dim
    heads, kv_heads = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
    pairs, per_kv = heads // 2, heads // kv_heads
    sizes = head_split(name, pairs, sp.n)
    q_heads, kv_of = [], []  # per rank, in the interleaved order: its query heads, the key/value head of each
    for r in range(sp.n):
        start, count = shard_range(pairs, sp.n, r, sizes)
        first = torch.arange(start, start + count)
        q_heads.append(torch.cat([2 * first, 2 * first + 1]))  # [first half; second half]
        kv = first // per_kv  # the key/value head of query head i + H/2 is that of query head i, + G/2
        kv_of.append(torch.cat([2 * kv, 2 * kv + 1]))
    block = torch.arange(head_dim)
    for proj, order, heads_of in (("q_proj", _by_pairs(heads), q_heads), ("k_proj", _by_pairs(kv_heads), kv_of),
                                  ("v_proj", _by_pairs(kv_heads), kv_of)):  # fmt: skip
        linear, hf_rows = _interleaved(getattr(attn, proj), order, head_dim)
        rows = [(h[:, None] * head_dim + block).flatten() for h in heads_of]
        layer = on_device(SharedKVProjection(linear, rows, group=sp.group, unit=head_dim), linear.weight.device)
        sp.swap(f"{name}.{proj}", layer)
        sp.exports.append(shared_rows_record(f"{name}.{proj}", layer, at=hf_rows))
    sp.row(f"{name}.o_proj", attn.o_proj, split_unit=2 * head_dim, split_sizes=sizes)
    sp.partial_grads.extend(getattr(attn, key) for key in LAMBDAS)
    attn.num_key_value_groups = 1  # one key / value head computed per local query head
    local = 2 * sizes[dist.get_rank(sp.group)]
    _finish_attention(sp, name, attn, _heads_and_widths(attn, heads, head_dim, local, local))
