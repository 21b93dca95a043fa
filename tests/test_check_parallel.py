"""tplayers.testing.check_parallel: negative controls (a wrong shard, a missing gradient
all-reduce, a double-counted replicated gradient, a bug only at TP 3 that hypothesis shrinks to),
ranks that raise or hang, the strategies, and the harness on HF models, SP, ZeRO and pipelines."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from torch import nn

import tplayers
from tplayers.plan import Layout
from tplayers.testing import ParallelMismatch, WorkerPool, check_parallel, examples
from tplayers.testing import strategies as tst

pytestmark = pytest.mark.tplayers

HIDDEN, FFN = 8, 24  # FFN divisible by TP 1-4


def block():
    return nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))


def stem_and_block():
    """A replicated first layer feeding the block: its gradient needs the column layer's all-reduce."""
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))


def shard_block(model, mesh, layout):
    sp = layout.sequence_parallel
    model[0] = tplayers.ColumnParallelLinear.from_linear(model[0], group=mesh["tp"], sequence_parallel=sp)
    model[2] = tplayers.RowParallelLinear.from_linear(model[2], group=mesh["tp"], sequence_parallel=sp)
    return tplayers.data_parallel(model, group=mesh["dp"], zero_stage=layout.zero_stage)


def wrong_shard(model, mesh):
    """The column layer gets its neighbour's rows."""
    rows = FFN // mesh["tp"].size()
    with torch.no_grad():
        model[0].weight.copy_(model[0].weight.roll(rows, 0))
    model[0] = tplayers.ColumnParallelLinear.from_linear(model[0], group=mesh["tp"])
    model[2] = tplayers.RowParallelLinear.from_linear(model[2], group=mesh["tp"])
    return model


def missing_all_reduce(model, mesh):
    """The column layer's input gradient is left as this rank's partial sum, and nothing sums it:
    the replicated stem's gradient misses the other ranks' parts."""
    model[1] = tplayers.ColumnParallelLinear.from_linear(model[1], group=mesh["tp"], reduce_input_grad=False)
    model[3] = tplayers.RowParallelLinear.from_linear(model[3], group=mesh["tp"])
    return model


def _sum_over_tp(group):
    def hook(param):
        dist.all_reduce(param.grad, group=group)

    return hook


def double_counted(model, mesh):
    """The row layer's replicated bias gradient (already whole on every rank) is summed again."""
    model[0] = tplayers.ColumnParallelLinear.from_linear(model[0], group=mesh["tp"])
    model[2] = tplayers.RowParallelLinear.from_linear(model[2], group=mesh["tp"])
    model[2].bias.register_post_accumulate_grad_hook(_sum_over_tp(mesh["tp"].get_group()))
    return model


def wrong_at_tp3(model, mesh, layout):
    return wrong_shard(model, mesh) if layout.tp == 3 else shard_block(model, mesh, layout)


X = torch.randn(4, 6, HIDDEN, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("build", "parallelize", "said"),
    [
        (
            block,
            wrong_shard,
            r"parameter '0\.weight'\[0:12, 0:8\] of \(24, 8\) \(Shard\(0\) over TP \(2 ranks\)\) "
            r"after parallelize \(at Layout\(tp=2",
        ),
        (
            stem_and_block,
            missing_all_reduce,
            r"gradient of '0\.weight'\[0:8, 0:8\] of \(8, 8\) \(replicated\) at step 0 \(at Layout\(tp=2",
        ),
        (block, double_counted, r"gradient of '2\.bias'\[0:8\] of \(8,\) \(replicated\) at step 0 \(at Layout\(tp=2"),
    ],
    ids=["wrong-shard", "missing-all-reduce", "double-counted"],
)
def test_negative_controls_name_the_parameter_and_the_layout(build, parallelize, said):
    with pytest.raises(AssertionError, match="check_parallel: ") as error:  # as users' negative controls write it
        check_parallel(build, parallelize, X, layouts=[Layout(tp=2)])
    assert isinstance(error.value, ParallelMismatch) and set(error.value.reports) <= {0, 1}
    assert re.search(said, str(error.value)), str(error.value)[:2000]
    assert "largest error" in str(error.value)


