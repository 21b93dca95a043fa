"""Data-parallel communication: `train_step` reduces the gradients over the replicas once per
step whatever the micro-batches (every ZeRO stage), the result equals the unsharded model trained
on the whole batch, and `count_bytes().by_axis()` sees the tensor-, data- and pipeline-parallel
traffic, each exactly as the planner prices it."""

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

import tplayers
from tplayers.data_parallel import compress
from tplayers.plan import Assumptions, ClusterSpec, Layout, ModelSpec, Precision, estimate
from tplayers.state import state_of
from tplayers.testing import assert_close
from tplayers.tolerances import tolerance

sys.path.insert(0, str(Path(__file__).parent))
from test_families import tiny_model  # noqa: E402

pytestmark = pytest.mark.multirank

MICRO_BATCHES, TOKENS = 4, 8
# tiny_model("llama"): hidden 32, 4 heads of 8, 2 key/value heads, MLP 64, vocabulary 96, 2 layers
SPEC = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn_hidden=64, vocab=96, seq_len=TOKENS,
                 max_positions=64)  # fmt: skip
FP32 = Precision.preset("fp32-adam")


def batches(replica, micro_batches):
    return torch.randint(3, 96, (micro_batches, 2, TOKENS), generator=torch.Generator().manual_seed(10 + replica))


def loss_fn(model, ids):
    return model(ids, labels=ids).loss


def accumulate(rank, world, group, zero_stage, micro_batches, through_train_step=True):
    """TP 2 x DP 2: one warm-up step, then one counted step of `micro_batches`; returns the
    counted bytes by axis and kind, and the full state dict after both steps."""
    mesh = tplayers.init_mesh(dp=2, tp=2)
    model = tiny_model("llama")
    tplayers.parallelize(model, group=mesh["tp"], sequence_parallel=True, verify=False)
    tplayers.data_parallel(model, group=mesh["dp"], zero_stage=zero_stage)
    opt = tplayers.data_parallel_optimizer(model, torch.optim.SGD, lr=0.5)
    ids = batches(mesh["dp"].get_local_rank(), micro_batches)
    tplayers.train_step(model, opt, list(ids), loss_fn)
    with tplayers.count_bytes() as sent:
        if through_train_step:
            tplayers.train_step(model, opt, list(ids), loss_fn)
        else:  # the negative control: every micro-batch's backward reduces
            for batch in ids:
                (loss_fn(model, batch) / micro_batches).backward()
            opt.step()
            opt.zero_grad()
    return sent.by_axis(), dict(sent), tplayers.gather_state_dict(model)


def planned_dp_bytes(zero_stage, micro_batches, compress=None, sequence_parallel=True):
    layout = Layout(tp=2, dp=2, zero_stage=zero_stage, num_microbatches=micro_batches,
                    sequence_parallel=sequence_parallel, compress=compress)  # fmt: skip
    est = estimate(SPEC, ClusterSpec.preset("h100", num_gpus=4), layout, FP32,
                   assumptions=Assumptions(implementation="tplayers"))  # fmt: skip
    return est.comm_bytes_by_group["dp"]


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_one_reduction_per_step_at_every_zero_stage(pool, zero_stage):
    """4 micro-batches send over the replicas what the planner prices for one step (stages 0-2:
    what one micro-batch would; stage 3 gathers the parameters per micro-batch but reduces once);
    the weights after two steps equal the unsharded model trained on both replicas' batches."""
    replies = pool.run(accumulate, 4, zero_stage, MICRO_BATCHES)
    single = pool.run(accumulate, 4, zero_stage, 1)
    for (axes, kinds, _), (one_axes, _, _) in zip(replies, single, strict=True):
        assert axes["dp"] == planned_dp_bytes(zero_stage, MICRO_BATCHES), (axes, kinds)
        assert axes["pp"] == 0 and axes["tp"] == MICRO_BATCHES * one_axes["tp"]
        if zero_stage < 3:
            assert axes["dp"] == one_axes["dp"], (axes, one_axes)
        else:  # the gathers per micro-batch, the reduce-scatter once (the planner's split of it)
            assert one_axes["dp"] < axes["dp"] < MICRO_BATCHES * one_axes["dp"], (axes, one_axes)
    reference = tiny_model("llama")
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(2):  # the mean over the 2 replicas x 4 micro-batches
        both = torch.cat([batches(r, MICRO_BATCHES) for r in range(2)])
        (sum(loss_fn(reference, b) for b in both) / len(both)).backward()
        opt.step()
        opt.zero_grad()
    for key, value in reference.state_dict().items():
        assert_close(replies[0][2][key], value, msg=lambda m, k=key: f"{k} after 2 steps: {m}")


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_reducing_every_micro_batch_is_what_train_step_saves(pool, zero_stage):
    """The negative control: backward per micro-batch without train_step reduces each time."""
    plain = pool.run(accumulate, 4, zero_stage, MICRO_BATCHES, False)[0][0]["dp"]
    once = planned_dp_bytes(zero_stage, MICRO_BATCHES)
    assert plain > once, (plain, once)
    if zero_stage == 0:  # one all-reduce per micro-batch
        assert plain == MICRO_BATCHES * once


