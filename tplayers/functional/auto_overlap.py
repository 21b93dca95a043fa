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
(different costs files). Then the next calls of that shape alternate between the two paths (one
warm-up call of each, then rounds of ten; every call gives the result of the path it took, and
the two are exact alternatives): the ranks start each timed call together and time it, and at a
round's end the group all-gathers the timings (each call as long as its slowest rank). Where one
path was faster in most pairs of calls and on average (`measured_faster`) it is fixed on every
rank together; else another round, and after `MAX_ROUNDS` the lower mean, unless the means are
within `EVEN` of each other: then the paths are even within what timing can tell and the model's
choice stands (the lower mean where ranks proposed different paths). The choice is kept in the
costs file (per backend / device / op / shape bucket, written by the group's first rank), so
later runs and other groups start from it; where the timing contradicts the model a warning says
so once per backend and device, and the record is marked `contradicts_model`.

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
# The paths of a trial's calls: one warm-up call of each, then rounds of TIMED, five calls of
# each path interleaved (ABBA: a drift in the machine's speed falls on both alike).
WARMUP = (True, False)
TIMED = (True, False, False, True, True, False, False, True, True, False)
TRIAL = WARMUP + TIMED  # the shortest trial: one round
# A round is decisive where one path was faster in at least SURE of the (ring call, plain call)
# pairs and on average too; else another round (gloo's point-to-point times on a busy 2-core
# machine swing 5x between calls), up to MAX_ROUNDS. Then the lower mean decides, unless the two
# means are within EVEN of each other: the paths are even within what timing can tell, and the
# model's choice stands.
SURE = 0.75
MAX_ROUNDS = 3
EVEN = 1.05
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
    prediction: tuple  # this rank's model's (ring s, plain s)
    agreed_proposal: bool | None  # the path every rank proposed, None where they differed
    calls: int = 0
    times: list = field(default_factory=list)  # this rank's, per timed call of the round (TIMED)
    slowest: dict = field(default_factory=lambda: {True: [], False: []})  # per path, each call's slowest rank

    def path(self) -> bool:
        """The path of the trial's next call."""
        if self.calls < len(WARMUP):
            return WARMUP[self.calls]
        return TIMED[(self.calls - len(WARMUP)) % len(TIMED)]


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
        chosen = trial.path()
        trial.calls += 1
        _line_up(group, like.device)
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


def _line_up(group, device) -> None:
    """Start a timed call on every rank of `group` together (a one-number all-gather, then the
    device idle): otherwise a rank that arrives early times its wait for the others, which is
    noise of the step before, not a cost of the path."""
    token = torch.zeros(1, device=comm.control_device(group))
    comm.all_gather_into(token.new_empty(dist.get_world_size(group)), token, group, record=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
                trial.times.append(_clock(path) - start)
            if len(trial.times) == len(TIMED):
                _end_round(trial)
        return out

    return op


def trials_in_progress() -> int:
    """How many shapes this process is measuring now (their next calls alternate the paths)."""
    return len(_trials)


def _end_round(trial: _Trial) -> None:
    """A round's end, on every rank of its group at the same call: every rank's timings (one
    all-gather), each call as long as its slowest rank (the ranks started it together); decided
    where the round (with those before) is sure (SURE), else another round, up to MAX_ROUNDS."""
    mine = torch.tensor(trial.times, dtype=torch.float64, device=comm.control_device(trial.group))
    everyone = mine.new_empty((dist.get_world_size(trial.group), len(TIMED)))
    comm.all_gather_into(everyone, mine, trial.group, record=False)  # control traffic, once per round
    trial.times.clear()
    for t, path in zip(everyone.max(0).values.tolist(), TIMED, strict=True):
        trial.slowest[path].append(t)
    ring, sure = measured_faster(trial.slowest[True], trial.slowest[False])
    if sure or len(trial.slowest[True]) >= MAX_ROUNDS * TIMED.count(True):
        means = statistics.fmean(trial.slowest[True]), statistics.fmean(trial.slowest[False])
        timed = sure or max(means) > EVEN * min(means)
        # Even: the model's choice where every rank proposed it, else the lower mean (every rank
        # computes the same one from the gathered timings).
        _decide(trial, ring if timed or trial.agreed_proposal is None else trial.agreed_proposal, sure, timed, means)


def measured_faster(ring_times, plain_times) -> tuple[bool, bool]:
    """(whether the ring is faster, whether the timings are sure of it): sure where one path was
    faster in at least SURE of the (ring, plain) pairs and its mean is lower too (a rare long call
    counts in the mean, which is what a training run pays)."""
    pairs = [(a, b) for a in ring_times for b in plain_times]
    ring_share = sum(a < b for a, b in pairs) / len(pairs)
    ring_mean, plain_mean = statistics.fmean(ring_times), statistics.fmean(plain_times)
    if ring_share >= SURE and ring_mean < plain_mean:
        return True, True
    if 1 - ring_share >= SURE and plain_mean < ring_mean:
        return False, True
    return ring_mean < plain_mean, False


def _decide(trial: _Trial, ring: bool, sure: bool, timed: bool, means: tuple) -> None:
    """Fix `ring` on every rank (each decides alike from the same gathered timings), record and
    keep it: the path the timings chose (`timed`: sure of it, or the lower mean after every
    round), or the model's where the paths were even; `means`: (ring s, plain s) per call."""
    ring_s, plain_s = means
    del _trials[trial.key]
    _agreed[trial.key] = _Decision(ring, "measured", (ring_s, plain_s))
    predicted_ring = cost_model.ring_pays(*trial.prediction)
    calls = len(WARMUP) + len(trial.slowest[True]) + len(trial.slowest[False])
    record = dict(ring=ring, ring_s=ring_s, plain_s=plain_s, sure=sure, calls=calls,
                  predicted_ring_s=trial.prediction[0], predicted_plain_s=trial.prediction[1],
                  contradicts_model=timed and ring != predicted_ring)  # fmt: skip
    _measured_for(trial.costs_key)[trial.bucket] = record
    if dist.get_rank(trial.group) != 0:
        return
    try:
        cost_model.write_measured(*trial.costs_key, trial.bucket, record)
    except OSError as e:  # a read-only home: the choice still holds for this run
        warnings.warn(f"overlap='auto': cannot keep the measured choice in {cost_model.costs_file()} ({e})",
                      stacklevel=3)  # fmt: skip
    if record["contradicts_model"] and trial.costs_key not in _warned:
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
        trial = _Trial(key, group, device, bucket, costs_key, tuple(prediction), bool(rows[0][1]) if same(1) else None)
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
