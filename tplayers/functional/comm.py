"""The communication calls every tplayers op goes through, with per-rank byte accounting.

Each call records the bytes this rank puts on the wire: exact bytes for point-to-point sends,
and the ring algorithm's cost for collectives ((n-1)/n of the gathered / reduced buffer per
AllGather or ReduceScatter, 2(n-1)/n per AllReduce) — the minimum any algorithm needs — by op
kind and by parallelism axis ("tp", "dp", "pp", "ep": expert-parallel dispatch, "cp": context-
parallel attention). The engines tplayers drives record theirs too:
DDP's buckets through a comm hook, FSDP2's gathers and reduce-scatters through its custom
collectives, the pipeline's sends through the stage (`tplayers.data_parallel`, `tplayers.pipeline`).
`count_bytes()` collects them; `tplayers demo`, the benchmarks and the tests read it.
"""

import contextlib
import math
from collections import Counter

import torch
import torch.distributed as dist

AXES = ("tp", "dp", "pp", "ep", "cp")


class ByteCount(Counter):
    """Bytes this rank sent inside a `count_bytes()` block: by op kind (the Counter's keys:
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send") and by parallelism axis (`by_axis()`)."""

    def __init__(self):
        super().__init__()
        self.axes = Counter()

    def by_axis(self) -> dict[str, int]:
        """{"tp": ..., "dp": ..., "pp": ..., "ep": ..., "cp": ...}: bytes sent over each axis (0 where none)."""
        return {axis: self.axes[axis] for axis in AXES}


_counters: list[ByteCount] = []
# torch >= 2.13 renamed the single-tensor collectives; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextlib.contextmanager
def count_bytes():
    """Count bytes this rank sends inside the block, by op kind and by axis:
    `with count_bytes() as c: ...; c.total(), c["all_reduce"], c.by_axis()["dp"]`."""
    counter = ByteCount()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def _record(kind: str, nbytes: float, axis: str = "tp") -> None:
    for counter in _counters:
        counter[kind] += int(round(nbytes))
        counter.axes[axis] += int(round(nbytes))


def record(kind: str, t: torch.Tensor | int, group, axis: str) -> None:
    """Count a collective an engine runs on `t` (or that many bytes) over `group`: its input for
    an all-reduce or a reduce-scatter, its output for an all-gather, the tensor for a send; as the
    calls here count theirs."""
    n, nbytes = dist.get_world_size(group), t if isinstance(t, int) else _nbytes(t)
    if kind == "send":
        _record(kind, nbytes, axis)
    elif n > 1:
        _record(kind, (2 if kind == "all_reduce" else 1) * (n - 1) / n * nbytes, axis)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Done:
    """The handle for a collective that needed no communication (a group of one)."""

    def wait(self):
        return True


def all_reduce(t, group, *, async_op=False, axis="tp"):
    """Sum `t` in place over `group`."""
    n = dist.get_world_size(group)
    if n == 1:
        return _Done() if async_op else None
    _record("all_reduce", 2 * (n - 1) / n * _nbytes(t), axis)
    return dist.all_reduce(t, group=group, async_op=async_op)


def all_to_all(out, t, splits, group, *, axis="tp"):
    """Send rows `t[sum(splits[:s]) : sum(splits[:s + 1])]` to rank s of `group` and receive as
    many rows from it into the same place of `out` (symmetric splits: ranks exchange equal
    blocks). Counted as the bytes sent to the other ranks."""
    return all_to_all_rows(out, t, splits, splits, group, axis=axis)


def all_to_all_rows(out, t, out_splits, in_splits, group, *, axis="ep"):
    """Send rows `t[sum(in_splits[:s]) : sum(in_splits[:s + 1])]` to rank s of `group`, receiving
    `out_splits[s]` rows from it into `out` in rank order (uneven blocks: expert-parallel
    dispatch). Counted as the rows sent to the other ranks."""
    r = dist.get_rank(group)
    row = t.element_size() * math.prod(t.shape[1:])
    _record("all_to_all", (sum(in_splits) - in_splits[r]) * row, axis)
    if dist.get_world_size(group) == 1:
        out.copy_(t)
        return None
    return dist.all_to_all_single(out, t, list(out_splits), list(in_splits), group=group)


def control_device(group) -> torch.device:
    """Where a small control message for `group` lives: NCCL moves only CUDA tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_into(out, t, group, *, async_op=False, record=True, axis="tp"):
    """Gather `t` from every rank into `out` (n * t.numel() elements, rank-major). record=False:
    not counted (control messages, not the model's data)."""
    n = dist.get_world_size(group)
    if n == 1:
        out.copy_(t.reshape(out.shape))
        return _Done() if async_op else None
    if record:
        _record("all_gather", (n - 1) / n * _nbytes(out), axis)
    # gloo wants the gathered buffer shaped (n * t.shape[0], *t.shape[1:])
    flat_out = out.view(-1, *t.shape[1:])
    return all_gather_single(flat_out, t, group=group, async_op=async_op)


def reduce_scatter_into(out, t, group, *, async_op=False, axis="tp"):
    """Sum `t` (rank-major, n * out.numel() elements) over `group`; this rank's block into `out`."""
    n = dist.get_world_size(group)
    if n == 1:
        out.copy_(t.reshape(out.shape))
        return _Done() if async_op else None
    _record("reduce_scatter", (n - 1) / n * _nbytes(t), axis)
    flat_in = t.view(-1, *out.shape[1:])
    return reduce_scatter_single(out, flat_in, group=group, async_op=async_op)


def exchange(send_buf, group_dst: int, recv_buf, group_src: int, group, *, axis="tp"):
    """Send `send_buf` to rank `group_dst` while receiving `recv_buf` from rank `group_src` (indices
    in `group`); returns the works to wait on. NCCL gets one batched call, so it runs both at
    once (two separate calls could deadlock a two-rank ring where both ranks send first); gloo's
    sends and receives are asynchronous anyway, and two plain calls save the batch's Python
    (15-20 us of a ~170 us ring step on 2 CPU ranks, measured)."""
    _record("send", _nbytes(send_buf), axis)
    if dist.get_backend(group) == "gloo":
        return [
            dist.isend(send_buf, group=group, group_dst=group_dst),
            dist.irecv(recv_buf, group=group, group_src=group_src),
        ]
    ops = [
        dist.P2POp(dist.isend, send_buf, group=group, group_peer=group_dst),
        dist.P2POp(dist.irecv, recv_buf, group=group, group_peer=group_src),
    ]
    return dist.batch_isend_irecv(ops)