def pipeline_bytes(rank, world, group):
    """PP 2 x TP 2, 4 micro-batches of 2 x 8 tokens: what each rank sends, by axis."""
    mesh = tplayers.init_mesh(pp=2, tp=2)
    model = tiny_model("llama")
    tplayers.parallelize(model, group=mesh["tp"], verify=False)
    stages = tplayers.pipeline_split(model, group=mesh["pp"])
    schedule = tplayers.Schedule1F1B(stages[0], MICRO_BATCHES, lambda logits, ids: logits.float().mean())
    ids = torch.randint(3, 96, (2 * MICRO_BATCHES, TOKENS), generator=torch.Generator().manual_seed(0))
    schedule.step(ids, target=ids)
    with tplayers.count_bytes() as sent:
        schedule.step(ids, target=ids)
    return mesh["pp"].get_local_rank(), sent.by_axis()


def test_pipeline_bytes_by_axis(pool):
    """Each stage sends its activations forward (the first) or their gradients back (the last),
    2 x 8 x 32 fp32 per micro-batch, as the planner prices a stage's pipeline traffic (every TP
    rank sends the whole activation: tplayers does not split it over them)."""
    layout = Layout(tp=2, pp=2, num_microbatches=MICRO_BATCHES, micro_batch=2)
    est = estimate(SPEC, ClusterSpec.preset("h100", num_gpus=4), layout, FP32,
                   assumptions=Assumptions(implementation="tplayers"))  # fmt: skip
    for stage, axes in pool.run(pipeline_bytes, 4):
        assert axes["pp"] == MICRO_BATCHES * 2 * TOKENS * 32 * 4, axes
        assert axes["dp"] == 0 and axes["tp"] > 0
        assert est.stages[stage].comm_bytes_by_group["pp"] == axes["pp"], (est.stages[stage], axes)


def compressed(rank, world, group, zero_stage, compress):
    """TP 2 x DP 2, two steps of 2 micro-batches: dp bytes of the second, the full state dict."""
    mesh = tplayers.init_mesh(dp=2, tp=2)
    model = tiny_model("llama")
    tplayers.parallelize(model, group=mesh["tp"], verify=False)
    tplayers.data_parallel(model, group=mesh["dp"], zero_stage=zero_stage, compress=compress)
    opt = tplayers.data_parallel_optimizer(model, torch.optim.SGD, lr=0.5)
    ids = batches(mesh["dp"].get_local_rank(), 2)
    tplayers.train_step(model, opt, list(ids), loss_fn)
    with tplayers.count_bytes() as sent:
        tplayers.train_step(model, opt, list(ids), loss_fn)
    return sent.by_axis()["dp"], dict(sent), tplayers.gather_state_dict(model)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_bf16_compression_halves_the_gradient_bytes(pool, zero_stage):
    """compress="bf16": the gradients' reduction moves half the bytes (stages 0-1: the whole
    reduction; 2-3: the reduce-scatter, the parameters still gathered in fp32); every replica and
    every TP rank holds the same weights, bit for bit; they stay within bf16's tolerance of the
    uncompressed run."""
    plain = pool.run(compressed, 4, zero_stage, None)
    bf16 = pool.run(compressed, 4, zero_stage, "bf16")
    reduction = planned_dp_bytes(0, 1)  # the fp32 all-reduce of every gradient
    for (dp, kinds, _), (dp_plain, kinds_plain, _) in zip(bf16, plain, strict=True):
        if zero_stage < 2:  # 12448 gradients in one bucket, split evenly over 2 replicas: exactly half
            assert dp_plain - dp == reduction / 2 and kinds["all_to_all"] == reduction / 4, (kinds, kinds_plain)
        else:  # (no sequence parallelism: every reduce-scatter is FSDP2's)
            assert kinds["reduce_scatter"] == kinds_plain["reduce_scatter"] / 2, (kinds, kinds_plain)
        assert dp == planned_dp_bytes(zero_stage, 2, "bf16", sequence_parallel=False), (dp, kinds)
    for reply in bf16[1:]:  # replicas (ranks 0 / 2) and TP ranks (0 / 1) alike
        for key, value in reply[2].items():
            assert torch.equal(value, bf16[0][2][key]), key
    for key, value in plain[0][2].items():
        torch.testing.assert_close(
            bf16[0][2][key], value, **tolerance(torch.bfloat16), msg=lambda m, k=key: f"{k}: {m}"
        )


