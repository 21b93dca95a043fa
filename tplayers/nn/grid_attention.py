"""`GridAttention`: self-attention over a 2-D tensor-parallel grid (what `ParallelAttention` builds
when handed `init_mesh(tp=(r, c))["tp_r", "tp_c"]` as its group).

The grid's layout (`tplayers.nn.grid`): the input and output split along the hidden features over
tp_c, whole over tp_r.

    q / k / v  column-type GridLinear: whole heads over tp_r, the hidden features over tp_c; their
               one input's gradient summed over tp_r once (not once per projection)
    attention  rank (i, j) runs its row's heads over the whole sequence (RoPE, GQA, masks as
               ParallelAttention): the c ranks of a row compute the same heads (c x the core's
               compute, no bytes)
    o_proj     row-type GridLinear: the heads over tp_r, the hidden features over tp_c

sequence_parallel=True: the input and output are (B, S/r, H/c), the sequence split over tp_r;
q / k / v's one input is all-gathered along the sequence over tp_r once (backward:
reduce-scattered), o_proj reduce-scatters its output there (`tplayers.nn.grid`).

Heads (and key / value heads) split over tp_r as torch.chunk splits them, in whole heads; a rank
holding none, or key / value groups that a split would cut, are refused by name.
"""

import torch.distributed as dist
from torch import nn

from tplayers.distributed import grid_groups
from tplayers.functional.collectives import all_gather_sequence, copy_to_tp_region
from tplayers.functional.sequence import whole_length
from tplayers.nn.attention import add_rope, attend, from_hf_llama, head_dims
from tplayers.nn.grid import GridLinear
from tplayers.placement import SharesGroups, shard_sizes


def grid_head_split(num_heads, num_kv_heads, r, where) -> tuple[list, list]:
    """(query heads, key/value heads) of each tp_r row: whole heads as torch.chunk splits them,
    each row's query heads the groups of its key/value heads; a row left with none, or a group
    cut in two, refused naming `where`."""
    heads, kv_heads = shard_sizes(num_heads, r), shard_sizes(num_kv_heads, r)
    if 0 in heads or 0 in kv_heads:
        raise ValueError(
            f"{where}: {num_heads} heads / {num_kv_heads} key/value heads over tp_r = {r} leave a rank none"
        )
    if heads != [s * (num_heads // num_kv_heads) for s in kv_heads]:
        raise ValueError(
            f"{where}: {num_heads} heads in {num_kv_heads} key/value groups do not split over tp_r = {r} "
            "by whole groups"
        )
    return heads, kv_heads


class GridAttention(SharesGroups, nn.Module):
    """Causal self-attention over a tp_r x tp_c grid: x (B, S, H / c) -> y (B, S, H / c), the
    hidden features split over tp_c (module docstring). Arguments as `ParallelAttention`'s, the
    grid as `mesh`; with sequence_parallel=True x and y are (B, S / r, H / c). From an HF LlamaAttention:
    `GridAttention.from_hf_llama(attn, mesh=mesh)`."""

    def __init__(
        self, hidden_size, num_heads, num_kv_heads=None, head_dim=None, *, bias=False, qkv_bias=None, causal=True,
        mesh, sequence_parallel=False, overlap="auto", rope_theta=10000.0, device=None, dtype=None,
    ):  # fmt: skip
        super().__init__()
        self.mesh, groups = mesh, grid_groups(mesh)
        self.row_group = groups["tp_r"]
        r, i = dist.get_world_size(self.row_group), dist.get_rank(self.row_group)
        num_kv_heads, head_dim = head_dims(self, hidden_size, num_heads, num_kv_heads, head_dim, rope_theta)
        heads, kv_heads = grid_head_split(num_heads, num_kv_heads, r, "GridAttention")
        self.local_heads, self.local_kv_heads, self.causal = heads[i], kv_heads[i], causal
        self.sequence_parallel = sequence_parallel
        qkv_bias = bias if qkv_bias is None else qkv_bias
        kw = dict(mesh=mesh, overlap=overlap, device=device, dtype=dtype)
        column = dict(out_axis="tp_r", out_unit=head_dim, reduce_input_grad=False, **kw)
        self.q_proj = GridLinear(hidden_size, num_heads * head_dim, qkv_bias, **column)
        self.k_proj = GridLinear(hidden_size, num_kv_heads * head_dim, qkv_bias, **column)
        self.v_proj = GridLinear(hidden_size, num_kv_heads * head_dim, qkv_bias, **column)
        self.o_proj = GridLinear(num_heads * head_dim, hidden_size, bias, out_axis="tp_c", in_unit=head_dim,
                                 sequence_parallel=sequence_parallel, **kw)  # fmt: skip
        add_rope(self, rope_theta, device)

    @classmethod
    def from_hf_llama(cls, attn, config=None, *, mesh, device=None, dtype=None, **kwargs):
        """The layer holding this rank's blocks of an HF LlamaAttention, as
        `ParallelAttention.from_hf_llama` on a 1-D group."""
        return from_hf_llama(cls, attn, config, device, dtype, mesh=mesh, **kwargs)

    def forward(self, x, attention_mask=None, position_ids=None, position_embeddings=None):
        r = dist.get_world_size(self.row_group) if self.sequence_parallel else 1
        seq = whole_length(x.shape[1], r) if x.dim() == 3 else None
        mask = None if attention_mask is None else tuple(attention_mask.shape)
        if seq is None or (mask is not None and mask != (x.shape[0], seq)):
            shard = "seq / tp_r" if self.sequence_parallel else "seq"
            raise ValueError(
                f"GridAttention: input (batch, {shard}, hidden / tp_c) and an attention_mask of "
                f"(batch, seq), got {tuple(x.shape)} and {mask}"
            )
        if self.sequence_parallel:  # the whole sequence for q / k / v; backward reduce-scattered over tp_r, once
            x = all_gather_sequence(x, self.row_group)
        else:  # q / k / v's input gradients summed over tp_r, once
            x = copy_to_tp_region(x, self.row_group)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(attend(q, k, v, self, seq, attention_mask, position_ids, position_embeddings))

    def extra_repr(self):
        return (
            f"hidden_size={self.hidden_size} (split over tp_c), num_heads={self.num_heads} ({self.local_heads} on this "
            f"tp_r row), num_kv_heads={self.num_kv_heads} ({self.local_kv_heads}), head_dim={self.head_dim}, "
            f"causal={self.causal}, rope_theta={self.rope_theta}, sequence_parallel={self.sequence_parallel}"
        )
