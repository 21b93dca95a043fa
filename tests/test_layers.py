"""Column -> activation -> Row block against the unsharded nn.Linear block: forward and every
gradient, on 1-4 local ranks, both backends, overlap on and off."""

import contextlib
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tplayers
from tplayers.testing import assert_close, assert_close_or_rounding, assert_shard_close, examples, integer_valued

pytestmark = pytest.mark.multirank

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@dataclass(frozen=True)
class BlockCase:
    batch: int
    seq_per_rank: int
    hidden: int
    ffn_per_rank: int
    dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    gather: bool = False  # column gather_output=True, row input_is_parallel=False
    bias: bool = True
    overlap: bool | str = "auto"
    backend: str = "torch"
    exact: bool = False  # integer-valued data, compared bit for bit
    wrong_shard: bool = False  # negative control: the column layer gets its neighbour's slice
    # without SP any leading dims work: (B*S, H), (B, S, H), (B, 1, S, H); with SP (B, S/n, H) or
    # this rank's (tokens, H), split along the tokens (OPT's flattened MLP, MoE blocks)
    leading_dims: int = 2
    seed: int = 0
    ffn: int | None = None  # the whole width when it does not divide: ffn_per_rank is then its ceil-share
    seq: int | None = None  # with SP, the whole length when it does not divide: split as torch.tensor_split splits it


