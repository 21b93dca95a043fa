"""overlap="auto" that measures where its model is unsure (tplayers.functional.auto_overlap): ranks
whose timings disagree still take one path together, a measured choice overrides a costs file
that favours the wrong path and is kept for the next run, forced modes never measure, measuring
off is the model's choice alone. Each rank's timings are faked (`auto_overlap._clock`), so what
the group decides is known in advance; the calls themselves run for real, on integer values that
every path sums exactly."""

import contextlib
import dataclasses
import json
import os

import pytest
import torch

from tplayers.functional import auto_overlap, cost_model, overlap_choices
from tplayers.functional.cost_model import GLOO_CPU, predict
from tplayers.functional.overlap import matmul_all_reduce
from tplayers.testing import integer_valued

pytestmark = pytest.mark.multirank

SHAPE = (24, 8, 8)  # matmul_all_reduce's (m, k, n) here
# Calibrated-looking constants (not a default) under which the ring is predicted faster by a little:
# inside the margin where auto measures instead of trusting the model.
RING_BY_A_LITTLE = dataclasses.replace(GLOO_CPU, p2p_latency_s=1.5e-4, source="test: the ring by a little")
# Constants under which the ring is predicted far faster: the model is sure, auto does not measure.
RING_SURE = dataclasses.replace(GLOO_CPU, p2p_latency_s=0.0, p2p_bytes_per_s=1e30,
                                hidden=dict.fromkeys(cost_model.OPS, 1.0), source="test: the ring, surely")  # fmt: skip


def test_the_constants_here_are_what_the_tests_say():
    ring, plain = predict("matmul_all_reduce", 2, *SHAPE, "float32", RING_BY_A_LITTLE, backend="gloo")
    assert cost_model.ring_pays(ring, plain) and plain <= auto_overlap.MEASURE_MARGIN * ring
    ring, plain = predict("matmul_all_reduce", 2, *SHAPE, "float32", RING_SURE, backend="gloo")
    assert plain > auto_overlap.MEASURE_MARGIN * ring


def _fake_clock(seconds):
    """A clock under which a call of the ring takes seconds[True], of the plain path seconds[False]
    (a number, or a list its calls take in turn): `_clock` is read at a measured call's start and
    at its end."""
    state = {"now": 0.0, "reads": 0, True: 0, False: 0}

    def clock(path):
        state["reads"] += 1
        if state["reads"] % 2 == 0:
            took = seconds[path]
            if isinstance(took, list):
                took, state[path] = took[state[path] % len(took)], state[path] + 1
            state["now"] += took
        return state["now"]

    return clock


@contextlib.contextmanager
def fresh_state(costs_file, measuring=True, costs=None):
    """Inside: nothing cached, the costs file `costs_file`, measuring as asked, and `costs` (None:
    the defaults) as every rank's constants; after: as before (the pool's worker goes on to other
    tests)."""
    saved_file = os.environ.get(cost_model.COSTS_ENV)
    os.environ[cost_model.COSTS_ENV] = costs_file
    auto_overlap.forget_choices()
    if costs is not None:
        auto_overlap._costs[("gloo", "cpu")] = costs
    auto_overlap.set_overlap_measuring(measuring)
    try:
        yield
    finally:
        auto_overlap.set_overlap_measuring(None)
        auto_overlap.forget_choices()
        if saved_file is None:
            del os.environ[cost_model.COSTS_ENV]
        else:
            os.environ[cost_model.COSTS_ENV] = saved_file


def _ns(seconds):
    """Seconds to the nanosecond (the fake clocks' sums round in the last bits), None as None."""
    return None if seconds is None else round(seconds, 9)


CALLS = len(auto_overlap.TRIAL) + 2  # a trial of one round and two calls after it
LONGEST_TRIAL = len(auto_overlap.WARMUP) + auto_overlap.MAX_ROUNDS * len(auto_overlap.TIMED)