def test_hypothesis_shrinks_a_bug_at_tp3_to_tp3():
    def fails(layout):
        try:
            check_parallel(block, wrong_at_tp3, X, layouts=[layout])
        except AssertionError:
            return True
        return False

    strategy = tst.layouts(max_world=8, tp=(1, 2, 3, 4), dp=(1, 2), zero_stages=(0, 3))
    smallest = find(strategy, fails, settings=settings(max_examples=30, database=None, derandomize=True))
    assert smallest == Layout(tp=3), smallest


@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=tst.layouts(max_world=8, tp=(1, 2, 3, 4), dp=(1, 2), sequence_parallel=(False, True), seq_len=7),
    steps=st.integers(1, 2),
)
def test_tplayers_layers_at_drawn_layouts(layout, steps):
    """The harness over drawn layouts: TP 1-4, DP with every ZeRO stage, SP (activations split
    along the sequence at the block's boundary: 7 tokens, in parts of different lengths past TP 1)."""
    x = torch.randn(4, 7, HIDDEN, generator=torch.Generator().manual_seed(steps))
    check_parallel(block, shard_block, x, layouts=[layout], steps=steps, shard_sequence=True)


def test_sequence_parallel_over_lengths_tp_does_not_divide():
    """7 tokens over TP 3 (3, 2, 2 as torch.tensor_split cuts them) and TP 4 with DP 2 (2, 2, 2, 1):
    the layers run inside `sequence_split`, each rank's mean weighted by its part's share."""
    x = torch.randn(4, 7, HIDDEN, generator=torch.Generator().manual_seed(3))
    layouts = [Layout(tp=3, sequence_parallel=True), Layout(tp=4, dp=2, zero_stage=3, sequence_parallel=True)]
    check_parallel(block, shard_block, x, layouts=layouts, steps=2, shard_sequence=True)


def shard_inputs(shard, shards, step):
    """Each replica's own data (a data loader's shard), and a target."""
    g = torch.Generator().manual_seed(100 * step + shard)
    return torch.randn(2, 6, HIDDEN, generator=g), torch.randn(2, 6, HIDDEN, generator=g)


def test_inputs_as_data_shards_with_targets():
    check_parallel(block, shard_block, shard_inputs, layouts=[Layout(tp=2, dp=2, zero_stage=2), Layout(tp=1)], steps=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_models_and_inputs(dtype):
    check_parallel(block, shard_block, shard_inputs, layouts=[Layout(tp=2), Layout(tp=2, dp=2, zero_stage=3)],
                   dtype=dtype)  # fmt: skip


def raise_on_rank_1(model, mesh):
    if dist.get_rank() == 1:
        raise RuntimeError("the user's code failed here")
    return model


def hang_on_rank_1(model, mesh):
    if dist.get_rank() == 1:
        time.sleep(3600)
    return model


def test_a_rank_that_raises_shows_its_traceback():
    start = time.monotonic()
    with pytest.raises(tplayers.distributed.RankError, match="the user's code failed here") as error:
        check_parallel(block, raise_on_rank_1, X, layouts=[Layout(tp=2)])
    assert not isinstance(error.value, AssertionError)  # the user's error is not a mismatch
    assert "raise_on_rank_1" in str(error.value) and time.monotonic() - start < 15


def test_a_rank_that_hangs_fails_in_seconds_with_its_stack():
    with WorkerPool(world_size=2) as pool:  # its own pool: a hang restarts the pool
        start = time.monotonic()
        with pytest.raises(TimeoutError) as error:
            check_parallel(block, hang_on_rank_1, X, layouts=[Layout(tp=2)], pool=pool, timeout_s=3)
    assert time.monotonic() - start < 15
    message = str(error.value)
    assert "check_parallel at Layout(tp=2" in message and "--- rank 1 ---" in message
    assert re.search(r"in hang_on_rank_1", message), message[-3000:]


def test_unpicklable_functions_are_refused_before_any_rank_runs():
    with pytest.raises(TypeError, match="module-level function"):
        check_parallel(lambda: block(), shard_block, X, layouts=[Layout(tp=2)])


# ---- the strategies ----------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(layout=tst.layouts(max_world=8, tp=(1, 2, 3, 4), pp=(1, 2), dp=(1, 2), divides=(12,), seq_len=3, layers=2,
                          sequence_parallel=(False, True)))  # fmt: skip
