"""overlap="auto": each overlap-engine call takes the ring or the plain path, per op and shape.

The ring (overlap=True) and the plain path (overlap=False) issue different collectives, so every
rank of a group must take the same one or they hang. The first time a group meets an (op, shape,
dtype) each rank gathers every rank's request and proposal with one tiny all-gather and decides
from that table alone, so every rank decides alike (keyed by the shape, so every rank must ask
about the same one: under an uneven split the callers pass the widest rank's, `widest=`, which is
also the GEMM the group waits for); later calls with that shape issue no extra collective.

A rank's proposal is the cost model's (`cost_model.predict`), or the path the group measured
before in this shape's bucket (the costs file keeps them). Where the model is unsure, auto
measures instead of trusting it: the model's two predictions within `MEASURE_MARGIN` of each
other, no calibrated constants for this backend and device (`tplayers bench --calibrate` was
never run here: the built-in defaults come from another machine), or ranks whose proposals differ
(different costs files). Then the next `TRIAL` calls of that shape alternate between the two
paths (after one warm-up call of each; every call gives the result of the path it took, and the
two are exact alternatives); each rank times its calls, the group all-gathers the medians once,
and the path whose slowest rank was faster is fixed on every rank together. The choice is kept
in the costs file (per backend / device / op / shape bucket, written by the group's first rank),
so later runs and other groups start from it; where it contradicts the model a warning says so
once per backend and device, and the record is marked `contradicts_model`.

Forced modes (True / False) never measure; they take part in the first check, so a rank built
with another flag fails at once instead of hanging. Measuring is on by default; off
(`set_overlap_measuring(False)` or TPLAYERS_OVERLAP_MEASURE=0, alike on every rank) auto is the
model's choice alone, the same on every run: for runs that must be bit-reproducible (the ring and
the plain collective sum in different orders). Ranks that disagree with measuring off raise
`OverlapDisagreement` on every rank.

`overlap_choices()` records what each call chose and why (the benchmarks report it).
"""

import contextlib
import functools
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tplayers.functional import comm, cost_model

OVERLAP_MODES = ("auto", True, False)
MEASURE_ENV = "TPLAYERS_OVERLAP_MEASURE"
# The model is unsure where its two predictions are within this factor of each other.
MEASURE_MARGIN = 2.0
# The paths of a trial's calls: one warm-up call of each, then TIMED of each, interleaved (ABBA:
# a drift in the machine's speed falls on both alike).
WARMUP = (True, False)
TIMED = (True, False, False, True, True, False)
TRIAL = WARMUP + TIMED
_REQUEST_CODE = {False: 0, True: 1, "auto": 2}
_REQUEST_NAME = {0: "False", 1: "True", 2: "'auto'"}

_agreed: dict = {}  # (op, m, k, n, side, dtype, group ranks, measuring) -> _Decision, agreed by the group
_trials: dict = {}  # the same keys -> _Trial: shapes being measured
_costs: dict = {}  # (backend, device name) -> OverlapCosts
_measured: dict = {}  # (backend, device name) -> {shape bucket: record}, the costs file's measurements
_warned: set = set()  # (backend, device name) whose model a measurement contradicted
_timing: list = []  # the measured calls in progress: (trial, path, start)
_logs: list = []
_measuring = None  # set_overlap_measuring's flag; None: the environment's


class OverlapDisagreement(RuntimeError):
    """The ranks of a group disagree on the path of one overlap-engine call (they would hang)."""


@dataclass(frozen=True)
class Choice:
    """One call's decision: `shape` is (m, k, n) of the GEMM (see cost_model.predict).

    source: "model" (the cost model's choice), "measuring" (a call of the trial, taking the path
    in turn), "measured" (the group's timing of both), "recorded" (a timing from the costs file)
    or "forced"; measured_*_s: the slowest rank's median per path, where timed."""

    op: str
    shape: tuple
    dtype: str
    requested: object
    overlap: bool
    predicted_ring_s: float
    predicted_plain_s: float
    ranks: tuple = ()  # the group's: a 2-D grid decides per axis, each axis its own group
    source: str = "model"
    measured_ring_s: float | None = None
    measured_plain_s: float | None = None


@dataclass(frozen=True)
class _Decision:
    ring: bool
    source: str
    measured: tuple | None = None  # (ring_s, plain_s)


@dataclass
class _Trial:
    key: tuple
    group: object
    device: torch.device
    bucket: str
    costs_key: tuple
    prediction: tuple
    calls: int = 0
    times: dict = field(default_factory=lambda: {True: [], False: []})


def check_overlap(overlap, where: str):
    """`overlap` if it is one of OVERLAP_MODES, else a ValueError naming `where`."""
    if not (isinstance(overlap, bool) or (isinstance(overlap, str) and overlap == "auto")):
        raise ValueError(f"{where}: overlap must be 'auto', True or False, got {overlap!r}")
    return overlap


