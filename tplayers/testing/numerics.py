"""The one tolerance table and the comparison helpers built on `torch.testing.assert_close`.

Tolerances are per dtype of the reference. They cover a different summation order (a
reduction split over ranks, a chunked GEMM) and the rounding of every intermediate tensor
to the dtype: the reference and the sharded layers round at the same places but may land
one unit in the last place apart, and a gradient that sums many such terms with
cancellation carries those units into its absolute error. For fp16 / bf16 the absolute
tolerance is therefore about six units in the last place at 1.0 (seen: 4 at bf16 in a
gradient summing 12 terms); relative tolerances stay at a few units. Where nothing is reduced across ranks, compare with
exact=True; integer-valued inputs (`integer_valued`) make every sum exact in any order, so
even reduced paths can be compared exactly.
"""

import os

import torch

from tplayers.tolerances import ARBITER_FACTOR, TOLERANCES, tolerance  # noqa: F401  (the one table, re-exported)


def assert_close(actual, expected, *, exact=False, msg=None):
    """assert_close with the table's tolerance for `expected`'s dtype (or bit equality)."""
    torch.testing.assert_close(actual, expected, **tolerance(expected.dtype, exact=exact), msg=msg)


def assert_close_or_rounding(actual, expected, truth, *, msg=None):
    """assert_close; where `actual` is past the table from `expected` (the unsharded fp32 result),
    `actual` within ARBITER_FACTOR as far from `truth` (the unsharded model's fp64 result) as
    `expected` is: fp32 rounding the model amplifies, judged as the self-check's fp64 arbiter judges it."""
    try:
        assert_close(actual, expected, msg=msg)
    except AssertionError as e:
        ours = (actual.double() - truth).abs().max().item()
        own = (expected.double() - truth).abs().max().item()
        if ours > ARBITER_FACTOR * own:
            raise AssertionError(
                f"{e}\n{ours:.3g} from the fp64 result, where the unsharded one is {own:.3g}"
            ) from None


def shard_of(full, dim: int, rank: int, num_shards: int, unit: int = 1, sizes=None):
    """Rank `rank`'s contiguous slice of `full` along `dim` (the layout of every tplayers shard:
    uneven sizes as torch.chunk splits them, or the explicit per-rank `sizes` a layer was given),
    in whole units of `unit` (attention heads split by head_dim). Computed with torch.chunk /
    torch.split themselves, not with the library's `shard_sizes`: a reference the library's own
    split cannot move (an off-by-one there must fail the tests, not shift both sides alike)."""
    units = torch.arange(full.shape[dim] // unit)
    parts = torch.chunk(units, num_shards) if sizes is None else torch.split(units, [int(s) for s in sizes])
    mine = parts[rank] if rank < len(parts) else units[:0]  # torch.chunk leaves the last ranks none
    start = int(mine[0]) if mine.numel() else 0
    return full.narrow(dim, start * unit, mine.numel() * unit)


def assert_shard_close(local, full, *, dim, rank, num_shards, exact=False, msg=None, unit=1, sizes=None):
    """`local` equals rank `rank`'s slice of the unsharded `full` along `dim` (dim=None: all of it)."""
    expected = full if dim is None else shard_of(full, dim, rank, num_shards, unit, sizes)
    assert_close(local, expected, exact=exact, msg=msg)


def integer_valued(shape, dtype=torch.float32, *, low=-3, high=4, generator=None):
    """Random small integers as floats. Sums of their products stay exact, in any order, while
    they stay below 2**24 in fp32 (2**11 in fp16, 2**8 in bf16): use fp32 for exact checks."""
    return torch.randint(low, high, shape, generator=generator).to(dtype)


def kernel_device() -> str:
    """Where the suite's `kernel` tests (one process, a Triton kernel against its reference) run:
    env TPLAYERS_TEST_DEVICE, "cpu" by default (Triton's interpreter), or a GPU ("cuda", as
    `tplayers bench --kernels` runs them on one)."""
    return os.environ.get("TPLAYERS_TEST_DEVICE", "cpu")


def kernel_generator(seed: int) -> torch.Generator:
    """A seeded generator on the device the tensors are made on (the suite's default device)."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def examples(n: int) -> int:
    """`n` hypothesis examples, times env TPLAYERS_EXAMPLES_SCALE (default 1) for longer runs."""
    return n * int(os.environ.get("TPLAYERS_EXAMPLES_SCALE", "1"))
