"""The planner on 2-D tensor-parallel grids (`Layout(tp=(r, c))`, `tplayers.plan.grid`): layouts,
rules, per-rank shares by hand, links per axis, and search choosing a grid where it is faster.
What a real grid step sends and holds is checked in tests/test_grid.py and test_plan_validate.py."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tplayers import plan
from tplayers.plan import ClusterSpec, Layout, ModelSpec, estimate, search, validate_layout
from tplayers.plan.estimate import model_state_bytes_per_rank
from tplayers.plan.grid import grid_layer_params, grid_tp_bytes_per_layer
from tplayers.testing.numerics import examples

LLAMA = ModelSpec(layers=4, hidden=256, heads=8, kv_heads=4, head_dim=32, ffn_hidden=704, vocab=1000, seq_len=128)


def test_a_grid_layout_is_its_two_sizes():
    layout = Layout(tp=(4, 2), dp=2)
    assert (layout.tp, layout.tp_grid, layout.num_gpus) == (8, (4, 2), 16)
    assert layout.describe().startswith("tp=4x2 ")
    assert Layout(tp=8, tp_grid=(4, 2)) == layout.__class__(tp_grid=(4, 2), dp=1)  # the same layout
    for bad, message in (((0, 2), "tp_r"), ((2,), "tp_r, tp_c"), ((2, 2, 2), "tp_r, tp_c")):
        with pytest.raises(ValueError, match=message):
            Layout(tp=bad)
    with pytest.raises(ValueError, match="tp=6 is not tp_grid 2 x 2"):
        Layout(tp=6, tp_grid=(2, 2))


def test_what_a_grid_does_not_run_is_refused_by_name():
    cluster = ClusterSpec.preset("h100", num_gpus=16)
    assert not validate_layout(LLAMA, cluster, Layout(tp=(2, 4), pp=2))  # pipelines of a grid model run
    assert not validate_layout(LLAMA, cluster, Layout(tp=(2, 4), dp=2, sequence_parallel=True))  # and sequence sharding
    odd = dataclasses.replace(LLAMA, seq_len=1022)  # the sequence splits over tp_r, any length: 256, 256, 255, 255
    assert not validate_layout(odd, cluster, Layout(tp=(4, 2), dp=2, sequence_parallel=True))
    short = dataclasses.replace(LLAMA, seq_len=3)  # but not fewer tokens than ranks
    assert "seq_len (3) < tp_r (4): a rank holds no token" in " ".join(
        validate_layout(short, cluster, Layout(tp=(4, 2), dp=2, sequence_parallel=True))
    )
    assert "tp_c=16 does not divide 8" in " ".join(validate_layout(LLAMA, cluster, Layout(tp=(1, 16))))
    wide = ModelSpec.preset("llama3-8b")  # 8 kv heads
    assert "kv_heads (8) over tp_r = 16 leave a rank none" in " ".join(
        validate_layout(wide, ClusterSpec.preset("h100", num_gpus=32), Layout(tp=(16, 2)))
    )
    gpt = ModelSpec.preset("gpt3-175b")
    assert "Llama-style" in " ".join(validate_layout(gpt, ClusterSpec.preset("h100", num_gpus=4), Layout(tp=(2, 2))))
    with pytest.raises(ValueError, match="invalid layout tp=1x16"):
        estimate(LLAMA, cluster, Layout(tp=(1, 16)))


def test_a_rank_of_the_grid_holds_its_block_of_every_weight():
    """Rank (i, j) of 2 x 2: q / k / v / o and the MLP over both axes, norms over tp_c, the
    vocabulary over all 4 (by hand)."""
    h, q, kv, f = 256, 256, 128, 704
    expected_layer = (q // 2) * (h // 2) + 2 * (kv // 2) * (h // 2) + (h // 2) * (q // 2)
    expected_layer += 3 * (f // 2) * (h // 2) + 2 * (h // 2)
    assert grid_layer_params(LLAMA, (2, 2)) == expected_layer
    layout = Layout(tp=(2, 2))
    ((params, _, _),) = model_state_bytes_per_rank(LLAMA, layout, "fp32-adam")
    assert params == 4 * (4 * expected_layer + 2 * 250 * h + h)  # untied: embedding and LM head rows
    total = sum(model_state_bytes_per_rank(LLAMA, layout, "fp32-adam", tp_rank=t)[0][0] for t in range(4))
    # every linear weight once over the grid; the blocks' norms on both rows, the final one on every rank
    assert total == 4 * (LLAMA.num_params + 2 * LLAMA.layers * h + 3 * h)


def test_uneven_grids_price_the_most_loaded_rank():
    odd = ModelSpec(layers=2, hidden=250, heads=10, kv_heads=5, head_dim=25, ffn_hidden=677, vocab=1001, seq_len=64)
    shares = [grid_layer_params(odd, (5, 3), t) for t in range(15)]
    assert shares[0] == max(shares) > min(shares)
    est = estimate(odd, ClusterSpec.preset("h100", num_gpus=15, gpus_per_node=16), Layout(tp=(5, 3)))
    assert est.tp_imbalance == pytest.approx(max(shares) * 15 / sum(shares))
    assert any("uneven tensor-parallel split" in n and "5x3" in n for n in est.notes)


def test_each_axis_runs_on_its_own_link():
    """4 x 4 on 8-GPU nodes: tp_c (4 consecutive ranks) inside a node, tp_r (4 ranks 4 apart)
    across two; each axis' bytes timed on its link."""
    model = ModelSpec.preset("llama3-70b", seq_len=1024)
    cluster = ClusterSpec.preset("h100-80gb", num_gpus=64)
    est = estimate(model, cluster, Layout(tp=(4, 4), dp=4, zero_stage=3, num_microbatches=4, recompute="full"))
    assert est.comm_links["tp_c"] == "intra_node" and est.comm_links["tp_r"] == "inter_node"
    axes = est.comm_bytes_by_axis
    assert sum(axes.values()) == pytest.approx(est.comm_bytes_by_group["tp"])
    assert est.comm_bytes["intra_node"] == pytest.approx(axes["tp_c"])
    seconds = sum(axes[a] / (cluster.intra_node_bandwidth if est.comm_links[a] == "intra_node"
                             else cluster.inter_node_bandwidth) for a in axes)  # fmt: skip
    assert est.time_breakdown["tp"] == pytest.approx(seconds)
    inside = estimate(model, ClusterSpec.preset("h100-80gb", num_gpus=8), Layout(tp=(4, 2), num_microbatches=4))
    assert {inside.comm_links[a] for a in ("tp_r", "tp_c", "tp_all")} == {"intra_node"}


