"""Tools for property-testing tensor-parallel numerics against an unsharded reference:
a reusable pool of local gloo ranks, one per-dtype tolerance table and shard-aware
comparison helpers. tplayers' own test suite is built on them."""

from tplayers.testing.numerics import (
    TOLERANCES,
    assert_close,
    assert_shard_close,
    examples,
    integer_valued,
    shard_of,
    tolerance,
)
from tplayers.testing.pool import RemoteError, WorkerPool

__all__ = [
    "TOLERANCES",
    "RemoteError",
    "WorkerPool",
    "assert_close",
    "assert_shard_close",
    "examples",
    "integer_valued",
    "shard_of",
    "tolerance",
]
