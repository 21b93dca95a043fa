"""overlap="auto": each overlap-engine call takes the ring or the plain path, per op and shape.

The ring (overlap=True) and the plain path (overlap=False) issue different collectives, so every
rank of a group must take the same one or they hang. The choice is the cost model's
(`cost_model.predict`) on what every rank knows alike: the op, the GEMM's global shape, the
dtype, the group size and the backend. The first time a group meets an (op, shape, dtype) each
rank gathers every rank's request and choice with one tiny all-gather, raises
`OverlapDisagreement` on every rank if they differ (layers built with different `overlap=`, or
different costs files on different machines), and caches the agreed choice (keyed by the shape,
so every rank must ask about the same one: under an uneven split the callers pass the widest
rank's, `widest=`, which is also the GEMM the group waits for); later calls with that shape
issue no extra collective. Forced modes (True / False) take part in that first check, so a rank
built with another flag fails at once instead of hanging.

`overlap_choices()` records what each call chose (the benchmarks report it).
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tplayers.functional import comm, cost_model

OVERLAP_MODES = ("auto", True, False)
_REQUEST_CODE = {False: 0, True: 1, "auto": 2}
_REQUEST_NAME = {0: "False", 1: "True", 2: "'auto'"}

_agreed: dict = {}  # (op, m, k, n, side, dtype, group ranks) -> the cost model's choice, agreed by the group
_costs: dict = {}  # (backend, device name) -> OverlapCosts
_logs: list = []


class OverlapDisagreement(RuntimeError):
    """The ranks of a group disagree on the path of one overlap-engine call (they would hang)."""


@dataclass(frozen=True)
class Choice:
    """One call's decision: `shape` is (m, k, n) of the GEMM (see cost_model.predict)."""

    op: str
    shape: tuple
    dtype: str
    requested: object
    overlap: bool
    predicted_ring_s: float
    predicted_plain_s: float
    ranks: tuple = ()  # the group's: a 2-D grid decides per axis, each axis its own group


def check_overlap(overlap, where: str):
    """`overlap` if it is one of OVERLAP_MODES, else a ValueError naming `where`."""
    if not (isinstance(overlap, bool) or (isinstance(overlap, str) and overlap == "auto")):
        raise ValueError(f"{where}: overlap must be 'auto', True or False, got {overlap!r}")
    return overlap


def costs_for(group, device) -> cost_model.OverlapCosts:
    """The constants for `group`'s backend on `device`: the costs file's entry, else the default."""
    backend = dist.get_backend(group)
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    key = (backend, name)
    if key not in _costs:
        capability = torch.cuda.get_device_capability(device) if cuda else None
        _costs[key] = cost_model.read_costs(backend, name) or cost_model.default_costs(backend, name, capability)
    return _costs[key]


def forget_choices() -> None:
    """Drop the cached constants and choices (after a new calibration). Call it on every rank of
    every group at the same point, like a collective: a rank that forgot would check a shape
    again while the others would not."""
    _costs.clear()
    _agreed.clear()


@contextlib.contextmanager
def overlap_choices():
    """Record every overlap-engine call's `Choice` inside the block: `with overlap_choices() as c:`."""
    log = []
    _logs.append(log)
    try:
        yield log
    finally:
        _logs.remove(log)


def use_ring(op, overlap, group, like, m, k, n_out, side=0) -> bool:
    """Whether `op` (on a GEMM of m rows, k inner, n_out columns, dtype of `like`) takes the ring."""
    n = dist.get_world_size(group)
    if n == 1:
        return False
    dtype = str(like.dtype).removeprefix("torch.")
    key = (op, m, k, n_out, side, dtype, tuple(dist.get_process_group_ranks(group)))
    agreed = _agreed.get(key)
    prediction = None
    if agreed is None or _logs:
        costs = costs_for(group, like.device)
        prediction = cost_model.predict(op, n, m, k, n_out, dtype, costs, backend=dist.get_backend(group), side=side)
    if agreed is None:
        agreed = _agree(key, overlap, cost_model.ring_pays(*prediction), group, like.device)
    chosen = agreed if overlap == "auto" else bool(overlap)
    for log in _logs:
        log.append(Choice(op, (m, k, n_out), dtype, overlap, chosen, *prediction, key[-1]))
    return chosen


def _agree(key, overlap, ring: bool, group, device) -> bool:
    """Gather (request, the model's choice, the path taken, shape) from every rank of `group`:
    the model's choice, or an error on every rank where anything differs."""
    op, m, k, n_out, side, dtype, ranks = key
    taken = ring if overlap == "auto" else overlap
    mine = [_REQUEST_CODE[overlap], int(ring), int(taken), m, k, n_out, side]
    mine = torch.tensor(mine, dtype=torch.int64, device=device)
    everyone = mine.new_empty((len(ranks), mine.numel()))
    comm.all_gather_into(everyone, mine, group, record=False)  # control traffic, once per shape
    if not bool((everyone == mine).all()):
        raise OverlapDisagreement(_disagreement(op, dtype, ranks, everyone.tolist()))
    _agreed[key] = ring
    return ring


def _disagreement(op, dtype, ranks, rows) -> str:
    said = "; ".join(
        f"rank {rank}: overlap={_REQUEST_NAME[req]} -> {'ring' if taken else 'plain'} for (m, k, n) = ({m}, {k}, {n})"
        for rank, (req, _, taken, m, k, n, _) in zip(ranks, rows, strict=True)
    )
    return (
        f"{op} ({dtype}): the ranks of group {list(ranks)} disagree on the overlap path ({said}). The ring and "
        "the plain path issue different collectives, so they would hang: build every rank's layers with the "
        f"same overlap= and give every machine the same overlap costs file ({cost_model.costs_file()}, "
        f"env {cost_model.COSTS_ENV}), or none."
    )