def test_the_layer_bytes_per_axis_by_hand():
    """2 x 4, T = 256 tokens, 2-byte activations: tp_c carries q, k, v, gate|up forward and o's,
    down's input gradients backward (their tp_r shares) plus four T-value norm sums; tp_r the
    row-type outputs and the column-type input gradients (T x h / 4 each, four of them)."""
    t, d = 2 * LLAMA.seq_len, 2
    q, kv, f, h = 256 // 2, 128 // 2, 704 // 2, 256 // 4
    over_c = t * (q + 2 * kv + 2 * f + q + f) * d + 4 * t * 4
    over_r = 4 * t * h * d
    got = grid_tp_bytes_per_layer(LLAMA, 2, 2, 4, d)
    assert got == {"tp_r": 2 * 1 / 2 * over_r, "tp_c": 2 * 3 / 4 * over_c}
    full = grid_tp_bytes_per_layer(LLAMA, 2, 2, 4, d, recompute="full")  # the forward's again
    assert full["tp_r"] == pytest.approx(2 * 1 / 2 * (over_r + 2 * t * h * d))
    # sequence sharding over tp_r: reduce-scatter + all-gather in place of each all-reduce (the same
    # bytes), the norm sums over half the tokens, and the two norms' fp32 weight gradients over tp_r
    sp = grid_tp_bytes_per_layer(LLAMA, 2, 2, 4, d, sequence_parallel=True, grad_bytes=4)
    assert sp["tp_r"] == pytest.approx(2 * 1 / 2 * (over_r + 2 * h * 4))
    assert sp["tp_c"] == pytest.approx(2 * 3 / 4 * (over_c - 4 * t / 2 * 4))


