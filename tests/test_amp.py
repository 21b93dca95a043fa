"""`tplayers.train.scaler.DynamicLossScaler`: scale sequences equal torch.amp.GradScaler's where their
semantics overlap, hysteresis, state_dict round trips, argument checks, and fault injection on a
tensor-parallel block: an inf / -inf / nan in one rank's gradient makes every rank skip."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tplayers
from tplayers.train.scaler import DynamicLossScaler

BAD_VALUES = [math.inf, -math.inf, math.nan]


def _run_steps(scaler, param, optimizer, grads):
    """One scaled step per entry of `grads` (the unscaled gradient, possibly non-finite):
    returns [(scale before update, skipped)] per step."""
    trace = []
    for g in grads:
        optimizer.zero_grad()
        loss = scaler.scale((param * g).sum())  # d loss / d param = g * scale
        loss.backward()
        before = param.detach().clone()
        scaler.step(optimizer)
        skipped = torch.equal(before, param.detach())
        scaler.update()
        trace.append((scaler.get_scale(), skipped))
    return trace


def _gradients(n, bad_at, seed=0):
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for i in range(n):
        g = torch.randn(5, generator=gen)
        if i in bad_at:
            g[i % 5] = bad_at[i]
        grads.append(g)
    return grads


def _fresh_param():
    return nn.Parameter(torch.linspace(-1.0, 1.0, 5))


def test_matches_torch_gradscaler():
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    grads = _gradients(16, {2: math.inf, 3: math.nan, 9: -math.inf})
    traces, params = [], []
    for make in (lambda: torch.amp.GradScaler("cpu", **kw), lambda: DynamicLossScaler(**kw)):
        param = _fresh_param()
        traces.append(_run_steps(make(), param, torch.optim.SGD([param], lr=0.1), grads))
        params.append(param.detach())
    ours, theirs = traces[1], traces[0]
    assert ours == theirs
    assert torch.equal(params[0], params[1])
    # the sequence is not vacuous: it backs off, skips, and grows after growth_interval clean steps
    scales = [s for s, _ in ours]
    assert scales[2] == 2.0**9 and scales[3] == 2.0**8 and scales[5:7] == [2.0**8, 2.0**9]
    assert [skipped for _, skipped in ours].count(True) == 3


def test_hysteresis_backs_off_on_the_third_consecutive_overflow():
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=100, hysteresis=3)
    param = _fresh_param()
    optimizer = torch.optim.SGD([param], lr=0.1)
    # overflows at steps 0-6 (7 consecutive), a clean step, then 2 overflows, a clean step, 3 overflows
    pattern = [1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1]
    grads = _gradients(len(pattern), {i: math.inf for i, bad in enumerate(pattern) if bad})
    trace = _run_steps(scaler, param, optimizer, grads)
    expected_scales = [1024, 1024, 512, 512, 512, 256, 256, 256, 256, 256, 256, 256, 256, 128]
    assert [s for s, _ in trace] == expected_scales
    assert [skipped for _, skipped in trace] == [bool(b) for b in pattern]  # every overflow skips


def test_min_scale_clamps_or_raises():
    for raise_on_min in (False, True):
        scaler = DynamicLossScaler(init_scale=4.0, min_scale=2.0, raise_on_min_scale=raise_on_min)
        param = _fresh_param()
        optimizer = torch.optim.SGD([param], lr=0.1)
        _run_steps(scaler, param, optimizer, _gradients(1, {0: math.inf}))
        assert scaler.get_scale() == 2.0
        if raise_on_min:
            with pytest.raises(RuntimeError, match="min_scale"):
                _run_steps(scaler, param, optimizer, _gradients(1, {0: math.inf}))
        else:
            _run_steps(scaler, param, optimizer, _gradients(2, {0: math.inf, 1: math.nan}))
            assert scaler.get_scale() == 2.0


@pytest.mark.parametrize(
    "bad_at, trackers",
    [
        ({0: math.inf, 1: math.inf, 2: math.nan}, (3, 2)),  # mid-way to growth
        ({3: math.inf}, (0, 1)),  # mid-way through the hysteresis
    ],
)
def test_state_dict_round_trips_every_tracker(bad_at, trackers):
    kw = dict(
        init_scale=2.0**12, growth_factor=4.0, backoff_factor=0.25, growth_interval=4, hysteresis=2, min_scale=8.0
    )
    scaler = DynamicLossScaler(**kw)
    param = _fresh_param()
    optimizer = torch.optim.SGD([param], lr=0.1)
    _run_steps(scaler, param, optimizer, _gradients(max(bad_at) + 1 if trackers[0] == 0 else 6, bad_at))
    state = scaler.state_dict()
    assert (state["_growth_tracker"], state["_hysteresis_tracker"]) == trackers, state
    fresh = DynamicLossScaler(raise_on_min_scale=True)  # every setting differs from `scaler`'s
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.state_dict() == state
    param2 = nn.Parameter(param.detach().clone())
    optimizer2 = torch.optim.SGD([param2], lr=0.1)
    more = _gradients(12, {0: math.inf, 5: math.nan, 6: math.inf, 7: math.inf}, seed=1)
    assert _run_steps(fresh, param2, optimizer2, more) == _run_steps(scaler, param, optimizer, more)
    assert fresh.state_dict() == scaler.state_dict()
    assert torch.equal(param, param2)
    # GradScaler can read ours, and ours a GradScaler's
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(state)
    assert theirs.get_scale() == state["scale"] and theirs._get_growth_tracker() == trackers[0]
    ours = DynamicLossScaler()
    ours.load_state_dict(torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=7).state_dict())
    assert ours.get_scale() == 32.0 and ours.get_growth_interval() == 7


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(init_scale=0.0),
        dict(init_scale=-1.0),
        dict(init_scale=math.inf),
        dict(init_scale=math.nan),
        dict(backoff_factor=1.0),
        dict(backoff_factor=1.5),
        dict(backoff_factor=0.0),
        dict(backoff_factor=-0.5),
        dict(growth_factor=1.0),
        dict(growth_factor=0.5),
        dict(growth_factor=math.inf),
        dict(growth_interval=0),
        dict(growth_interval=1.5),
        dict(hysteresis=0),
        dict(min_scale=0.0),
        dict(min_scale=-1.0),
        dict(init_scale=1.0, min_scale=2.0),
    ],
)
def test_invalid_arguments_raise(kwargs):
    with pytest.raises(ValueError, match="DynamicLossScaler"):
        DynamicLossScaler(**kwargs)


def test_api_misuse_raises():
    scaler = DynamicLossScaler()
    param = _fresh_param()
    optimizer = torch.optim.SGD([param], lr=0.1)
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()
    scaler.scale(param.sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(optimizer)
    scaler.update()
    with pytest.raises(ValueError, match="DynamicLossScaler"):
        DynamicLossScaler().load_state_dict({**scaler.state_dict(), "backoff_factor": 2.0})


# -- fault injection on a tensor-parallel block -------------------------------------------------

HIDDEN, FFN_PER_RANK, INIT_SCALE = 8, 4, 2.0**8


def _block(tp, group):
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(HIDDEN, FFN_PER_RANK * tp), nn.Linear(FFN_PER_RANK * tp, HIDDEN)
    col = tplayers.ColumnParallelLinear.from_linear(fc1, group=group)
    row = tplayers.RowParallelLinear.from_linear(fc2, group=group)
    return col, row


def _scaled_backward(scaler, col, row, optimizer, seed):
    optimizer.zero_grad()
    x = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(seed))
    scaler.scale(row(torch.relu(col(x))).square().mean()).backward()


def _snapshot(modules, optimizer):
    params = [p.detach().clone() for m in modules for p in m.parameters()]
    return params, copy.deepcopy(optimizer.state_dict())


def _assert_identical(before, after):
    for a, b in zip(before[0], after[0], strict=True):
        assert torch.equal(a, b)
    state_a, state_b = before[1]["state"], after[1]["state"]
    assert state_a.keys() == state_b.keys() and state_a
    for key in state_a:
        for name, value in state_a[key].items():
            assert torch.equal(value, state_b[key][name]), (key, name)


def check_fault_injection(rank, tp, group, bad_rank, target, extra_group):
    """Returns per-trial (skipped, scale after update) as this rank saw them."""
    tp_group, extra = group, group  # the pool's TP group: the default group would span idle ranks
    if extra_group:  # 2 TP groups of 2 on 4 ranks, a simulated DP / PP group across them
        tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        other = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        tp_group, extra = tp_groups[rank // 2], other[rank % 2]
    col, row = _block(dist.get_world_size(tp_group), tp_group)
    optimizer = torch.optim.Adam([*col.parameters(), *row.parameters()], lr=1e-2)
    scaler = DynamicLossScaler(init_scale=INIT_SCALE, growth_interval=1000, group=extra)
    assert tplayers.get_placement(col.weight).is_sharded and not tplayers.get_placement(row.bias).is_sharded
    _scaled_backward(scaler, col, row, optimizer, seed=0)  # a clean step first: Adam has state
    scaler.step(optimizer)
    scaler.update()
    assert not scaler.last_step_skipped
    seen = []
    for trial, bad in enumerate(BAD_VALUES):
        _scaled_backward(scaler, col, row, optimizer, seed=1 + trial)
        if rank == bad_rank:
            grad = col.weight.grad if target == "sharded" else row.bias.grad
            grad.view(-1)[trial] = bad
        before = _snapshot([col, row], optimizer)
        scale = scaler.get_scale()
        assert scaler.step(optimizer) is None
        assert scaler.last_step_skipped, f"rank {rank} stepped on {bad}"
        _assert_identical(before, _snapshot([col, row], optimizer))
        scaler.update()
        assert scaler.get_scale() == scale / 2
        seen.append((scaler.last_step_skipped, scaler.get_scale()))
    _scaled_backward(scaler, col, row, optimizer, seed=99)  # clean again: every rank steps
    before = _snapshot([col, row], optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert not scaler.last_step_skipped
    assert not torch.equal(before[0][0], col.weight.detach())
    seen.append((scaler.last_step_skipped, scaler.get_scale()))
    return seen


def _check_all_ranks_agree(results):
    assert all(r == results[0] for r in results)
    expected = [(True, INIT_SCALE / 2 ** (i + 1)) for i in range(len(BAD_VALUES))]
    assert results[0] == [*expected, (False, INIT_SCALE / 2 ** len(BAD_VALUES))]


@pytest.mark.multirank
@pytest.mark.parametrize("target", ["sharded", "replicated"])
@pytest.mark.parametrize("tp", [2, 4])
def test_overflow_on_one_rank_skips_on_every_rank(pool, tp, target):
    _check_all_ranks_agree(pool.run(check_fault_injection, tp, tp - 1, target, False))


@pytest.mark.multirank
def test_overflow_reaches_ranks_of_other_tp_groups_through_extra_group(pool):
    _check_all_ranks_agree(pool.run(check_fault_injection, 4, 3, "sharded", True))


def check_local_verdict(rank, tp, group, bad_rank):
    """Negative control: the same injection with the consensus reduction switched off (each rank
    decides alone, as a scaler without the MAX-reduction would). Returns whether this rank skipped."""
    col, row = _block(tp, group)
    optimizer = torch.optim.Adam([*col.parameters(), *row.parameters()], lr=1e-2)
    scaler = DynamicLossScaler(init_scale=INIT_SCALE, group=group)
    scaler._groups_of = lambda optimizer: []  # no reduction at all
    _scaled_backward(scaler, col, row, optimizer, seed=0)
    if rank == bad_rank:
        col.weight.grad.view(-1)[0] = math.inf
    scaler.step(optimizer)
    skipped = scaler.last_step_skipped
    scaler.update()
    return skipped, scaler.get_scale()


@pytest.mark.multirank
def test_negative_control_without_consensus_ranks_disagree(pool):
    """Without the reduction the rank with the inf skips and the others step: the agreement the
    fault-injection tests check is not automatic, and they would catch its loss."""
    results = pool.run(check_local_verdict, 2, 1)
    assert results == [(False, INIT_SCALE), (True, INIT_SCALE / 2)]
    with pytest.raises(AssertionError):
        _check_all_ranks_agree([[r] for r in results])


def test_fp16_gradients_refused_unless_allowed():
    """As GradScaler: unscaling fp16 gradients in fp16 underflows; fp32 masters are the fix."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    optimizer = torch.optim.SGD([p], lr=0.1)
    scaler = DynamicLossScaler(init_scale=1024.0)
    scaler.scale(p.float().sum()).backward()
    with pytest.raises(ValueError, match="MixedPrecisionOptimizer"):
        scaler.unscale_(optimizer)
    allowed = DynamicLossScaler(init_scale=1024.0, allow_fp16_grads=True)
    allowed.unscale_(optimizer)
    assert torch.equal(p.grad, torch.ones(4, dtype=torch.float16))