def test_drawn_layouts_respect_world_and_divisibility(layout):
    assert layout.tp * layout.pp * layout.dp <= 8 and 12 % layout.tp == 0 and layout.pp <= 2
    assert layout.zero_stage == 0 or layout.dp > 1
    assert layout.pp == 1 or layout.zero_stage in (0, 2, 3)
    assert not layout.sequence_parallel or 1 < layout.tp <= 3  # a token per rank of 3


@settings(max_examples=30, deadline=None)
@given(shape=tst.shapes(3, multiples={0: 2, 1: 3}, max_side=12), t=tst.integer_tensors((3, 4)), dtype=tst.dtypes())
def test_shapes_tensors_and_dtypes(shape, t, dtype):
    assert shape[0] % 2 == 0 and shape[1] % 3 == 0 and all(1 <= s <= 12 for s in shape)
    assert torch.equal(t, t.round()) and t.abs().max() <= 3
    assert dtype in (torch.float32, torch.float16, torch.bfloat16)


# ---- HF models: parallelize, ZeRO and pipeline stages through the harness ------------------------


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(cfg)


def tp_of(mesh):
    """The tensor-parallel part of a harness mesh: "tp", or the grid ("tp_r", "tp_c")."""
    return mesh["tp_r", "tp_c"] if "tp_r" in mesh.mesh_dim_names else mesh["tp"]


def hf_parallelize(model, mesh, layout):
    tplayers.parallelize(model, group=tp_of(mesh), sequence_parallel=layout.sequence_parallel, verify=False)
    if layout.pp > 1:
        stages = tplayers.pipeline_split(model, group=mesh["pp"])
        if layout.dp > 1:
            for stage in stages:
                tplayers.data_parallel(stage.module, group=mesh["dp"], zero_stage=layout.zero_stage)
        return stages
    return tplayers.data_parallel(model, group=mesh["dp"], zero_stage=layout.zero_stage)


IDS = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "layout",
    [
        Layout(tp=2),
        Layout(tp=4, sequence_parallel=True),
        Layout(tp=2, dp=2, zero_stage=3),
        Layout(tp=2, pp=2),
        Layout(tp=2, pp=2, dp=2, zero_stage=2),
    ],
    ids=lambda layout: (
        f"tp{layout.tp}-pp{layout.pp}-dp{layout.dp}-z{layout.zero_stage}" + ("-sp" if layout.sequence_parallel else "")
    ),
)
def test_hf_llama_through_the_harness(layout):
    check_parallel(tiny_llama, hf_parallelize, IDS, layouts=[layout], steps=2, optimizer=torch.optim.AdamW,
                   optimizer_kwargs={"lr": 1e-2})  # fmt: skip


