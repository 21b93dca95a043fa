"""fp32 master weights (`MixedPrecisionOptimizer`) and `train_step` (accumulation, scaling,
clipping, master weights composed), including a short fp16 TP=2 run tracking the fp32 one."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

import tplayers
from tplayers.placement import set_placement
from tplayers.testing import assert_close
from tplayers.train.master import MixedPrecisionOptimizer
from tplayers.train.scaler import DynamicLossScaler

OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
}


def _grads(step, shapes, dtype):
    """Gradients exactly representable in `dtype` (small integers over a power of two)."""
    gen = torch.Generator().manual_seed(step)
    return [(torch.randint(-8, 9, s, generator=gen).float() / 16).to(dtype) for s in shapes]


def _backward_with(params, grads):
    """A backward pass whose gradient w.r.t. each param is exactly `grads`."""
    sum(((p * g).sum() for p, g in zip(params, grads, strict=True)), torch.zeros(())).backward()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masters_step_exactly_as_an_fp32_optimizer(name, dtype):
    """The masters follow, bit for bit, the fp32 optimizer fed the same gradients, and the model
    holds the masters rounded to its dtype; a mixed fp32 parameter is stepped in place."""
    shapes = [(3, 4), (4,), (2, 2)]
    torch.manual_seed(0)
    fp32 = [nn.Parameter(torch.randn(s)) for s in shapes]
    model = [nn.Parameter(p.detach().clone().to(dtype)) for p in fp32[:2]] + [nn.Parameter(fp32[2].detach().clone())]
    reference = [nn.Parameter(m.detach().float().clone()) for m in model]  # starts from the rounded weights
    ref_opt = OPTIMIZERS[name](reference)
    opt = MixedPrecisionOptimizer(OPTIMIZERS[name](model))
    for step in range(4):
        grads = _grads(step, shapes, dtype)
        _backward_with(model, grads)
        assert all(p.grad is None for p in model[:2])  # moved to the masters
        opt.step()
        opt.zero_grad()
        _backward_with(reference, [g.float() for g in grads])
        ref_opt.step()
        ref_opt.zero_grad()
    for p, m, r in zip(model, opt.parameters(), reference, strict=True):
        assert m.dtype == torch.float32
        assert torch.equal(m.detach(), r.detach())
        assert torch.equal(p.detach(), r.detach().to(p.dtype))
    assert opt.master_of(model[2]) is model[2]


def test_small_updates_survive_in_the_masters():
    """bf16 cannot move 1.0 by 1e-4; the master does, and the model moves once they add up."""
    plain = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    mixed = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    plain_opt = torch.optim.SGD([plain], lr=1e-4)
    opt = MixedPrecisionOptimizer(torch.optim.SGD([mixed], lr=1e-4))
    for _ in range(100):
        for p, o in ((plain, plain_opt), (mixed, opt)):
            (p.float().sum()).backward()
            o.step()
            o.zero_grad()
    assert torch.equal(plain.detach(), torch.ones(4, dtype=torch.bfloat16))  # 16-bit SGD is stuck
    assert torch.allclose(opt.master_of(mixed).detach(), torch.full((4,), 0.99))
    assert torch.equal(mixed.detach(), torch.full((4,), 0.99).to(torch.bfloat16))


def test_gradient_accumulation_sums_in_fp32():
    """1 + 2^-9 is not a bf16 number; accumulated in fp32 the masters keep it."""
    p = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt = MixedPrecisionOptimizer(torch.optim.SGD([p], lr=1.0))
    for g in (1.0, 2.0**-9):
        _backward_with([p], [torch.full((3,), g, dtype=torch.bfloat16)])
    assert torch.equal(opt.master_of(p).grad, torch.full((3,), 1.0 + 2.0**-9))
    bf16_sum = torch.tensor(1.0, dtype=torch.bfloat16) + torch.tensor(2.0**-9, dtype=torch.bfloat16)
    assert bf16_sum.item() == 1.0  # what 16-bit accumulation would have kept


def test_tied_parameter_gets_one_master_and_placement_is_copied():
    tied = nn.Parameter(torch.randn(4, 4).to(torch.float16))
    set_placement(tied, None, Shard(0))  # no group needed to check that it is copied
    other = nn.Parameter(torch.randn(4).to(torch.float16))
    opt = MixedPrecisionOptimizer(torch.optim.SGD([{"params": [tied, other]}], lr=0.1))
    masters = list(opt.parameters())
    assert len(masters) == 2 and masters[0] is opt.master_of(tied)
    assert tplayers.get_placement(masters[0]) == tplayers.get_placement(tied)
    assert tplayers.get_placement(masters[1]) is None


def test_state_dict_resumes_bit_identically():
    def run(steps, resume_from=None):
        torch.manual_seed(1)
        params = [nn.Parameter(torch.randn(5, 3).to(torch.bfloat16)), nn.Parameter(torch.randn(3).to(torch.bfloat16))]
        opt = MixedPrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2))
        start = 0
        if resume_from is not None:
            state, start = resume_from
            opt.load_state_dict(copy.deepcopy(state))
        for step in range(start, steps):
            _backward_with(params, _grads(step, [(5, 3), (3,)], torch.bfloat16))
            opt.step()
            opt.zero_grad()
        return params, opt

    straight, _ = run(6)
    _, half = run(3)
    resumed, _ = run(6, resume_from=(half.state_dict(), 3))
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)


def test_existing_state_and_gradients_move_to_the_masters():
    p = nn.Parameter(torch.randn(4).to(torch.float16))
    inner = torch.optim.Adam([p], lr=1e-2)
    _backward_with([p], [torch.ones(4, dtype=torch.float16)])
    inner.step()  # state exists before wrapping
    inner.zero_grad()
    _backward_with([p], [torch.full((4,), 0.5, dtype=torch.float16)])
    opt = MixedPrecisionOptimizer(inner)
    master = opt.master_of(p)
    assert p not in opt.state and opt.state[master]["exp_avg"].dtype == torch.float32
    assert torch.equal(master.grad, torch.full((4,), 0.5)) and p.grad is None


def test_lr_scheduler_on_the_wrapped_optimizer():
    p = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    opt = MixedPrecisionOptimizer(torch.optim.SGD([p], lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
    for _ in range(2):
        _backward_with([p], [torch.ones(2, dtype=torch.bfloat16)])
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.25
    assert torch.equal(p.detach(), torch.full((2,), -0.5, dtype=torch.bfloat16))  # 1 - 1 - 0.5


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        MixedPrecisionOptimizer([nn.Parameter(torch.ones(1))])
    p = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    opt = MixedPrecisionOptimizer(torch.optim.SGD([p], lr=1.0))
    with pytest.raises(ValueError, match="master weights"):
        opt.load_state_dict({"optimizer": opt.optimizer.state_dict(), "masters": []})
    with pytest.raises(ValueError, match="at least one micro-batch"):
        tplayers.train_step(nn.Linear(1, 1), opt, [], lambda m, b: m(b).sum())


# -- train_step ---------------------------------------------------------------------------------


def _regression(dtype=torch.float32):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).to(dtype)
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
    return model, x.to(dtype), y.to(dtype)


def _mse(model, batch):
    x, y = batch
    return (model(x).float() - y.float()).square().mean()


def test_accumulated_micro_batches_equal_one_full_batch_step():
    model, x, y = _regression()
    twin = copy.deepcopy(model)
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    result = tplayers.train_step(model, opt, zip(x.chunk(4), y.chunk(4), strict=True), _mse, max_grad_norm=0.05)
    loss = _mse(twin, (x, y))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
    twin_opt.step()
    assert result.grad_norm > 0.05  # clipping was not vacuous
    assert_close(torch.tensor(result.grad_norm), norm.detach())
    assert_close(torch.tensor(result.loss), loss.detach())
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert_close(a.detach(), b.detach())
        assert a.grad is None
    assert not result.skipped and result.scale == 1.0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_scaler_clip_matches_gradscaler_unscale_then_torch_clip(backend):
    """The scaler's clip (norms measured by its fused unscale pass: the Triton kernel, in the
    interpreter here, or its reference) equals GradScaler.unscale_ followed by torch's
    clip_grad_norm_, for norm types 1, 2 and inf."""
    tplayers.set_backend(backend)
    try:
        _compare_scaler_clip_with_torch()
    finally:
        tplayers.set_backend("auto")


def _compare_scaler_clip_with_torch():
    for norm_type in (1.0, 2.0, float("inf")):
        model, x, y = _regression()
        twin = copy.deepcopy(model)
        opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
        scaler, gs = DynamicLossScaler(init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(_mse(model, (x, y))).backward()
        gs.scale(_mse(twin, (x, y))).backward()
        norm = scaler.clip_grad_norm_(opt, 0.01, norm_type)
        gs.unscale_(twin_opt)
        expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.01, norm_type)
        assert expected > 0.01
        assert_close(norm, expected)
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert_close(a.grad, b.grad)


def test_scaler_clip_measures_again_a_gradient_changed_after_unscale():
    """Triton backend (the fused pass records norms): a gradient changed after it is re-measured."""
    tplayers.set_backend("triton")
    try:
        _check_remeasured()
    finally:
        tplayers.set_backend("auto")


def _check_remeasured():
    model, x, y = _regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=8.0)
    scaler.scale(_mse(model, (x, y))).backward()
    scaler.unscale_(opt)
    model[0].weight.grad.data.mul_(100.0)  # after the fused pass; .data: no version bump to see
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert_close(scaler.clip_grad_norm_(opt, 1e9), expected)


def test_overflow_step_is_skipped_and_scale_backs_off():
    model, x, y = _regression(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    scaler = DynamicLossScaler(init_scale=2.0**15)
    before = [p.detach().clone() for p in model.parameters()]

    def exploding(m, batch):
        return _mse(m, batch) * 1e10  # scaled by 2^15 it overflows fp16 in backward

    result = tplayers.train_step(model, opt, [(x, y)], exploding, scaler=scaler, max_grad_norm=1.0)
    assert result.skipped and result.scale == 2.0**15 and scaler.get_scale() == 2.0**14
    assert not torch.isfinite(torch.tensor(result.grad_norm))
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in opt.parameters())
    result = tplayers.train_step(model, opt, [(x, y)], _mse, scaler=scaler, max_grad_norm=1.0)
    assert not result.skipped and not torch.equal(before[0], model[0].weight)


def test_fp16_tp2_training_tracks_the_fp32_run():
    """`tplayers demo --dtype fp16` in small: TP=2, fp16 parameters with fp32 masters, the loss
    scaler, clipping and 2 micro-batches, against the unsharded fp32 twin."""
    from tplayers.tools.demo import DemoConfig, run_demo

    report = run_demo(DemoConfig(tp=2, steps=40, batch=4, seq=32, dtype="fp16", micro_batches=2, lr=3e-3))
    losses, fp32 = report["losses"], report["unsharded_losses"]
    assert losses[-1] < 0.75 * losses[0]  # it trains
    # Stated tolerance: over these 40 steps, within 0.01 nats of the fp32 run at every step
    # (measured 0.002; the 300-step demo stays within 0.05).
    assert max(abs(a - b) for a, b in zip(losses, fp32, strict=True)) < 1e-2
    assert report["skipped_steps"] == 0


def test_frozen_parameters_and_lbfgs():
    frozen = nn.Parameter(torch.ones(3, dtype=torch.bfloat16), requires_grad=False)
    live = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = MixedPrecisionOptimizer(torch.optim.SGD([frozen, live], lr=0.5))
    assert opt.master_of(frozen) is frozen and opt.master_of(live) is not live
    _backward_with([live], [torch.ones(3, dtype=torch.bfloat16)])
    opt.step()
    assert torch.equal(frozen, torch.ones(3, dtype=torch.bfloat16)) and torch.equal(
        live.detach(), torch.full((3,), 0.5).bfloat16()
    )

    p = nn.Parameter(torch.tensor([3.0, -2.0], dtype=torch.bfloat16))
    lbfgs = MixedPrecisionOptimizer(torch.optim.LBFGS([p], lr=1.0, max_iter=20))  # LBFGS keeps the param list

    def closure():
        lbfgs.zero_grad()
        loss = (p.float() - 1).square().sum()
        loss.backward()
        return loss

    lbfgs.step(closure)
    assert torch.allclose(p.float(), torch.ones(2), atol=1e-2)  # converged to 1 within bf16 resolution (2^-8)


def test_wrapping_twice_raises_until_hooks_removed():
    p = nn.Parameter(torch.ones(2, dtype=torch.float16))
    first = MixedPrecisionOptimizer(torch.optim.SGD([p], lr=0.1))
    with pytest.raises(RuntimeError, match="remove_hooks"):
        MixedPrecisionOptimizer(torch.optim.SGD([p], lr=0.1))
    first.remove_hooks()
    second = MixedPrecisionOptimizer(torch.optim.SGD([p], lr=0.1))
    _backward_with([p], [torch.ones(2, dtype=torch.float16)])
    assert torch.equal(second.master_of(p).grad, torch.ones(2)) and first.master_of(p).grad is None


def test_stale_master_gradients_raise_instead_of_accumulating():
    """model.zero_grad() does not reach the masters: a backward after a step (taken or skipped)
    without opt.zero_grad() raises, rather than adding the old gradients in."""
    model, x, y = _regression(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    _mse(model, (x, y)).backward()
    opt.step()
    model.zero_grad()
    with pytest.raises(RuntimeError, match=r"call opt.zero_grad\(\)"):
        _mse(model, (x, y)).backward()
    opt.zero_grad()
    _mse(model, (x, y)).backward()  # fine again

    scaler = DynamicLossScaler(init_scale=2.0**15)
    opt.zero_grad()
    scaler.scale(_mse(model, (x, y)) * 1e10).backward()  # overflows: the step is skipped
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    with pytest.raises(RuntimeError, match="zero_grad"):
        _mse(model, (x, y)).backward()


def test_reload_model_params_after_loading_weights():
    model, x, y = _regression(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    loaded = {k: torch.randn_like(v, dtype=torch.float32).to(v.dtype) for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)
    opt.reload_model_params()
    _mse(model, (x, y)).backward()
    opt.step()  # lr 0: the weights must stay the loaded ones
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded[k])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp64_gradients_unscale_and_clip(backend):
    """fp64 (the dtype of unsharded-reference property tests) through the scaler and clipping."""
    tplayers.set_backend(backend)
    try:
        model, x, y = _regression(torch.float64)
        twin = copy.deepcopy(model)
        opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
        scaler, gs = DynamicLossScaler(init_scale=64.0), torch.amp.GradScaler("cpu", init_scale=64.0)
        scaler.scale(_mse(model, (x, y))).backward()
        gs.scale(_mse(twin, (x, y))).backward()
        norm = scaler.clip_grad_norm_(opt, 0.01)
        gs.unscale_(twin_opt)
        expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.01)
        assert norm.dtype == torch.float64
        assert_close(norm, expected)
    finally:
        tplayers.set_backend("auto")


# -- tensor x data parallel ----------------------------------------------------------------------

HIDDEN, FFN = 8, 16


def _tp_dp_batches(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 3, HIDDEN, generator=gen)  # the global batch: 4 sequences


def check_tp_dp_training(rank, world, group):
    """2 TP groups of 2 ranks ([0, 1], [2, 3]) and 2 data-parallel replicas of each ([0, 2],
    [1, 3]): each replica trains on its half of every global batch, with 2 micro-batches, the
    scaler and clipping; the result must be the unsharded block trained on the whole batch."""
    import torch.distributed as dist

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp_rank, tp_rank = divmod(rank, 2)
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    reference = nn.Sequential(copy.deepcopy(fc1), nn.GELU(approximate="tanh"), copy.deepcopy(fc2))
    model = nn.Sequential(
        tplayers.ColumnParallelLinear.from_linear(fc1, group=tp_group),
        nn.GELU(approximate="tanh"),
        tplayers.RowParallelLinear.from_linear(fc2, group=tp_group),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**8)  # default group: all four ranks

    def loss_fn(m, x):
        return m(x).square().mean()

    norms = []
    for step in range(3):
        full = _tp_dp_batches(step)
        mine = full.chunk(2)[dp_rank]
        with tplayers.count_bytes() as sent:
            result = tplayers.train_step(
                model, opt, mine.chunk(2), loss_fn, scaler=scaler, max_grad_norm=0.05, dp_group=dp_group
            )
        # one averaging of the gradients over the 2 replicas per step, not one per micro-batch (the
        # ring all-reduce sends 2 (n - 1) / n = 1 x their bytes; clipping and the scaler add a few numbers)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert grad_bytes <= sent.by_axis()["dp"] < 1.5 * grad_bytes, (sent.by_axis(), grad_bytes)
        loss = loss_fn(reference, full)
        loss.backward()
        norms.append((result.grad_norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05).item()))
        ref_opt.step()
        ref_opt.zero_grad()
    col, row = model[0], model[2]
    shard = slice(tp_rank * FFN // 2, (tp_rank + 1) * FFN // 2)
    assert_close(col.weight.detach(), reference[0].weight[shard].detach())
    assert_close(row.weight.detach(), reference[2].weight[:, shard].detach())
    assert_close(row.bias.detach(), reference[2].bias.detach())
    for ours, theirs in norms:
        assert theirs > 0.05  # clipping was active
        assert_close(torch.tensor(ours), torch.tensor(theirs))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.multirank
def test_tensor_and_data_parallel_train_step_matches_unsharded(pool):
    results = pool.run(check_tp_dp_training, 4)
    for a, b in zip(results[0], results[2], strict=True):  # replicas of one shard: bit-identical
        assert torch.equal(a, b)
    for a, b in zip(results[1], results[3], strict=True):
        assert torch.equal(a, b)


def data_parallel_train_step_bytes(rank, world, group, zero_stage):
    """TP 2 x DP 2 with tplayers.data_parallel: the dp bytes of one train_step of 3 micro-batches."""
    from tplayers.testing.meshes import layout_mesh

    mesh = layout_mesh(2, 1, 2)
    torch.manual_seed(0)
    model = nn.Sequential(
        tplayers.ColumnParallelLinear(HIDDEN, FFN, group=mesh["tp"]),
        nn.GELU(approximate="tanh"),
        tplayers.RowParallelLinear(FFN, HIDDEN, group=mesh["tp"]),
    )
    tplayers.data_parallel(model, group=mesh["dp"], zero_stage=zero_stage)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    batches = _tp_dp_batches(mesh["dp"].get_local_rank()).chunk(3, 1)
    tplayers.train_step(model, opt, batches, lambda m, x: m(x).square().mean())  # warm-up (lazy init)
    with tplayers.count_bytes() as sent:
        tplayers.train_step(model, opt, batches, lambda m, x: m(x).square().mean())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    return sent.by_axis()["dp"], 4 * local


@pytest.mark.multirank
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_data_parallel_train_step_reduces_once_per_step(pool, zero_stage):
    """train_step's own byte count: the gradients cross the replicas once per step whatever the
    micro-batches (a reduction per micro-batch would send 3 times as much)."""
    for dp_bytes, grad_bytes in pool.run(data_parallel_train_step_bytes, 4, zero_stage, mesh=(2, 1, 2)):
        # stage 0: a ring all-reduce of every gradient (2 (n - 1) / n = 1 x their bytes at n = 2);
        # stage 2: the parameters all-gathered once and each gradient reduce-scattered once ((n - 1) / n
        # of the whole each = 1 x the shard's bytes each)
        once = 1 if zero_stage == 0 else 2
        assert once * grad_bytes <= dp_bytes < (once + 0.5) * grad_bytes, (dp_bytes, grad_bytes)
