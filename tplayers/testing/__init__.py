"""Tools for property-testing tensor-parallel numerics against an unsharded reference:
a reusable pool of local gloo ranks, one per-dtype tolerance table and shard-aware
comparison helpers. tplayers' own test suite is built on them.

    pool.py      WorkerPool: local gloo ranks started once and reused, failing ranks' tracebacks shown
    numerics.py  TOLERANCES (one per-dtype table), assert_close, assert_shard_close, shard_of

A user-facing top layer: may import anything in tplayers; nothing in tplayers imports it.
"""

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