def calls(rank, tp, group, costs, seconds, costs_file, n_calls=CALLS, overlap="auto", measuring=True):
    """`n_calls` calls of matmul_all_reduce at SHAPE under `costs` (None: the defaults) with this
    rank's faked timings `seconds[rank]`: [(source, ring taken, measured ring s, measured plain s)]
    per call; every call's result is the same (integer values)."""
    original = auto_overlap._clock
    if seconds:
        auto_overlap._clock = seconds[rank] if callable(seconds[rank]) else _fake_clock(seconds[rank])
    try:
        with fresh_state(costs_file, measuring, costs):
            m, k, n = SHAPE
            x = integer_valued((m, k), generator=torch.Generator().manual_seed(rank))
            w = integer_valued((n, k), generator=torch.Generator().manual_seed(7))
            with overlap_choices() as log:
                results = [matmul_all_reduce(x, w, group, overlap=overlap) for _ in range(n_calls)]
            assert all(torch.equal(y, results[0]) for y in results), "a measuring call changed the result"
            return [(c.source, c.overlap, _ns(c.measured_ring_s), _ns(c.measured_plain_s)) for c in log]
    finally:  # the pool's worker goes on to other tests
        auto_overlap._clock = original


def test_ranks_whose_timings_disagree_take_one_path_together(pool, tmp_path):
    """Rank 0 times the ring faster (1 ms against 3), rank 1 the plain path (5 ms against 2): the
    step waits for its slowest rank, so the group compares 5 ms (ring) with 3 ms (plain) and both
    ranks take the plain path, after the trial's calls alternated the paths on both alike."""
    seconds = [{True: 1e-3, False: 3e-3}, {True: 5e-3, False: 2e-3}]
    logs = pool.run(calls, 2, None, seconds, str(tmp_path / "costs.json"))  # the defaults: measured
    assert logs[0] == logs[1]
    trial = len(auto_overlap.TRIAL)
    assert [(source, ring) for source, ring, *_ in logs[0][:trial]] == [("measuring", p) for p in auto_overlap.TRIAL]
    assert logs[0][trial:] == [("measured", False, 5e-3, 3e-3)] * (CALLS - trial)


def test_a_measured_choice_overrides_a_costs_file_favouring_the_wrong_path(pool, tmp_path):
    """The file's constants favour the ring by a little (inside the margin) where the plain path is
    faster on every rank: the group measures, takes the plain path, keeps the choice in the file
    (marked as contradicting the model), and the next run (a new process: nothing cached) takes it
    from the file without measuring."""
    path = str(tmp_path / "costs.json")
    seconds = [{True: 4e-3, False: 1e-3}] * 2
    logs = pool.run(calls, 2, RING_BY_A_LITTLE, seconds, path)
    assert logs[0][-1][:2] == ("measured", False)
    kept = json.loads(open(path).read())["measured/gloo/cpu"]
    (bucket, record), *others = kept.items()
    assert not others and bucket == cost_model.shape_bucket("matmul_all_reduce", "float32", 2, *SHAPE)
    assert record["ring"] is False and record["contradicts_model"] is True
    assert (_ns(record["ring_s"]), _ns(record["plain_s"])) == (4e-3, 1e-3)
    again = pool.run(calls, 2, RING_BY_A_LITTLE, None, path, 3)  # no clock faked: no call is timed
    assert again[0] == again[1] == [("recorded", False, 4e-3, 1e-3)] * 3


def test_where_the_model_is_sure_and_calibrated_it_is_trusted(pool, tmp_path):
    logs = pool.run(calls, 2, RING_SURE, [{True: 9.0, False: 1e-3}] * 2, str(tmp_path / "costs.json"), 3)
    assert logs[0] == [("model", True, None, None)] * 3
    assert not (tmp_path / "costs.json").exists()


def _no_clock(path):
    raise AssertionError("a forced call was timed")


@pytest.mark.parametrize("forced", [True, False])
def test_forced_modes_never_measure(pool, tmp_path, forced):
    """Under the defaults (where auto would measure) a forced mode takes its path, reads no clock."""
    logs = pool.run(calls, 2, None, [_no_clock] * 2, str(tmp_path / "costs.json"), CALLS, forced)
    assert logs[0] == logs[1] == [("forced", forced, None, None)] * CALLS
    assert not (tmp_path / "costs.json").exists()


def test_measuring_off_is_the_models_choice_alone(pool, tmp_path):
    """set_overlap_measuring(False): the defaults' prediction on every call, no clock, no file."""
    logs = pool.run(calls, 2, RING_BY_A_LITTLE, None, str(tmp_path / "costs.json"), CALLS, "auto", False)
    assert logs[0] == logs[1] == [("model", True, None, None)] * CALLS
    assert not (tmp_path / "costs.json").exists()