def run_block(rank, tp, group, case: BlockCase):
    """One rank's check; raises on any mismatch. Returns the row bias grad (must be identical everywhere)."""
    tplayers.set_backend(case.backend)
    if case.backend == "triton":  # the kernel itself runs, in the interpreter, not the reference
        from tplayers.kernels import matmul

        assert matmul.INTERPRET
    torch.manual_seed(case.seed)
    S, F = case.seq or case.seq_per_rank * tp, case.ffn if case.ffn is not None else case.ffn_per_rank * tp
    sizes = [len(part) for part in torch.arange(S).tensor_split(tp)]  # each rank's part under SP (torch's split)
    fc1 = nn.Linear(case.hidden, F, bias=case.bias, dtype=case.dtype)
    fc2 = nn.Linear(F, case.hidden, bias=case.bias, dtype=case.dtype)
    shape = (case.batch, S, case.hidden)
    if case.exact:
        with torch.no_grad():
            for p in [*fc1.parameters(), *fc2.parameters()]:
                p.copy_(integer_valued(p.shape, case.dtype))
        x, dy = integer_valued(shape, case.dtype), integer_valued(shape, case.dtype)
        act = torch.relu  # keeps integers integers
    else:
        x, dy = torch.randn(shape, dtype=case.dtype), torch.randn(shape, dtype=case.dtype)
        act = nn.functional.gelu

    x_ref = x.clone().requires_grad_(True)
    y_ref = fc2(act(fc1(x_ref)))
    y_ref.backward(dy)

    source = fc1
    if case.wrong_shard:
        source = nn.Linear(case.hidden, F, bias=case.bias, dtype=case.dtype)
        with torch.no_grad():
            source.weight.copy_(fc1.weight.roll(-(-F // tp), 0))
            if case.bias:
                source.bias.copy_(fc1.bias)
    sp = case.sequence_parallel
    col = tplayers.ColumnParallelLinear.from_linear(
        source, group=group, sequence_parallel=sp, gather_output=case.gather, overlap=case.overlap
    )
    row = tplayers.RowParallelLinear.from_linear(
        fc2, group=group, sequence_parallel=sp, input_is_parallel=not case.gather, overlap=case.overlap
    )
    seq_dim = 1 if sp else None
    x_local = (x.split(sizes, 1)[rank] if sp else x).clone()
    dy_local = dy.split(sizes, 1)[rank] if sp else dy
    b, t = x_local.shape[:2]
    lead = {1: (-1,), 2: (b, t), 3: (b, 1, t)}[case.leading_dims]
    x_local = x_local.reshape(*lead, case.hidden).requires_grad_(True)
    with tplayers.functional.sequence_split(S, group) if sp else contextlib.nullcontext():
        y = row(act(col(x_local)))
    y.backward(dy_local.reshape(y.shape))  # outside the split: each collective kept its sizes
    y, x_grad = y.reshape(dy_local.shape), x_local.grad.reshape(dy_local.shape)

    kw = dict(rank=rank, num_shards=tp, exact=case.exact)
    assert_shard_close(y, y_ref.detach(), dim=seq_dim, **kw, sizes=sizes, msg=lambda m: f"output: {m}")
    assert_shard_close(x_grad, x_ref.grad, dim=seq_dim, **kw, sizes=sizes, msg=lambda m: f"input grad: {m}")
    assert_shard_close(col.weight.grad, fc1.weight.grad, dim=0, **kw, msg=lambda m: f"column weight grad: {m}")
    assert_shard_close(row.weight.grad, fc2.weight.grad, dim=1, **kw, msg=lambda m: f"row weight grad: {m}")
    if case.bias:
        assert_shard_close(col.bias.grad, fc1.bias.grad, dim=0, **kw, msg=lambda m: f"column bias grad: {m}")
        assert_shard_close(row.bias.grad, fc2.bias.grad, dim=None, **kw, msg=lambda m: f"row bias grad: {m}")
        return row.bias.grad
    return None


def check_block(pool, tp, case):
    bias_grads = pool.run(run_block, tp, case)
    if case.bias:  # a replicated parameter's grad is the same on every rank, bit for bit
        for g in bias_grads[1:]:
            assert torch.equal(g, bias_grads[0])


def block_cases(draw, dtypes, max_hidden, max_ffn_per_rank, backend):
    tp = draw(st.integers(1, 4))
    sp = draw(st.booleans())
    ffn_per_rank = draw(st.integers(1, max_ffn_per_rank))
    seq = draw(st.one_of(st.none(), st.integers(tp, 3 * tp + 2))) if sp else None  # any length the group splits
    # any width: even, uneven, or narrower than the group (ranks holding none of it)
    case = BlockCase(
        batch=draw(st.integers(1, 3)),
        seq_per_rank=draw(st.integers(1, 3)),
        seq=seq,
        hidden=draw(st.integers(1, max_hidden)),
        ffn_per_rank=ffn_per_rank,
        ffn=draw(st.one_of(st.none(), st.integers(1, ffn_per_rank * tp))),
        dtype=draw(st.sampled_from(dtypes)),
        sequence_parallel=sp,
        gather=False if sp else draw(st.booleans()),
        bias=draw(st.booleans()),
        overlap=draw(st.sampled_from(["auto", True, False])),
        leading_dims=draw(st.sampled_from([1, 2] if sp else [1, 2, 3])),
        backend=backend,
        seed=draw(st.integers(0, 2**16)),
    )
    return tp, case


@settings(max_examples=examples(60))
@given(st.data())
def test_block_matches_unsharded_torch_backend(pool, data):
    tp, case = data.draw(st.composite(lambda draw: block_cases(draw, DTYPES, 40, 12, "torch"))())
    check_block(pool, tp, case)


@pytest.mark.interpreter
@settings(max_examples=examples(25))
@given(st.data())
def test_block_matches_unsharded_triton_backend(pool, data):
    tp, case = data.draw(st.composite(lambda draw: block_cases(draw, DTYPES, 12, 6, "triton"))())
    check_block(pool, tp, case)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "mode", ["plain", "sequence_parallel", "sp_tokens", "sp_uneven", "gather"],
    ids=["plain", "sp", "sp_tokens", "sp_uneven_length", "gather_output"],
)  # fmt: skip
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("width", ["even", "uneven"])
def test_block_exact_with_integer_values(pool, tp, mode, overlap, width):
    """uneven: 2 tp + 1 features, split [3, 2], [3, 3, 1], [3, 3, 3, 0] (the last rank holds none);
    sp_uneven_length: 3 tp + 1 tokens, split [4, 3], [4, 3, 3], [4, 3, 3, 3]."""
    case = BlockCase(
        batch=2, seq_per_rank=3, hidden=13, ffn_per_rank=5, exact=True, overlap=overlap,
        sequence_parallel=mode.startswith("s"), gather=mode == "gather", leading_dims=1 if mode == "sp_tokens" else 2,
        ffn=2 * tp + 1 if width == "uneven" else None, seq=3 * tp + 1 if mode == "sp_uneven" else None,
    )  # fmt: skip
    check_block(pool, tp, case)


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["plain", "sequence_parallel"])
def test_block_exact_with_integer_values_triton(pool, mode):
    case = BlockCase(
        batch=2, seq_per_rank=2, hidden=7, ffn_per_rank=5, exact=True, backend="triton",
        sequence_parallel=mode == "sequence_parallel",
    )  # fmt: skip
    check_block(pool, 3, case)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "tolerance"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_negative_control_wrong_shard_fails(pool, exact, sequence_parallel):
    case = BlockCase(
        batch=2, seq_per_rank=2, hidden=8, ffn_per_rank=4, exact=exact,
        sequence_parallel=sequence_parallel, wrong_shard=True,
    )  # fmt: skip
    with pytest.raises(tplayers.RankError, match="Tensor-likes are not"):
        check_block(pool, 2, case)
    check_block(pool, 2, replace(case, wrong_shard=False))  # and the pool still works


def test_tolerance_helper_negative_control():
    x = torch.randn(64)
    with pytest.raises(AssertionError):
        assert_close(x + 1e-3, x)  # well outside fp32 tolerance
    with pytest.raises(AssertionError):
        assert_close(x + 1e-7 * x.abs().max(), x, exact=True)
    assert_close(x.clone(), x, exact=True)


def test_rounding_helper_negative_control():
    """Past the table but no farther from fp64 than the unsharded result: rounding, passed; farther by
    more than the arbiter's factor: refused, both distances said."""
    truth = torch.randn(64, dtype=torch.float64)
    expected = (truth + 1e-3).float()  # the unsharded fp32 result, 1e-3 off fp64 (amplified rounding)
    assert_close_or_rounding((truth - 1e-3).float(), expected, truth)  # as far on the other side
    with pytest.raises(AssertionError, match="from the fp64 result, where the unsharded one is 0.001"):
        assert_close_or_rounding((truth + 1e-2).float(), expected, truth)


def widths_in_turn(rank, tp, group):
    """A layer of 96 output features (48 a rank), then one of 97 (49 and 48), overlap="auto"."""
    torch.manual_seed(0)
    for out in (96, 97):
        layer = tplayers.ColumnParallelLinear(8, out, group=group, sequence_parallel=True)
        layer(torch.randn(2, 3, 8)).sum().backward()


def test_uneven_widths_ask_one_overlap_question(pool):
    """Regression (a hang): the overlap choice is cached by shape; keyed by each rank's own width,
    the rank holding 48 of 97 found the 96-wide layer's entry and went on, while the one holding
    49 asked the group and waited. Every rank now asks about the widest rank's width."""
    pool.run(widths_in_turn, 2, timeout_s=60)


@settings(max_examples=60)
@given(total=st.integers(0, 300), n=st.integers(1, 16))
def test_shard_sizes_are_torch_chunks_and_dtensor_shards(total, n):
    """The library's split against torch's own: torch.chunk's pieces (padded with empty ranks) and
    DTensor's Shard(0) local sizes, for drawn (size, ranks) pairs."""
    from torch.distributed.tensor import Shard

    from tplayers.placement import shard_range, shard_sizes

    chunks = [c.numel() for c in torch.chunk(torch.arange(total), n)] if total else []
    expected = chunks + [0] * (n - len(chunks))
    assert shard_sizes(total, n) == expected
    dtensor = [Shard(0)._local_shard_size_and_offset(total, n, r)[0] for r in range(n)]
    assert shard_sizes(total, n) == dtensor
    assert [shard_range(total, n, r) for r in range(n)] == [(sum(expected[:r]), expected[r]) for r in range(n)]


def gathered_weight_step(rank, tp, group, sequence_parallel, wrong_rows, rows=7):
    """GatheredWeightLinear (7 rows: uneven over 2-4 ranks; 12: even) against nn.Linear on integer values, bit
    for bit: the output over this rank's tokens, the input's gradient, this rank's rows of the weight
    and bias gradients (under SP each rank has its own tokens; the reference sees all of them)."""
    from tplayers.nn.linear import GatheredWeightLinear

    g = torch.Generator().manual_seed(0)
    full = nn.Linear(5, rows)
    with torch.no_grad():
        full.weight.copy_(integer_valued((rows, 5), generator=g))
        full.bias.copy_(integer_valued((rows,), generator=g))
    x = integer_valued((2, 3 * tp, 5), generator=g).requires_grad_(True)
    dy = integer_valued((2, 3 * tp, rows), generator=g)
    layer = GatheredWeightLinear.from_linear(full, group=group, sequence_parallel=sequence_parallel)
    if wrong_rows:  # negative control: every rank holds the first rank's rows
        with torch.no_grad():
            layer.weight.copy_(full.weight[: layer.weight.shape[0]])
    mine = slice(3 * rank, 3 * rank + 3) if sequence_parallel else slice(None)
    x_local = x.detach()[:, mine].clone().requires_grad_(True)
    (layer(x_local) * dy[:, mine]).sum().backward()
    (full(x) * dy).sum().backward()
    assert_close(layer(x_local), full(x)[:, mine], exact=True)
    assert_close(x_local.grad, x.grad[:, mine], exact=True)
    assert_shard_close(layer.weight.grad, full.weight.grad, dim=0, rank=rank, num_shards=tp, exact=True)
    assert_shard_close(layer.bias.grad, full.bias.grad, dim=0, rank=rank, num_shards=tp, exact=True)


@pytest.mark.parametrize("rows", [7, 12], ids=["uneven", "even"])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_gathered_weight_linear_is_nn_linear(pool, tp, sequence_parallel, rows):
    pool.run(gathered_weight_step, tp, sequence_parallel, False, rows)


def test_negative_control_gathered_weight_linear_with_wrong_rows(pool):
    for reply in pool.run(gathered_weight_step, 2, False, True, return_exceptions=True)[1:]:
        assert isinstance(reply, tplayers.testing.RemoteError) and "Mismatched elements" in reply.message, reply