def set_overlap_measuring(enabled) -> None:
    """Whether overlap="auto" may time both paths where its model is unsure (module docstring):
    True / False, or None for the environment's TPLAYERS_OVERLAP_MEASURE (default on). Set it alike
    on every rank, before the calls it should govern."""
    global _measuring
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"set_overlap_measuring takes True, False or None, got {enabled!r}")
    _measuring = enabled


def measuring_enabled() -> bool:
    if _measuring is not None:
        return _measuring
    return os.environ.get(MEASURE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _device_key(group, device) -> tuple:
    cuda = device.type == "cuda"
    return dist.get_backend(group), torch.cuda.get_device_name(device) if cuda else "cpu"


def costs_for(group, device) -> cost_model.OverlapCosts:
    """The constants for `group`'s backend on `device`: the costs file's entry, else the default."""
    key = _device_key(group, device)
    if key not in _costs:
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        _costs[key] = cost_model.read_costs(*key) or cost_model.default_costs(*key, capability)
    return _costs[key]


def _measured_for(key) -> dict:
    if key not in _measured:
        _measured[key] = cost_model.read_measured(*key)
    return _measured[key]


def forget_choices() -> None:
    """Drop the cached constants, measurements and choices (after a new calibration). Call it on
    every rank of every group at the same point, like a collective: a rank that forgot would check
    a shape again while the others would not."""
    _costs.clear()
    _agreed.clear()
    _trials.clear()
    _measured.clear()
    _timing.clear()


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
    measuring = overlap == "auto" and measuring_enabled()
    key = (op, m, k, n_out, side, dtype, tuple(dist.get_process_group_ranks(group)), measuring)
    decision, trial, prediction = _agreed.get(key), _trials.get(key), None
    if (decision is None and trial is None) or _logs:
        costs = costs_for(group, like.device)
        prediction = cost_model.predict(op, n, m, k, n_out, dtype, costs, backend=dist.get_backend(group), side=side)
    if decision is None and trial is None:
        decision, trial = _agree(key, overlap, prediction, group, like.device)
    if trial is not None:  # a call of the trial: the next path in turn, timed by `measured_op`
        chosen = TRIAL[trial.calls]
        trial.calls += 1
        if like.device.type == "cuda":
            torch.cuda.synchronize(like.device)
        _timing.append((trial, chosen, _clock(chosen)))
        _log(op, key, dtype, overlap, chosen, prediction, "measuring")
        return chosen
    chosen = decision.ring if overlap == "auto" else bool(overlap)
    _log(op, key, dtype, overlap, chosen, prediction, decision.source if overlap == "auto" else "forced",
         decision.measured)  # fmt: skip
    return chosen


def _log(op, key, dtype, overlap, chosen, prediction, source, measured=None):
    measured = measured or (None, None)
    for log in _logs:
        log.append(Choice(op, key[1:4], dtype, overlap, chosen, *prediction, key[6], source, *measured))


def _clock(path: bool) -> float:
    """Now, in seconds (`path`: the path being timed, for tests that fake each rank's timings)."""
    return time.perf_counter()


def measured_op(fn):
    """Wrap an overlap-engine op: a call that `use_ring` made part of a trial is timed to its end,
    and the trial's last call decides (module docstring)."""

    @functools.wraps(fn)
    def op(*args, **kwargs):
        depth = len(_timing)
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            del _timing[depth:]
            raise
        if len(_timing) > depth:
            trial, path, start = _timing.pop()
            if trial.device.type == "cuda":
                torch.cuda.synchronize(trial.device)
            if trial.calls > len(WARMUP):
                trial.times[path].append(_clock(path) - start)
            if trial.calls == len(TRIAL):
                _decide(trial)
        return out

    return op


def _decide(trial: _Trial) -> None:
    """The trial's end, on every rank of its group at the same call: the slowest rank's median per
    path (one all-gather), the faster path fixed, recorded and kept."""
    mine = torch.tensor([statistics.median(trial.times[True]), statistics.median(trial.times[False])],
                        dtype=torch.float64, device=trial.device)  # fmt: skip
    everyone = mine.new_empty((dist.get_world_size(trial.group), 2))
    comm.all_gather_into(everyone, mine, trial.group, record=False)  # control traffic, once per trial
    ring_s, plain_s = everyone.max(0).values.tolist()
    ring = ring_s < plain_s
    del _trials[trial.key]
    _agreed[trial.key] = _Decision(ring, "measured", (ring_s, plain_s))
    predicted_ring = cost_model.ring_pays(*trial.prediction)
    record = dict(ring=ring, ring_s=ring_s, plain_s=plain_s, predicted_ring_s=trial.prediction[0],
                  predicted_plain_s=trial.prediction[1], contradicts_model=ring != predicted_ring)  # fmt: skip
    _measured_for(trial.costs_key)[trial.bucket] = record
    if dist.get_rank(trial.group) != 0:
        return
    try:
        cost_model.write_measured(*trial.costs_key, trial.bucket, record)
    except OSError as e:  # a read-only home: the choice still holds for this run
        warnings.warn(f"overlap='auto': cannot keep the measured choice in {cost_model.costs_file()} ({e})",
                      stacklevel=3)  # fmt: skip
    if ring != predicted_ring and trial.costs_key not in _warned:
        _warned.add(trial.costs_key)
        op, m, k, n_out = trial.key[:4]
        source = costs_for(trial.group, trial.device).source
        warnings.warn(
            f"overlap='auto' timed {op} at (m, k, n) = ({m}, {k}, {n_out}): the "
            f"{'ring' if ring else 'plain path'} took {1e3 * min(ring_s, plain_s):.3g} ms against "
            f"{1e3 * max(ring_s, plain_s):.3g} ms, where the cost model ({source}) predicted the other; "
            f"measured choices are kept in {cost_model.costs_file()} and used from now on; "
            "`tplayers bench --calibrate` refits the constants for this machine",
            stacklevel=3,
        )


def _proposal(key, overlap, prediction, group, device):
    """(proposed ring, wants to measure, bucket, costs key) of this rank for a new shape."""
    op, m, k, n_out, side, dtype, ranks, measuring = key
    costs_key = _device_key(group, device)
    bucket = cost_model.shape_bucket(op, dtype, len(ranks), m, k, n_out, side)
    if not measuring:
        return cost_model.ring_pays(*prediction), False, bucket, costs_key
    recorded = _measured_for(costs_key).get(bucket)
    if recorded is not None:
        return bool(recorded["ring"]), False, bucket, costs_key
    ring_s, plain_s = prediction
    calibrated = not costs_for(group, device).source.startswith("default")
    unsure = max(ring_s, plain_s) <= MEASURE_MARGIN * min(ring_s, plain_s)
    return cost_model.ring_pays(ring_s, plain_s), unsure or not calibrated, bucket, costs_key


def _agree(key, overlap, prediction, group, device):
    """Gather (request, proposal, the path taken, shape, wants to measure, measuring on) from every
    rank of `group` and decide from that table: (a _Decision, None), (None, a _Trial) where the
    group measures, or an error on every rank where the ranks cannot agree."""
    op, m, k, n_out, side, dtype, ranks, measuring = key
    ring, wants, bucket, costs_key = _proposal(key, overlap, prediction, group, device)
    recorded = measuring and not wants and bucket in _measured_for(costs_key)
    taken = ring if overlap == "auto" else overlap
    mine = [_REQUEST_CODE[overlap], int(ring), int(taken), m, k, n_out, side, int(wants), int(measuring)]
    mine = torch.tensor(mine, dtype=torch.int64, device=device)
    everyone = mine.new_empty((len(ranks), mine.numel()))
    comm.all_gather_into(everyone, mine, group, record=False)  # control traffic, once per shape
    rows = everyone.tolist()
    same = lambda cols: all(row[cols] == rows[0][cols] for row in rows)  # noqa: E731
    if not same(slice(3, 7)) or not same(0) or not same(2) and not (overlap == "auto" and same(8) and rows[0][8]):
        raise OverlapDisagreement(_disagreement(op, dtype, ranks, rows))
    if not same(8):
        raise OverlapDisagreement(
            _disagreement(op, dtype, ranks, rows, f"measuring on some ranks only ({MEASURE_ENV})")
        )
    if overlap == "auto" and measuring and (any(row[7] for row in rows) or not same(1)):
        trial = _Trial(key, group, device, bucket, costs_key, tuple(prediction))
        _trials[key] = trial
        return None, trial
    decision = _Decision(ring, "recorded" if recorded else "model", _recorded_times(costs_key, bucket, recorded))
    _agreed[key] = decision
    return decision, None


def _recorded_times(costs_key, bucket, recorded):
    if not recorded:
        return None
    record = _measured_for(costs_key)[bucket]
    return record.get("ring_s"), record.get("plain_s")


def _disagreement(op, dtype, ranks, rows, why=None) -> str:
    said = "; ".join(
        f"rank {rank}: overlap={_REQUEST_NAME[row[0]]} -> {'ring' if row[2] else 'plain'} for (m, k, n) = "
        f"({row[3]}, {row[4]}, {row[5]})"
        for rank, row in zip(ranks, rows, strict=True)
    )
    return (
        f"{op} ({dtype}): the ranks of group {list(ranks)} disagree on the overlap path ({said})"
        + (f": {why}" if why else "")
        + ". The ring and the plain path issue different collectives, so they would hang: build every rank's layers "
        f"with the same overlap= and give every machine the same overlap costs file ({cost_model.costs_file()}, "
        f"env {cost_model.COSTS_ENV}), or none, and the same {MEASURE_ENV}."
    )
