"""Tools for property-testing tensor-parallel numerics against an unsharded reference. One
call, `check_parallel`, proves a user's parallel model equal to its unsharded self over
layouts; the parts it is built from serve hand-written checks. tplayers' own suite uses both.

    check.py       check_parallel(build, parallelize, inputs, layouts=...): every output, loss,
                   gradient and parameter after each step, through the placement record
    strategies.py  hypothesis strategies: layouts, shapes, dtypes, integer-valued tensors
    plugin.py      the pytest plugin: session pool fixture `tplayers_pool`, marker, profiles
    pool.py        WorkerPool: local gloo ranks started once and reused, failing ranks' tracebacks
                   shown, hung ranks' stacks dumped at a deadline
    meshes.py      layout_mesh: a ("dp", "pp", "tp") DeviceMesh over the first ranks of a pool
    numerics.py    TOLERANCES (one per-dtype table), assert_close (or_rounding), assert_shard_close, shard_of
    outputs.py     logits_of: the logits of a forward that computed its loss without them
    memory.py      peak_bytes: the peak of host memory in use (glibc), for CPU memory tests
    shards.py      expected_shards / differing_grads: a parallelized HF model's parameters or gradients
                   against an unsharded reference rank by rank, with no collective (its load path)
    hooks.py       hooks_holding_state: module hooks whose closures hold a module or tensor (which
                   a deep copy of the model would leave reading the original's)
    ops.py         count_ops: the ops a block runs (kernel launches, host syncs), through the dispatcher
    tiny.py        tiny_config: any transformers model type's config with every size field shrunk;
                   published_config: its published widths with only the depth cut

A user-facing top layer: may import anything in tplayers; nothing in tplayers imports it.
"""

from tplayers.testing.check import ParallelMismatch, check_parallel, default_loss
from tplayers.testing.hooks import hooks_holding_state
from tplayers.testing.meshes import layout_mesh
from tplayers.testing.numerics import (
    TOLERANCES,
    assert_close,
    assert_close_or_rounding,
    assert_shard_close,
    examples,
    integer_valued,
    kernel_device,
    kernel_generator,
    shard_of,
    tolerance,
)
from tplayers.testing.outputs import logits_of
from tplayers.testing.pool import RemoteError, WorkerPool
from tplayers.testing.shards import differing_grads, expected_shards, grads_as_state_dict
from tplayers.testing.tiny import published_config, tiny_config

__all__ = [
    "ParallelMismatch",
    "check_parallel",
    "default_loss",
    "differing_grads",
    "expected_shards",
    "grads_as_state_dict",
    "hooks_holding_state",
    "layout_mesh",
    "TOLERANCES",
    "RemoteError",
    "WorkerPool",
    "assert_close",
    "assert_close_or_rounding",
    "assert_shard_close",
    "examples",
    "kernel_device",
    "kernel_generator",
    "logits_of",
    "integer_valued",
    "shard_of",
    "published_config",
    "tiny_config",
    "tolerance",
]