def refused_compression(rank, world, group, compress, zero_stage):
    tplayers.data_parallel(tiny_model("llama"), group=group, zero_stage=zero_stage, compress=compress)


def test_an_unknown_compression_is_refused_on_every_rank(pool):
    for reply in pool.run(refused_compression, 2, "int4", 0, return_exceptions=True):
        assert f"compress must be one of {compress.SPECS}, got 'int4'" in str(reply), reply


# -- int8 and top-k with error feedback (stages 0-1) ----------------------------------------------
def compressed_bytes(spec, shapes, n=2, reduction=1):
    """The dp bytes the `reduction`-th (from 0) step of one bucket sends: int8 an all-to-all and
    an all-gather of whole blocks and their scales; top-k an all-gather of every replica's values
    and int32 indices; PowerSGD two fp32 means (all-to-all + all-gather, padded to n chunks): the
    P factors with the gradients sent whole, then the Q factors."""
    compression = tplayers.Compression.parse(spec)
    sizes = [math.prod(shape) for shape in shapes]
    if compression.kind == "powersgd":
        factors = [compress.low_rank(s, compression.rank) if reduction >= compression.start else None for s in shapes]
        first = sum(f[0] * f[2] if f else size for f, size in zip(factors, sizes, strict=True))
        second = sum(f[1] * f[2] for f in factors if f)
        return sum(2 * (n - 1) * math.ceil(length / n) * 4 for length in (first, second) if length)
    if compression.kind == "int8":
        _, chunk = compress.blocked(sizes, n)
        return 2 * (n - 1) / n * n * chunk * (compress.BLOCK + 4)
    k = sum(min(s, max(1, math.ceil(compression.fraction * s))) for s in sizes)
    return (n - 1) * k * 8


def local_shapes(rank, world, group):
    mesh = tplayers.init_mesh(dp=2, tp=2)
    model = tiny_model("llama")
    tplayers.parallelize(model, group=mesh["tp"], verify=False)
    return [p.shape for p in model.parameters()]


@pytest.mark.parametrize(
    ("spec", "zero_stage"),
    [("int8", 0), ("int8", 1), ("topk:0.05", 0), ("topk:0.05", 1), ("powersgd:rank=2", 0), ("powersgd:rank=2", 1),
     ("powersgd:rank=2,start=2", 0)],
)  # fmt: skip
def test_compressed_bytes_and_identical_replicas(pool, spec, zero_stage):
    """TP 2 x DP 2: the dp bytes of a step are the compressor's formula exactly (one bucket;
    ZeRO-1 adds its partitions' gather, uncompressed; PowerSGD's second step sends everything
    whole when it starts at the third); every replica and TP rank holds the same weights, bit for
    bit, after two steps."""
    replies = pool.run(compressed, 4, zero_stage, spec)
    plain = pool.run(compressed, 4, zero_stage, None)
    shapes = pool.run(local_shapes, 4)
    for (dp, _, _), (dp_plain, _, _), shape in zip(replies, plain, shapes, strict=True):
        params = 4 * sum(math.prod(s) for s in shape) / 2 if zero_stage == 1 else 0  # ZeRO-1's gather
        assert dp == compressed_bytes(spec, shape) + params, (dp, compressed_bytes(spec, shape), params)
        if "start=2" not in spec:  # the planner prices compressed steps
            assert dp == planned_dp_bytes(zero_stage, 2, spec, sequence_parallel=False), dp
        if "start=2" in spec:
            assert dp == dp_plain, (dp, dp_plain)
        else:
            assert dp - params < (dp_plain - params) / 3, (dp, dp_plain)
    for reply in replies[1:]:
        for key, value in reply[2].items():
            assert torch.equal(value, replies[0][2][key]), key


