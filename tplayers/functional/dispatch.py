"""Expert-parallel dispatch: each token to the ranks holding the experts it picked, and back.

Rank r of the expert group holds experts [first_r, first_r + sizes[r]) whole. A layer's tokens
(T, H) with their top-k expert indices and routing weights (T, k) travel as

    route      the destinations of every token: a token goes to each rank holding one of its
               experts once, however many of its experts that rank holds (DeepEP's count: bytes
               per token per destination rank); the per-rank counts are exchanged first
    dispatch   one all-to-all each of the tokens, of their expert indices local to the receiver
               (-1: an expert held elsewhere) and of their routing weights
    experts    the receiver runs its (token, expert) pairs, expert by expert, the routing weight
               scaling each pair's output, and sums each token's pairs in a fixed order
    combine    one all-to-all of each token's sum back to the sender, which adds its
               destinations' sums in rank order

so the result does not depend on timing (deterministic), and the routing weights' gradient comes
back to the sender through the same all-to-alls. A rank that sends or receives nothing still
takes part in every all-to-all, forward and backward, with empty blocks: the graph always runs
through them, so no rank waits for one that skipped a collective, and experts that got no token
get zero gradients, not None.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tplayers.functional import comm


def _exchange(t, send, recv, group):
    out = t.new_empty((sum(recv), *t.shape[1:]))
    comm.all_to_all_rows(out, t.contiguous(), recv, send, group, axis="ep")
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to ranks (`send[s]` to rank s), `recv[s]` rows from each; backward the reverse."""

    @staticmethod
    def forward(ctx, t, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(t, send, recv, group)

    @staticmethod
    def backward(ctx, dy):
        return _exchange(dy, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(t, send, recv, group):
    """`t`'s rows sent in blocks of `send[s]` to rank s of `group`, `recv[s]` received from each
    (differentiable: the gradient travels back the same way)."""
    return _AllToAll.apply(t, list(send), list(recv), group)


@dataclass
class Route:
    """Where one layer's tokens go: the sent rows (`token`: the token of each, grouped by
    destination rank in rank order, tokens in order within), each row's place among its token's
    destinations (`slot`), the rows sent to and received from each rank, and the local expert
    index (-1: not on that rank) of each sent row's k picks."""

    token: torch.Tensor
    slot: torch.Tensor
    send: list
    recv: list
    local: torch.Tensor
    width: int  # the most destinations one token has: min(k, ranks)


def route(indices, sizes, num_experts, group) -> Route:
    """The route of tokens picking `indices` (T, k) of `num_experts` experts, rank r of `group`
    holding `sizes[r]` of them in order (an index outside [0, num_experts), HF's padding, goes
    nowhere). One all-to-all of the per-rank counts (8 bytes per rank pair)."""
    n, device = len(sizes), indices.device
    starts = torch.tensor([0, *sizes], device=device).cumsum(0)
    owner_of = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(sizes, device=device))
    valid = (indices >= 0) & (indices < num_experts)
    owner = torch.where(valid, owner_of[indices.clamp(0, num_experts - 1)], n)  # n: nowhere
    dest = torch.zeros(indices.shape[0], n + 1, dtype=torch.bool, device=device)
    dest.scatter_(1, owner, True)
    dest = dest[:, :n]
    rank, token = dest.t().nonzero(as_tuple=True)  # by rank, tokens in order within
    slot = (dest.cumsum(1) - 1)[token, rank]
    send = dest.sum(0)
    recv = torch.empty_like(send)
    comm.all_to_all_rows(recv, send, [1] * n, [1] * n, group, axis="ep")
    local = torch.where(owner[token] == rank[:, None], indices[token] - starts[rank][:, None], -1)
    width = min(indices.shape[1], n)
    return Route(token, slot, send.tolist(), recv.tolist(), local, width)


def dispatch(hidden, weights, r: Route, group):
    """(tokens, their local expert indices, their routing weights) this rank receives, the
    senders in rank order."""
    local = _exchange(r.local.to(torch.int32), r.send, r.recv, group).long()  # integers: no gradient
    return (
        all_to_all(hidden[r.token], r.send, r.recv, group),
        local,
        all_to_all(weights[r.token], r.send, r.recv, group),
    )


def combine(out, r: Route, tokens, group):
    """Each sent token's result back to its sender, summed over its destinations in rank order."""
    back = all_to_all(out, r.recv, r.send, group)
    rows = back.new_zeros(tokens * r.width, *back.shape[1:]).index_copy(0, r.token * r.width + r.slot, back)
    return rows.view(tokens, r.width, *back.shape[1:]).sum(1)


@dataclass
class Pairs:
    """The (token, expert) pairs one rank runs, sorted by expert (stable: tokens in order within):
    the received row of each (`gather`), its place in a (rows, k) grid of outputs (`scatter`),
    its expert and weight positions, and how many pairs each local expert has (`counts`)."""

    gather: torch.Tensor
    scatter: torch.Tensor
    pick: torch.Tensor  # the pair's column among its token's k picks
    counts: torch.Tensor


def pairs(local, n_local) -> Pairs:
    """The pairs of received tokens whose local expert indices are `local` (R, k; -1: none)."""
    row, pick = (local >= 0).nonzero(as_tuple=True)  # row-major
    expert = local[row, pick]
    order = torch.argsort(expert, stable=True)
    row, pick, expert = row[order], pick[order], expert[order]
    counts = torch.bincount(expert, minlength=n_local) if n_local else expert.new_zeros(0)
    return Pairs(row, row * local.shape[1] + pick, pick, counts)


# ------------------------------------------------------------------- uneven rows over the TP group
# Under sequence parallelism each tensor-parallel rank dispatches its own tokens; the experts'
# features are split over the TP group, so each rank runs the rows every rank of its TP group
# received (gathered, uneven), and the partial outputs are summed back to the rank that received
# each row (reduce-scattered, uneven).


def _padded(t, widest):
    return torch.cat([t, t.new_zeros(widest - t.shape[0], *t.shape[1:])]) if t.shape[0] < widest else t


def _gather_rows(t, sizes, group):
    n, widest = len(sizes), max(sizes)
    out = t.new_empty((n, widest, *t.shape[1:]))
    comm.all_gather_into(out, _padded(t, widest).contiguous(), group)
    return torch.cat([out[i, :s] for i, s in enumerate(sizes)])


def _reduce_scatter_rows(t, sizes, group):
    n, widest, r = len(sizes), max(sizes), dist.get_rank(group)
    blocks = torch.stack([_padded(b, widest) for b in t.split(sizes)]) if n else t
    out = t.new_empty((widest, *t.shape[1:]))
    comm.reduce_scatter_into(out, blocks.contiguous(), group)
    return out[: sizes[r]]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather_rows(t, sizes, group)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter_rows(dy, ctx.sizes, ctx.group), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_rows(t, sizes, group)

    @staticmethod
    def backward(ctx, dy):
        return _gather_rows(dy.contiguous(), ctx.sizes, ctx.group), None, None


def row_counts(rows: int, group, device) -> list:
    """Every rank's row count (one tiny all-gather, not counted: a control message)."""
    n = dist.get_world_size(group)
    out = torch.empty(n, dtype=torch.int64, device=device)
    comm.all_gather_into(out, torch.tensor([rows], device=device), group, record=False)
    return out.tolist()


def gather_rows(t, sizes, group):
    """Every rank's rows (`sizes[r]` of them) in rank order; backward sums the gradient over the
    group and keeps this rank's rows."""
    return t if len(sizes) == 1 else _GatherRows.apply(t, sizes, group)


def reduce_scatter_rows(t, sizes, group):
    """`t` (every rank's rows, in rank order) summed over the group, this rank's rows kept."""
    return t if len(sizes) == 1 else _ReduceScatterRows.apply(t, sizes, group)