def gpt2_dropout(attention=0.0):
    """GPT-2 with dropout on its embeddings and residuals (whole on every rank), and on its attention
    probabilities (over each rank's heads) at `attention`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_embd=24, n_layer=2, n_head=3, n_positions=16, embd_pdrop=0.2, resid_pdrop=0.2,
                     attn_pdrop=attention)  # fmt: skip
    return GPT2LMHeadModel(cfg)


def gpt2_attention_dropout():
    return gpt2_dropout(attention=0.2)


def test_dropout_draws_the_unsharded_masks_where_tensors_are_whole():
    """Both steps draw from one generator state: exact at TP 2 and 3 (before, the parallel step drew
    from where the reference's had left the generator, and failed)."""
    check_parallel(gpt2_dropout, hf_parallelize, IDS, layouts=[Layout(tp=2), Layout(tp=3)], steps=2)


@pytest.mark.parametrize(
    "build, layout",
    [(gpt2_attention_dropout, Layout(tp=3)), (gpt2_dropout, Layout(tp=2, sequence_parallel=True))],
    ids=["heads", "sp"],
)
def test_dropout_over_a_ranks_heads_or_part_of_the_sequence_fails_saying_why(build, layout):
    with pytest.raises(ParallelMismatch, match="each rank its own over its heads, columns or part of the sequence"):
        check_parallel(build, hf_parallelize, IDS, layouts=[layout])


def test_dropout_under_data_parallelism_is_refused_naming_the_fix():
    with pytest.raises(Exception, match="set the model's dropout rates to 0, or check with dp = pp = cp = 1"):
        check_parallel(gpt2_dropout, hf_parallelize, IDS, layouts=[Layout(tp=2, dp=2)])


@settings(max_examples=examples(3), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=tst.layouts(max_world=4, tp=(), grids=((1, 2), (2, 1), (2, 2)), dp=(1, 2), zero_stages=(0, 3),
                          sequence_parallel=(False, True), seq_len=IDS.shape[1]))  # fmt: skip
def test_hf_llama_on_drawn_grids_through_the_harness(layout):
    """2-D tensor parallelism (tp_r x tp_c), alone and under ZeRO over replicas, with and without
    the sequence split over tp_r."""
    assert layout.tp_grid is not None and layout.pp == 1
    check_parallel(tiny_llama, hf_parallelize, IDS, layouts=[layout], steps=2, optimizer=torch.optim.AdamW,
                   optimizer_kwargs={"lr": 1e-2})  # fmt: skip


@pytest.mark.parametrize("layout", [Layout(tp=(1, 2), pp=2), Layout(tp=(2, 1), pp=2, sequence_parallel=True)],
                         ids=["1x2-pp2", "2x1-pp2-sp"])  # fmt: skip
def test_hf_llama_pipeline_stages_of_a_grid_through_the_harness(layout):
    """pipeline_split of a grid model: the stages send the tp_c share of the residual stream (and
    the tp_r share of the sequence under sequence parallelism)."""
    check_parallel(tiny_llama, hf_parallelize, IDS, layouts=[layout], steps=2, optimizer=torch.optim.AdamW,
                   optimizer_kwargs={"lr": 1e-2})  # fmt: skip


def _summed_over_tp_c(model, mesh):
    """A grid whose o_proj weight gradients are summed over tp_c, the axis they are not partial over."""
    hf_parallelize(model, mesh, Layout(tp=(2, 2)))
    group = mesh["tp_c"].get_group()
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.register_post_accumulate_grad_hook(_sum_over_tp(group))
    return model


def test_a_gradient_summed_over_the_wrong_grid_axis_fails():
    with pytest.raises(
        ParallelMismatch, match=r"gradient of 'model\.layers\.0\.self_attn\.o_proj\.weight'.*tp=\(2, 2\)"
    ):
        check_parallel(tiny_llama, _summed_over_tp_c, IDS, layouts=[Layout(tp=(2, 2))])


def test_pool_world_comes_from_the_environment():
    from tplayers.testing import plugin

    assert plugin.pool_world() == int(os.environ.get(plugin.POOL_WORLD_ENV, "8"))


def test_the_plugin_is_installed_and_its_pool_serves(tplayers_pool):
    from importlib.metadata import entry_points

    from tplayers.testing import plugin

    assert any(ep.value == "tplayers.testing.plugin" for ep in entry_points(group="pytest11"))
    assert tplayers_pool is plugin.session_pool(2) and tplayers_pool.world_size == plugin.pool_world()
    assert tplayers_pool.run(_rank_and_world, 3) == [(0, 3), (1, 3), (2, 3)]


def _rank_and_world(rank, world, group):
    return rank, dist.get_world_size(group)
