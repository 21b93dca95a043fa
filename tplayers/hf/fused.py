"""Fused projections: one HF linear layer holding the rows of several parts, sharded so that
each rank holds exactly the rows its own heads use, with no gathered output, and exported back
to HF's layout exactly.

A layout is a row map: `rows[r]` lists the rows of the unsharded weight that rank r holds, in
the order its local forward reads them.

    [q; k; v] blocks (GPT-2's c_attn, Phi-3's qkv_proj, MPT's Wqkv)   `part_rows`: rank r holds
        [q_r; k_r; v_r], the r-th slice of each part
    CodeGen's qkv_proj: 4 blocks of [q; v; k], each holding a quarter of the heads (the model's
        forward hard-codes the 4)   `codegen_rows`: rank r's heads laid out as 4 local blocks
    per-head [q, k, v] interleaves (GPT-NeoX, Bloom, Falcon) are contiguous per head (or per
        key/value group): a plain column split, no map needed
    multi-query [q; k; v] with one key/value head (GPTBigCode, Falcon-7B): `MultiQueryProjection`,
        the query rows split, the key/value rows whole on every rank
    rows every rank reads, computed once and gathered (a Mamba 2 mixer's B / C of one group):
        `split_and_gathered_column`
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from tplayers.functional.collectives import all_gather_sequence, own_slice, sum_over_tp_region
from tplayers.functional.linear import column_parallel_linear
from tplayers.functional.rng import enter_sharded_region
from tplayers.functional.shared_rows import SharedRows, share_rows
from tplayers.hf import pieces
from tplayers.hf.shard import ShardingPass, as_linear, copy_in, gather, is_conv1d, on_device
from tplayers.hf.state_dict import ExportRecord
from tplayers.nn.linear import ColumnParallelLinear
from tplayers.placement import PlacedModule, shard_range, update_placement


def part_rows(sizes, n, unit=1, split=None) -> list[torch.Tensor]:
    """Parts of `sizes` rows stacked [a; b; ...]: rank r holds its slice of each part, an even
    1/n, or `split[r]` whole units of `unit` rows (attention heads) of each."""
    offsets = torch.tensor([0, *sizes[:-1]]).cumsum(0).tolist()
    out = []
    for r in range(n):
        index = []
        for o, s in zip(offsets, sizes, strict=True):
            start, size = (r * (s // n), s // n) if split is None else shard_range(s // unit, n, r, split)
            start, size = (start, size) if split is None else (start * unit, size * unit)
            index.append(torch.arange(o + start, o + start + size))
        out.append(torch.cat(index))
    return out


def codegen_rows(heads, head_dim, n, blocks=4, split=None) -> list[torch.Tensor]:
    """CodeGen's qkv_proj: `blocks` blocks of [q; v; k], block b holding heads b*H/blocks onwards.
    Rank r holds its heads (`split[r]` x blocks of them, default H/n, contiguous from the previous
    ranks' onwards) in the same layout over its own heads: `blocks` local blocks of [q; v; k],
    each of split[r] heads."""
    per_block = heads // blocks
    split = [heads // (n * blocks)] * n if split is None else split
    rows = []
    for r in range(n):
        index, first, local_per_block = [], blocks * sum(split[:r]), split[r]
        for b in range(blocks):
            for part in range(3):  # q, v, k
                for j in range(local_per_block):
                    global_block, within = divmod(first + b * local_per_block + j, per_block)
                    start = ((global_block * 3 + part) * per_block + within) * head_dim
                    index.append(torch.arange(start, start + head_dim))
        rows.append(torch.cat(index))
    return rows


def _stored(t, key, transpose):
    """A weight between nn.Linear's (out, in) and Conv1D's stored (in, out) layout (either way)."""
    return t.t() if transpose and key == "weight" else t


def fused_column(sp: ShardingPass, name, linear, rows, *, shared_input=True):
    """A column layer over a fused projection (nn.Linear, or Conv1D with its weight stored
    (in, out)) whose rank r holds the rows `rows[r]` of the unsharded weight; exported back to the
    fused HF layout exactly."""
    transpose = is_conv1d(linear)
    full = as_linear(linear, name)
    order = torch.cat(rows)  # the unsharded rows in the order the ranks' shards concatenate
    if sorted(order.tolist()) != list(range(full.out_features)):
        raise ValueError(f"parallelize: {name}: the row map does not cover its {full.out_features} rows once")
    fused = nn.Linear(full.in_features, full.out_features, bias=full.bias is not None, device="meta")
    fused.weight = nn.Parameter(full.weight.detach()[order], requires_grad=False)
    if full.bias is not None:
        fused.bias = nn.Parameter(full.bias.detach()[order], requires_grad=False)
    kwargs = dict(reduce_input_grad=False) if shared_input else dict(sequence_parallel=sp.sp)
    kwargs["split_sizes"] = [len(r) for r in rows]  # what the map gives each rank, however uneven
    layer = on_device(ColumnParallelLinear.from_linear(fused, group=sp.group, **kwargs), linear.weight.device)
    sp.swap(name, layer)
    sp.exports.append(row_map_record(name, layer, rows, full.out_features, transpose))
    return layer


class SharedKVProjection(PlacedModule):
    """Key / value rows that the query heads of several ranks read (more ranks than key/value
    heads, or query heads that do not split with them). Rank r holds only the whole heads its
    query heads read (`held`: rows of the unsharded weight), as Megatron does, and computes
    `rows` of them in its forward's order (one head per local query head, or per local key/value
    head). Placement Shard(0) with overlapping rows: a shared head's gradient is summed over the
    ranks holding it (`share_rows`: one exchange per layer), and norms count it on the first of
    them (`counted`). dx, as for any column layer, is summed over the group by the caller."""

    _placements = {"weight": Shard(0), "bias": Shard(0)}

    def __init__(self, linear: nn.Linear, rows_of_ranks: list[torch.Tensor], *, group, unit: int):
        super().__init__()
        self.group = group
        self.in_features, self.out_features, self.unit = linear.in_features, linear.out_features, unit
        self.rows_of_ranks = [torch.as_tensor(r, dtype=torch.long) for r in rows_of_ranks]
        self.hf_rows = torch.arange(self.out_features)  # its rows' place in the HF tensor (set by its record)
        self.plan = SharedRows([torch.unique(r) for r in self.rows_of_ranks], group)
        self.held = self.plan.held[dist.get_rank(group)]  # the unsharded rows this rank holds
        rows = torch.searchsorted(self.held, self.rows_of_ranks[dist.get_rank(group)])
        first = int(rows[0]) if rows.numel() else 0
        # read through a slice where contiguous: a view, where an index copies the rows every step
        contiguous = torch.equal(rows, torch.arange(first, first + rows.numel()))
        self.rows = slice(first, first + rows.numel()) if contiguous else rows
        device = linear.weight.device
        self.weight = nn.Parameter(linear.weight.detach()[self.held.to(device)].clone())
        bias = linear.bias.detach()[self.held.to(device)].clone() if linear.bias is not None else None
        self.bias = nn.Parameter(bias) if bias is not None else None
        self._keep_placements()

    def _tag_parameters(self, *_):
        for p in (self.weight, self.bias):
            if p is not None:
                update_placement(p, counted=self.plan.counted)
        super()._tag_parameters()

    def forward(self, x):
        weight, bias = share_rows(self.weight, self.bias, self.plan)
        if not isinstance(self.rows, slice) and self.rows.device != weight.device:
            self.rows = self.rows.to(weight.device)  # moved once, not copied to the device every step
        rows = self.rows
        bias = bias[rows] if bias is not None else None
        y = column_parallel_linear(x, weight[rows], bias, self.group, reduce_input_grad=False)
        if self.training:  # this rank's rows: its dropout draws of its own (tplayers.functional.rng)
            enter_sharded_region(y.device, self.group)
        return y

    def extra_repr(self):
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, holds {self.held.numel()} rows "
            f"in heads of {self.unit}, bias={self.bias is not None}"
        )


def shared_rows_record(name, layer: SharedKVProjection, transpose=False, *, at=None, total=None):
    """(name, export, load, layout) of a `SharedKVProjection` whose rows are rows `at` (default:
    the same) of an HF tensor of `total` rows: each rank exports and loads the heads it holds;
    its checkpoint pieces are one per head, so ranks sharing a head name the same chunk (written
    once)."""
    at = torch.arange(layer.out_features) if at is None else at
    layer.hf_rows = at
    rows = [at[held] for held in layer.plan.held]  # the HF rows each rank holds
    return row_map_record(name, layer, rows, layer.out_features if total is None else total, transpose, layer.unit)


def row_map_record(name, layer, rows, total, transpose=False, unit=0):
    """(name, export, load, layout) of a layer whose rank r holds rows `rows[r]` of an HF tensor
    of `total` rows (Conv1D's weight stored transposed: `transpose`), each covered once (a fused
    projection) or, with `unit`, also by other ranks in blocks of that many (shared heads)."""
    keys = ("weight", "bias") if layer.bias is not None else ("weight",)
    order, own = torch.cat(rows), rows[dist.get_rank(layer.group)]

    def export(pick, group):
        out = {}
        for key in keys:
            t = gather(pick(getattr(layer, key)), 0, group)
            if t is not None:
                full = t.new_zeros((total, *t.shape[1:]))
                full[order.to(t.device)] = t
                out[key] = _stored(full, key, transpose)
        return out

    def load(full_tensors):
        for key in keys:
            t = _stored(full_tensors[key], key, transpose)
            copy_in(getattr(layer, key), t[own.to(t.device)])

    def layout():
        return [pieces.rows(key, getattr(layer, key), own, total, transpose and key == "weight", unit) for key in keys]

    return ExportRecord(name, export, load, layout)


class MultiQueryProjection(nn.Module):
    """[q; k; v] with one key/value head: `query` (column-parallel: this rank's heads) and
    `key_value` (the one key/value head, whole on every rank), concatenated as the model's
    forward expects: [q_r; k; v]. The input is prepared once for the attention (its gradient
    summed, or the sequence gathered) by the hook parallelize puts before it."""

    def __init__(self, query: ColumnParallelLinear, key_value: SharedKVProjection, interleave=None):
        super().__init__()
        self.query, self.key_value = query, key_value
        # the output columns in the order the model's forward reads them (None: [q_r; k; v] as is)
        self.register_buffer("interleave", interleave, persistent=False)

    def forward(self, x):
        out = torch.cat([self.query(x), self.key_value(x)], -1)
        return out if self.interleave is None else out.index_select(-1, self.interleave)


def _linear_of(weight, bias) -> nn.Linear:
    """An nn.Linear (built on the meta device) holding `weight` / `bias`."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


def multi_query_column(
    sp: ShardingPass, name, linear, query_rows: int, *, head_dim=1, kv_rows=None, split=None, order=None,
    interleave=None,
):  # fmt: skip
    """Shard a multi-query [q; k; v] projection whose first `query_rows` rows are the queries: the
    queries split in whole heads of `head_dim` rows (`split`: every rank's heads; default as
    torch.chunk splits them); of the key / value rows each rank holds and computes `kv_rows[r]`
    (every rank's rows of that block; default: all of them on every rank), shared heads summed
    over the ranks holding them (`SharedKVProjection`). `order`: the HF rows in that
    [queries; keys / values] order, where the HF layout interleaves them (Falcon's groups);
    `interleave`: the local output columns in the order the model's forward reads them."""
    full = as_linear(linear, name)
    device = linear.weight.device
    w, b = full.weight.detach(), (full.bias.detach() if full.bias is not None else None)
    order = torch.arange(w.shape[0]) if order is None else order
    w, b = w[order], (None if b is None else b[order])
    query = ColumnParallelLinear.from_linear(
        _linear_of(w[:query_rows], None if b is None else b[:query_rows]), group=sp.group, reduce_input_grad=False,
        split_unit=head_dim, split_sizes=split,
    )  # fmt: skip
    query = on_device(query, device)
    every = [torch.arange(w.shape[0] - query_rows)] * sp.n if kv_rows is None else kv_rows
    key_value = SharedKVProjection(
        _linear_of(w[query_rows:], None if b is None else b[query_rows:]), every, group=sp.group, unit=head_dim
    )
    key_value = on_device(key_value, device)
    sp.swap(name, on_device(MultiQueryProjection(query, key_value, interleave), device))
    transpose = is_conv1d(linear)
    keys = ("weight", "bias") if b is not None else ("weight",)
    total = w.shape[0]  # not `w` in the closure: it is the unsharded weight
    key_value.hf_rows = order[query_rows:]
    held_rows = order[query_rows + key_value.held]  # the HF rows of the keys / values this rank holds
    all_held = order[query_rows + torch.cat(key_value.plan.held)]

    def export(pick, group):
        out = {}
        for key in keys:
            q = gather(pick(getattr(query, key)), 0, group)
            kv = gather(pick(getattr(key_value, key)), 0, group)
            if q is not None and kv is not None:
                hf = q.new_empty((total, *q.shape[1:]))
                hf[order[:query_rows].to(hf.device)] = q
                hf[all_held.to(hf.device)] = kv
                out[key] = _stored(hf, key, transpose)
        return out

    def load(full_tensors):
        for key in keys:
            t = _stored(full_tensors[key], key, transpose)
            t = t[order.to(t.device)]
            copy_in(getattr(query, key), own_slice(t[:query_rows], 0, sp.group, head_dim, query.split_sizes))
            copy_in(getattr(key_value, key), t[query_rows:][key_value.held.to(t.device)])

    def layout():
        out = []
        for key in keys:
            t = key == "weight" and transpose
            q, kv = getattr(query, key), getattr(key_value, key)
            rank = dist.get_rank(sp.group)
            start, size = (head_dim * v for v in shard_range(query_rows // head_dim, sp.n, rank, query.split_sizes))
            out.append(pieces.Piece(key, q, 0, torch.arange(size), order[start : start + size], total, t))
            out.append(pieces.rows(key, kv, held_rows, total, t, unit=head_dim))
        return out

    sp.exports.append(ExportRecord(name, export, load, layout))


class GatheredColumns(PlacedModule):
    """Output features every rank reads but none need compute twice (B / C of a Mamba 2 mixer's
    one group of heads): rank r computes its contiguous 1/n of them, gathered over the group; in
    backward the ranks' partial gradients of them (each from its own heads) are summed and each
    rank keeps its slice (`all_gather_sequence` along the features), so its rows get their whole
    gradient. The input gradient is partial, summed by the caller as for any column layer."""

    _placements = {"weight": Shard(0), "bias": Shard(0)}

    def __init__(self, linear: nn.Linear, *, group):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if self.out_features % dist.get_world_size(group):
            raise ValueError(f"GatheredColumns: {self.out_features} features do not split over the group evenly")
        self.weight = nn.Parameter(own_slice(linear.weight.detach(), 0, group).clone())
        bias = linear.bias
        self.bias = nn.Parameter(own_slice(bias.detach(), 0, group).clone()) if bias is not None else None
        self._keep_placements()

    def forward(self, x):
        return all_gather_sequence(nn.functional.linear(x, self.weight, self.bias), self.group, dim=-1)

    def extra_repr(self):
        n = dist.get_world_size(self.group)
        return f"in_features={self.in_features}, out_features={self.out_features} ({self.out_features // n} per rank)"


def split_and_gathered_column(sp: ShardingPass, name, linear, order, query_rows: int, *, unit, split, interleave):
    """A projection whose HF rows, taken in `order`, are first `query_rows` rows split by whole
    heads of `unit` rows (`split`: every rank's heads), then rows every rank reads, computed once
    and gathered (`GatheredColumns`); the output put in the forward's order by `interleave`."""
    full = as_linear(linear, name)
    device = linear.weight.device
    w, b = full.weight.detach()[order], (full.bias.detach()[order] if full.bias is not None else None)
    query = ColumnParallelLinear.from_linear(
        _linear_of(w[:query_rows], None if b is None else b[:query_rows]), group=sp.group, reduce_input_grad=False,
        split_unit=unit, split_sizes=split,
    )  # fmt: skip
    query = on_device(query, device)
    shared = on_device(
        GatheredColumns(_linear_of(w[query_rows:], None if b is None else b[query_rows:]), group=sp.group), device
    )
    sp.swap(name, on_device(MultiQueryProjection(query, shared, interleave), device))
    keys = ("weight", "bias") if b is not None else ("weight",)
    total, rank = w.shape[0], dist.get_rank(sp.group)
    start, size = (unit * v for v in shard_range(query_rows // unit, sp.n, rank, split))
    own_query = order[start : start + size]
    own_shared = order[query_rows + pieces.own_range(total - query_rows, sp.group)]

    def export(pick, group):
        out = {}
        for key in keys:
            q, s = gather(pick(getattr(query, key)), 0, group), gather(pick(getattr(shared, key)), 0, group)
            if q is not None and s is not None:
                hf = q.new_empty((total, *q.shape[1:]))
                hf[order[:query_rows].to(hf.device)] = q
                hf[order[query_rows:].to(hf.device)] = s
                out[key] = hf
        return out

    def load(full_tensors):
        for key in keys:
            t = full_tensors[key]
            copy_in(getattr(query, key), t[own_query.to(t.device)])
            copy_in(getattr(shared, key), t[own_shared.to(t.device)])

    def layout():
        parts = ((query, own_query), (shared, own_shared))
        return [pieces.rows(key, getattr(layer, key), own, total) for key in keys for layer, own in parts]

    sp.exports.append(ExportRecord(name, export, load, layout))


class SummedRowLinear(PlacedModule):
    """A row-parallel projection whose whole output every rank reads and uses for its own part
    (Mamba's x_proj: each rank's channels give dt / B / C, which every rank's channels use): each
    rank's partial product summed over the group, and in backward the ranks' partial gradients of
    that output summed again (`sum_over_tp_region`), so each rank's columns and input get their
    whole gradient. Placement Shard(1) by input features (`split_sizes`).

    `reads`: the (start, stop) ranges of this rank's input its columns multiply, where it holds more
    (Doge's value heads, some of them also held by another rank, which counts them); None: all.
    A bias is added once, after the sum: whole on every rank, its gradient each rank's part of the
    output's (the caller sums it over the group: `summed_grads`)."""

    _placements = {"weight": Shard(1)}  # the bias: Replicate, tagged by the sum over the group (`summed_grads`)

    def __init__(self, linear: nn.Linear, *, group, split_sizes, reads=None):
        super().__init__()
        self.group, self.split_unit, self.split_sizes = group, 1, list(split_sizes)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(own_slice(linear.weight.detach(), 1, group, 1, self.split_sizes).clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.reads = None if reads is None else list(reads)  # (start, stop) ranges: slices, on any device
        self._keep_placements()

    def forward(self, x):
        if self.reads is not None:  # one range: a view; several: one copy; none: none of it
            parts = [x[..., a:b] for a, b in self.reads] or [x[..., :0]]
            x = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        y = sum_over_tp_region(nn.functional.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return f"in_features={self.in_features} ({self.weight.shape[1]} on this rank), out_features={self.out_features}"
