"""Bytes each rank sends per forward+backward equal the ring minimum; the collective Functions
are exact (integer-valued data) forward and backward."""

import pytest
import torch

import tplayers
from tplayers.functional import (
    all_gather_sequence,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_sequence,
    scatter_to_tp_region,
)
from tplayers.testing import assert_close, integer_valued, shard_of

pytestmark = pytest.mark.multirank

B, S_PER_RANK, H, F_PER_RANK = 2, 3, 10, 4
EL = 4  # fp32


def block_bytes(rank, tp, group, mode, overlap):
    torch.manual_seed(0)
    sp, gather = mode == "sp", mode == "gather"
    col = tplayers.ColumnParallelLinear(
        H, F_PER_RANK * tp, group=group, sequence_parallel=sp, gather_output=gather, overlap=overlap
    )
    row = tplayers.RowParallelLinear(
        F_PER_RANK * tp, H, group=group, sequence_parallel=sp, input_is_parallel=not gather, overlap=overlap
    )
    x = torch.randn(B, S_PER_RANK if sp else S_PER_RANK * tp, H, requires_grad=True)
    with tplayers.count_bytes() as sent:
        row(torch.relu(col(x))).sum().backward()
    return sent.total()


def ring_minimum(tp, mode):
    """Bytes one rank must send: (n-1)/n of the full buffer per AllGather / ReduceScatter,
    2(n-1)/n per AllReduce."""
    n = tp
    act_h = B * S_PER_RANK * n * H * EL  # a full-sequence (B, S, H) activation
    act_f = B * S_PER_RANK * n * F_PER_RANK * n * EL  # a full (B, S, F) activation
    if mode == "sp":  # column: AG fwd, RS bwd; row: RS fwd, AG bwd
        return 4 * (n - 1) / n * act_h
    if mode == "plain":  # column: AR of dx bwd; row: AR of y fwd
        return 2 * 2 * (n - 1) / n * act_h
    # gather: column AG of y fwd; row AG of dx bwd (scatter fwd is free); plus the plain ARs
    return 2 * (n - 1) / n * act_f + 2 * 2 * (n - 1) / n * act_h


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["plain", "sp", "gather"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_bytes_sent_equal_ring_minimum(pool, tp, mode, overlap):
    sent = pool.run(block_bytes, tp, mode, overlap)
    expected = ring_minimum(tp, mode)
    assert sent == [pytest.approx(expected, abs=tp)] * tp  # rounding of (n-1)/n to whole bytes


def collectives_exact(rank, tp, group):
    """Each collective Function and its adjoint against what they must compute, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    per_rank = [integer_valued((2, 3 * tp, 2 * tp), generator=gen) for _ in range(tp)]
    grads = [integer_valued((2, 3 * tp, 2 * tp), generator=gen) for _ in range(tp)]
    total, total_grad = sum(per_rank), sum(grads)
    mine, my_grad = per_rank[rank], grads[rank]

    def check(fn, x, dy, y_expected, dx_expected):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(dy)
        assert_close(y, y_expected, exact=True)
        assert_close(x.grad, dx_expected, exact=True)

    check(lambda x: copy_to_tp_region(x, group), mine, my_grad, mine, total_grad)
    check(lambda x: reduce_from_tp_region(x, group), mine, my_grad, total, my_grad)
    for dim in (1, -1):
        full_grad = torch.cat([shard_of(g, dim, r, tp) for r, g in enumerate(grads)], dim)
        check(
            lambda x, d=dim: scatter_to_tp_region(x, group, dim=d),
            per_rank[0], shard_of(my_grad, dim, rank, tp),
            shard_of(per_rank[0], dim, rank, tp), full_grad,
        )  # fmt: skip
    local = [shard_of(t, 1, r, tp) for r, t in enumerate(per_rank)]
    check(
        lambda x: gather_from_tp_region(x, group, dim=-1),
        shard_of(mine, -1, rank, tp), my_grad,
        torch.cat([shard_of(t, -1, r, tp) for r, t in enumerate(per_rank)], -1), shard_of(my_grad, -1, rank, tp),
    )  # fmt: skip
    check(
        lambda x: all_gather_sequence(x, group),
        local[rank], my_grad, torch.cat(local, 1), shard_of(total_grad, 1, rank, tp),
    )  # fmt: skip
    check(
        lambda x: reduce_scatter_sequence(x, group),
        mine, shard_of(my_grad, 1, rank, tp), shard_of(total, 1, rank, tp),
        torch.cat([shard_of(g, 1, r, tp) for r, g in enumerate(grads)], 1),
    )  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_collectives_exact(pool, tp):
    pool.run(collectives_exact, tp)