def costs_files_that_disagree(rank, tp, group, path):
    """Rank 0 read constants under which the ring wins for sure, rank 1 the defaults under which
    it does not at this shape: with measuring on, the group measures instead of failing."""
    seconds = [{True: 1e-3, False: 2e-3}] * 2
    return calls(rank, tp, group, RING_SURE if rank == 0 else None, seconds, path)


def test_costs_files_that_disagree_are_settled_by_measuring(pool, tmp_path):
    logs = pool.run(costs_files_that_disagree, 2, str(tmp_path / "costs.json"))
    assert logs[0] == logs[1] and logs[0][-1] == ("measured", True, 1e-3, 2e-3)


def test_a_measurement_that_contradicts_the_model_warns_once(pool, tmp_path):
    """The group's first rank warns, naming the shape, both times and the calibration command."""
    replies = pool.run(warned, 2, str(tmp_path / "costs.json"))
    assert len(replies[0]) == 1 and replies[1] == []
    assert "timed matmul_all_reduce at (m, k, n) = (24, 8, 8): the plain path took 1 ms against 4 ms" in replies[0][0]
    assert "tplayers bench --calibrate" in replies[0][0]


def warned(rank, tp, group, path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto_overlap._warned.clear()
        calls(rank, tp, group, RING_BY_A_LITTLE, [{True: 4e-3, False: 1e-3}] * 2, path, 2 * CALLS)
    return [str(w.message) for w in caught if "overlap='auto' timed" in str(w.message)]


def test_paths_even_within_the_timing_keep_the_models_choice(pool, tmp_path):
    """Both paths take 2 ms (a binary fraction: the fake clock's sums stay exact) on every call: no
    round is sure, so the trial runs MAX_ROUNDS rounds and the model's choice (the ring, by a
    little) stands, recorded as not sure and not as a contradiction."""
    path, two_ms = str(tmp_path / "costs.json"), 2.0**-9
    logs = pool.run(calls, 2, RING_BY_A_LITTLE, [{True: two_ms, False: two_ms}] * 2, path, LONGEST_TRIAL + 2)
    assert logs[0] == logs[1]
    assert [source for source, *_ in logs[0][:LONGEST_TRIAL]] == ["measuring"] * LONGEST_TRIAL
    assert logs[0][LONGEST_TRIAL:] == [("measured", True, _ns(two_ms), _ns(two_ms))] * 2
    (record,) = json.loads(open(path).read())["measured/gloo/cpu"].values()
    assert record["sure"] is False and record["contradicts_model"] is False and record["calls"] == LONGEST_TRIAL


def test_after_every_round_unsure_the_lower_mean_decides(pool, tmp_path):
    """The ring's calls take 1 ms but every fifth 40 ms, the plain path's 3 ms: the ring is faster
    in 4/5 of the pairs but slower on average, so no round is sure; after MAX_ROUNDS the lower
    mean (the plain path) overrides the model (the ring, by a little), and that contradiction is
    recorded."""
    path, ms = str(tmp_path / "costs.json"), 2.0**-10  # binary fractions: the sums stay exact
    seconds = [{True: [ms, ms, ms, ms, 40 * ms], False: 3 * ms}] * 2
    logs = pool.run(calls, 2, RING_BY_A_LITTLE, seconds, path, LONGEST_TRIAL + 2)
    assert logs[0] == logs[1]
    assert [source for source, *_ in logs[0][:LONGEST_TRIAL]] == ["measuring"] * LONGEST_TRIAL
    assert logs[0][LONGEST_TRIAL:] == [("measured", False, _ns(44 * ms / 5), _ns(3 * ms))] * 2
    (record,) = json.loads(open(path).read())["measured/gloo/cpu"].values()
    assert record["sure"] is False and record["contradicts_model"] is True


@pytest.mark.parametrize(
    ("ring", "plain", "expected"),
    [
        ([1, 1, 2, 1, 1], [3, 3, 3, 4, 3], (True, True)),
        ([3, 3, 3, 4, 3], [1, 1, 2, 1, 1], (False, True)),
        # faster in most pairs, but one long call makes it slower on average: not sure
        ([1, 1, 1, 1, 40], [3, 3, 3, 3, 3], (False, False)),
        ([1, 3, 2, 3, 1], [2, 1, 3, 1, 3], (False, False)),  # even
    ],
)
def test_measured_faster_is_sure_only_of_a_clear_difference(ring, plain, expected):
    assert auto_overlap.measured_faster(ring, plain) == expected


def test_set_overlap_measuring_checks_its_flag():
    with pytest.raises(ValueError, match="takes True, False or None"):
        auto_overlap.set_overlap_measuring("yes")


def block_calls_measuring(rank, tp, group, costs_file, sp, n_calls):
    """A Column -> GeLU -> Row block (random fp32 values, so the ring and the plain path differ in
    their last bits) called `n_calls` times forward and backward on fresh inputs with measuring on
    from a fresh costs file, against the unsharded block on every call: output, input gradient and
    every parameter gradient within the tolerance table, through the trial's alternating calls and
    after the group fixed its choice. Returns every call's (op, source, path)."""
    from torch import nn

    import tplayers
    from tplayers.testing import assert_close, assert_shard_close

    with fresh_state(costs_file):
        torch.manual_seed(0)
        hidden, ffn, seq = 16, 24, 4 * tp
        ref = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
        col = tplayers.ColumnParallelLinear.from_linear(ref[0], group=group, sequence_parallel=sp)
        row = tplayers.RowParallelLinear.from_linear(ref[2], group=group, sequence_parallel=sp)
        sharded = ((col.weight, ref[0].weight, 0), (col.bias, ref[0].bias, 0), (row.weight, ref[2].weight, 1))
        seq_dim = 1 if sp else None
        log = []
        for call in range(n_calls):
            x = torch.randn(2, seq, hidden, generator=torch.Generator().manual_seed(call), requires_grad=True)
            dy = torch.randn(2, seq, hidden, generator=torch.Generator().manual_seed(1000 + call))
            local_x = (x.chunk(tp, 1)[rank] if sp else x).detach().clone().requires_grad_()
            with overlap_choices() as choices:
                y = row(torch.nn.functional.gelu(col(local_x)))
                y.backward(dy.chunk(tp, 1)[rank] if sp else dy)
            log += [(c.op, c.source, c.overlap) for c in choices]
            ref_y = ref(x)
            ref_y.backward(dy)
            where = lambda what, call=call: lambda m: f"{what} at call {call}: {m}"  # noqa: E731
            assert_shard_close(y, ref_y.detach(), dim=seq_dim, rank=rank, num_shards=tp, msg=where("output"))
            assert_shard_close(local_x.grad, x.grad, dim=seq_dim, rank=rank, num_shards=tp, msg=where("input grad"))
            for mine, full, dim in sharded:
                assert_shard_close(mine.grad, full.grad, dim=dim, rank=rank, num_shards=tp, msg=where("grad"))
            assert_close(row.bias.grad, ref[2].bias.grad, msg=where("row bias grad"))
            for p in (*col.parameters(), *row.parameters(), *ref.parameters()):
                p.grad = None
        return log


@pytest.mark.parametrize(("tp", "sp"), [(2, True), (3, False)], ids=["tp2+sp", "tp3"])
def test_calls_while_measuring_match_the_unsharded_block(pool, tmp_path, tp, sp):
    """The default path end to end: under the built-in (uncalibrated here) constants every op's
    shape is measured on its first calls, every call equals the unsharded block throughout, every
    rank logs the same calls, and each op ends on a path the group measured, kept in the file."""
    n_calls = LONGEST_TRIAL + 2  # real timings: as many rounds as it takes
    logs = pool.run(block_calls_measuring, tp, str(tmp_path / "costs.json"), sp, n_calls)
    assert all(log == logs[0] for log in logs[1:])
    ops = {op for op, _, _ in logs[0]}
    assert ops == ({"all_gather_matmul", "matmul_reduce_scatter"} if sp else {"matmul_all_reduce"})
    for op in ops:
        sources = [source for name, source, _ in logs[0] if name == op]
        assert "measuring" in sources and sources[-1] == "measured", (op, sources)
    assert (tmp_path / "costs.json").exists()