def test_search_chooses_a_grid_where_it_is_faster():
    """Llama-3-70B at 1,024 tokens on 64 H100s: a 4 x 2 grid beats every 1-D layout (the
    attention core it repeats is small at this length); at 8,192 tokens it is 1-D again."""
    cluster = ClusterSpec.preset("h100-80gb", num_gpus=64)
    options = dict(micro_batches=(1, 2, 4), schedules=("1f1b",))
    short = search(ModelSpec.preset("llama3-70b", seq_len=1024), cluster, 64, "bf16-adam", **options)
    assert short[0][0].tp_grid is not None
    best_line = next(est for layout, est in short if not layout.tp_grid)
    assert short[0][1].step_time_s < best_line.step_time_s
    long = search(ModelSpec.preset("llama3-70b"), cluster, 64, "bf16-adam", **options)
    assert long[0][0].tp_grid is None and any(layout.tp_grid for layout, _ in long)
    only = search(ModelSpec.preset("llama3-70b", seq_len=1024), cluster, 64, "bf16-adam", tp_grids=[(4, 2)], **options)
    assert {layout.tp_grid for layout, _ in only} <= {None, (4, 2)}
    assert {layout.tp_grid for layout, _ in search(LLAMA, cluster, 64, tp_sizes=(8,), **options)} == {None}


@settings(max_examples=examples(40), deadline=None)
@given(
    r=st.sampled_from([1, 2, 4]), c=st.sampled_from([1, 2, 4, 8]), dp=st.sampled_from([1, 2, 4]),
    zero=st.integers(0, 3),
    recompute=st.sampled_from(plan.RECOMPUTE_CHOICES), mb=st.integers(1, 4),
)  # fmt: skip
def test_grid_estimates_are_finite_and_consistent(r, c, dp, zero, recompute, mb):
    cluster = ClusterSpec.preset("a100-80gb", num_gpus=r * c * dp)
    layout = Layout(tp=(r, c), dp=dp, zero_stage=zero if dp > 1 else 0, recompute=recompute, micro_batch=mb)
    est = estimate(LLAMA, cluster, layout)
    assert est.valid and est.step_time_s > 0 and est.memory.total > 0
    assert sum(est.comm_bytes.values()) == pytest.approx(sum(v for v in est.comm_bytes_by_group.values()))
    if r * c > 1:
        assert est.hardware_flops >= est.model_flops  # the repeated attention core counts


def test_pipeline_stages_of_a_grid_by_hand():
    """2 x 2 x PP 2: each stage half the layers' blocks, the embedding rows on the first, the LM
    head rows and final norm on the last; the stages send the tp_c share of the residual; the
    entry gather on the first stage, the exit gather on the last."""
    cluster = ClusterSpec.preset("h100", num_gpus=8)
    one = estimate(LLAMA, ClusterSpec.preset("h100", num_gpus=4), Layout(tp=(2, 2), num_microbatches=2))
    two = estimate(LLAMA, cluster, Layout(tp=(2, 2), pp=2, num_microbatches=2))
    first, last = two.stages
    h, rows = LLAMA.hidden, 1000 // 4
    layer = grid_layer_params(LLAMA, (2, 2))
    assert first.num_params == 2 * layer + rows * h and last.num_params == 2 * layer + h + rows * h
    assert one.stages[0].num_params == first.num_params + last.num_params
    t = LLAMA.seq_len  # micro_batch 1
    assert first.comm_bytes_by_group["pp"] == 2 * t * (h // 2) * 2  # 2 micro-batches, bf16, h / c each
    tp_total = first.comm_bytes_by_group["tp"] + last.comm_bytes_by_group["tp"]
    assert tp_total == pytest.approx(one.comm_bytes_by_group["tp"])  # the same collectives, split by stage