def one_layer_steps(rank, world, group, spec, steps):
    """DP 2 over one nn.Linear (960 entries: 15 blocks): each step's DDP gradient, each replica's
    own gradient (from a plain copy), and the residual after the step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(24, 40, bias=False)
    plain = copy.deepcopy(model)
    tplayers.data_parallel(model, group=group, compress=spec)
    out = []
    for step in range(steps):
        x = torch.randn(5, 24, generator=torch.Generator().manual_seed(100 * step + rank))
        (model(x) ** 2).mean().backward()
        plain.weight.grad = None
        (plain(x) ** 2).mean().backward()
        residual = state_of(model).compressor.residuals.get(model.weight)
        out.append(
            (model.weight.grad.clone(), plain.weight.grad.clone(), None if residual is None else residual.clone())
        )
        model.weight.grad = None
    return out


def simulate(spec, grads, residuals, state):
    """The compressor on one process: (the mean every replica gets, each replica's new residual)."""
    values = [g.reshape(-1) + (0 if r is None else r) for g, r in zip(grads, residuals, strict=True)]
    mean, sent = compress.simulate(tplayers.Compression.parse(spec), values, [grads[0].shape], state)
    return mean, [v - s for v, s in zip(values, sent, strict=True)]


@pytest.mark.parametrize("spec", ["int8", "topk:0.1", "powersgd:rank=2"])
def test_a_single_process_simulation_equals_the_distributed_result(pool, spec):
    """Three steps: each replica's gradient through the simulation gives the mean DDP hands every
    replica, bit for bit, and each replica's residual is gradient + old residual - sent (PowerSGD:
    its warm-started Q carried from step to step, as the hook carries it)."""
    replies = pool.run(one_layer_steps, 2, spec, 3)
    residuals, state = [None, None], compress.PowerSGDState()
    for step in range(3):
        grads = [reply[step][1] for reply in replies]
        mean, residuals = simulate(spec, grads, residuals, state)
        for rank, reply in enumerate(replies):
            got, _, residual = reply[step]
            assert torch.equal(got.reshape(-1), mean), (spec, step, rank)
            assert torch.equal(residual, residuals[rank]), (spec, step, rank)
    assert not torch.equal(replies[0][0][0], replies[0][0][1] / 2 + replies[1][0][1] / 2)  # it did compress


def regression_loss(rank, world, group, error_feedback, steps=40):
    """DP 2 linear regression with top-k 2 %: the final loss over both replicas' data."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8, bias=False)
    tplayers.data_parallel(model, group=group, compress=tplayers.Compression("topk", 0.02, error_feedback))
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    target = torch.randn(8, 32, generator=torch.Generator().manual_seed(7))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        ((model(x) - x @ target.T) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return float(((model.weight.detach() - target) ** 2).mean())


def test_topk_without_error_feedback_does_worse(pool):
    """What error feedback is for: with it, top-k 2 % recovers the weights much better."""
    with_feedback = pool.run(regression_loss, 2, True)[0]
    without = pool.run(regression_loss, 2, False)[0]
    assert with_feedback < 0.5 * without, (with_feedback, without)


@pytest.mark.parametrize("spec", ["int8", "topk:0.1", "powersgd:rank=4"])
def test_compressors_but_bf16_are_refused_at_zero_2_3_naming_the_way_out(pool, spec):
    kind = spec.partition(":")[0]
    for reply in pool.run(refused_compression, 2, spec, 3, return_exceptions=True):
        assert f"compress '{kind}' needs the whole gradient" in str(reply) and "zero_stage=1" in str(reply), reply


@pytest.mark.parametrize(
    ("spec", "message"),
    [("topk:x", "'topk:<fraction>' needs a number, got 'topk:x'"),
     ("powersgd", "'powersgd' needs rank=<r>, got 'powersgd'"),
     ("powersgd:rank=0", "'powersgd' needs rank=<int >= 1>, got 0"),
     ("powersgd:rank=2,begin=3", "takes integers rank and start, got 'powersgd:rank=2,begin=3'"),
     ("powersgd:rank=2.5", "takes integers rank and start")],
)  # fmt: skip
def test_malformed_compressions_are_refused_on_every_rank(pool, spec, message):
    for reply in pool.run(refused_compression, 2, spec, 0, return_exceptions=True):
        assert message in str(reply), reply


def residuals_through_an_overflow(rank, world, group, spec):
    """A step whose gradient is inf on replica 1: every replica's residual (and PowerSGD's Q)
    stays as it was."""
    torch.manual_seed(0)
    model = torch.nn.Linear(24, 40, bias=False)
    tplayers.data_parallel(model, group=group, compress=spec)
    compressor = state_of(model).compressor
    kept = []
    for step in range(3):
        x = torch.randn(5, 24, generator=torch.Generator().manual_seed(100 * step + rank))
        if step == 1 and rank == 1:
            x[0, 0] = float("inf")
        (model(x) ** 2).mean().backward()
        q = compressor.powersgd.q.get(model.weight, torch.zeros(0))
        kept.append(torch.cat([compressor.residuals[model.weight], q.reshape(-1)]))
        model.weight.grad = None
    return kept


@pytest.mark.parametrize("spec", ["int8", "topk:0.1", "powersgd:rank=2"])
def test_an_overflow_leaves_every_residual_as_it_was(pool, spec):
    for before, during, after in pool.run(residuals_through_an_overflow, 2, spec):
        assert torch.equal(before, during) and not torch.equal(during, after)
        assert before.numel() == 960 + (24 * 2 if spec.startswith("powersgd") else 0)


# -- convergence on a small language model --------------------------------------------------------
CONVERGENCE_STEPS = 150


def corpus(seed, steps, batch=4, length=12):
    """Token sequences from a fixed random bigram table (a corpus a tiny model can learn)."""
    g = torch.Generator().manual_seed(1234)
    table = torch.softmax(3 * torch.randn(96, 96, generator=g), -1)
    g.manual_seed(seed)
    tokens = torch.empty(steps, batch, length, dtype=torch.long)
    tokens[..., 0] = torch.randint(3, 96, (steps, batch), generator=g)
    for i in range(1, length):
        tokens[..., i] = torch.multinomial(table[tokens[..., i - 1].flatten()], 1, generator=g).view(steps, batch)
    return tokens


def train_compressed(rank, world, group, spec, seed):
    """DP 2: the mean loss of the last 10 of CONVERGENCE_STEPS AdamW steps, each replica its half."""
    torch.manual_seed(seed)
    model = tiny_model("llama")
    tplayers.data_parallel(model, group=group, compress=spec)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = corpus(seed, CONVERGENCE_STEPS)[:, rank::2]
    losses = [tplayers.train_step(model, opt, [ids], loss_fn).loss for ids in data]
    return sum(losses[-10:]) / 10


# final loss over the uncompressed run's, mean of 3 seeds; measured 0.997 (bf16), 0.998 (int8),
# 1.013 (top-k 10 %; 1 % gives 1.19), 1.021 (PowerSGD rank 4 after 10 whole steps; from the first
# step: rank 4 1.029, rank 2 1.070, rank 1 1.137), kept with about 1-2 % of room
MARGINS = {"bf16": 1.01, "int8": 1.01, "topk:0.1": 1.03, "powersgd:rank=4,start=10": 1.04}


def test_compressed_training_converges_like_uncompressed(pool):
    """A tiny Llama over 150 steps of a bigram corpus, 3 seeds: each compressor's final loss within
    its margin of the uncompressed run's (the mean over seeds), and every run learns."""
    final = {spec: [pool.run(train_compressed, 2, spec, seed)[0] for seed in range(3)] for spec in [None, *MARGINS]}
    base = sum(final[None]) / 3
    start = float(torch.log(torch.tensor(96.0)))
    assert base < 0.8 * start, final
    for spec, margin in MARGINS.items():
        assert sum(final[spec]) / 3 <= margin * base, (spec, final)
