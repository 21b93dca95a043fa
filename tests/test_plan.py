"""tplayers.plan: each published formula on hand-computed cases, validation, search, invariants."""

import csv
import io
import json
import math
import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tplayers.data_parallel.compress import Compression
from tplayers.plan import (
    ESTIMATE_FIELDS,
    Assumptions,
    ClusterSpec,
    Layout,
    ModelSpec,
    Precision,
    all_gather_bytes,
    all_reduce_bytes,
    bubble_fraction,
    count_params,
    dp_bytes_per_step,
    estimate,
    estimate_to_dict,
    format_estimate,
    format_ranking,
    group_link,
    layer_activation_bytes,
    microbatches_in_flight,
    model_state_bytes,
    reduce_scatter_bytes,
    search,
    tp_bytes_per_layer,
    training_flops,
    validate_layout,
)
from tplayers.plan.comm import compressed_mean_bytes
from tplayers.testing.numerics import examples

GB = 1e9


def tiny_gqa(**kw):
    """2 layers, h=64, 8 heads of 8 (q_dim = 64), 2 kv heads, SwiGLU 160, no dropout."""
    spec = dict(layers=2, hidden=64, heads=8, kv_heads=2, ffn_hidden=160, vocab=256, seq_len=16, dropout=False)
    return ModelSpec(**{**spec, **kw})


# ---------------------------------------------------------------------------- parameter counts


@pytest.mark.parametrize(
    "name, expected",
    [
        # HuggingFace's counts of the released checkpoints.
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
        ("llama3-405b", 405_853_388_800),
        ("llama2-7b", 6_738_415_616),
    ],
)
def test_llama_preset_param_counts_exact(name, expected):
    assert ModelSpec.preset(name).num_params == expected


def test_gpt3_param_count():
    model = ModelSpec.preset("gpt3-175b")
    L, h, v, s = 96, 12288, 50257, 2048
    # Narayanan et al. 2021 Sec. 5.1: 12lh^2 + 13lh + (V + s)h, plus the final LayerNorm (2h).
    assert model.num_params == 12 * L * h**2 + 13 * L * h + (v + s) * h + 2 * h
    assert model.num_params == pytest.approx(174.6e9, rel=1e-3)


def test_count_params_by_hand():
    counts = count_params(tiny_gqa())
    # q, o: 64*64 each; k, v: 64*(2*8) each; SwiGLU: 3*64*160; two RMSNorms: 2*64.
    assert counts.per_layer == 2 * 4096 + 2 * 1024 + 3 * 64 * 160 + 2 * 64
    assert counts.embedding == counts.lm_head == 256 * 64
    assert counts.total == 2 * counts.per_layer + 2 * 256 * 64 + 64
    tied = count_params(tiny_gqa(tied_embeddings=True))
    assert tied.lm_head == 0 and tied.total == counts.total - 256 * 64


def test_default_ffn_width():
    assert ModelSpec(layers=1, hidden=4096, heads=32, vocab=8, seq_len=8, gated_mlp=False).ffn_hidden == 16384
    assert ModelSpec(layers=1, hidden=4096, heads=32, vocab=8, seq_len=8).ffn_hidden == 11008  # Llama-2 7B


# ---------------------------------------------------------------------------- model states (ZeRO)


def test_one_billion_params_sixteen_and_twenty_gb():
    cluster = ClusterSpec.preset("a100-80gb", num_gpus=1)
    model = ModelSpec(num_params=1e9)
    est = estimate(model, cluster, Layout())
    assert est.memory.total == pytest.approx(16 * GB)
    assert (est.memory.params, est.memory.grads, est.memory.optimizer) == (2 * GB, 2 * GB, 12 * GB)
    assert est.memory.activations is None and est.fits
    fp32_grads = estimate(model, cluster, Layout(), Precision.preset("mixed-adam-fp32-grads"))
    assert fp32_grads.memory.total == pytest.approx(20 * GB)
    assert sum(model_state_bytes(1e9, Precision.preset("fp32-adam"))) == pytest.approx(16 * GB)


@pytest.mark.parametrize(
    "stage, exact_gb, paper_gb", [(0, 120, 120), (1, 31.40625, 31.4), (2, 16.640625, 16.6), (3, 1.875, 1.9)]
)
def test_zero_paper_figure_1(stage, exact_gb, paper_gb):
    """Rajbhandari et al. 2020, Figure 1: psi = 7.5B, N_d = 64, K = 12 (the figure rounds to 0.1 GB)."""
    total = sum(model_state_bytes(7.5e9, zero_stage=stage, dp=64)) / GB
    assert total == pytest.approx(exact_gb) and round(total, 1) == paper_gb
    cluster = ClusterSpec.preset("a100-80gb", num_gpus=64)
    est = estimate(ModelSpec(num_params=7.5e9), cluster, Layout(dp=64, zero_stage=stage))
    assert est.memory.total / GB == pytest.approx(exact_gb)


def test_stage_params_sum_to_model():
    """tp = 1: the stages' parameters add up to the model (vocab already a multiple of 128)."""
    model = ModelSpec(layers=8, hidden=64, heads=4, vocab=512, seq_len=32)
    cluster = ClusterSpec.preset("h100", num_gpus=4)
    est = estimate(model, cluster, Layout(pp=4, num_microbatches=4))
    assert sum(s.num_params for s in est.stages) == model.num_params
    # Stage 0 holds the embedding, the last stage the final norm and LM head.
    layer = count_params(model).per_layer
    assert est.stages[0].num_params == 2 * layer + 512 * 64
    assert est.stages[1].num_params == 2 * layer
    assert est.stages[3].num_params == 2 * layer + 64 + 512 * 64


def test_vocab_padded_to_multiple_of_128_tp():
    model = tiny_gqa(vocab=1000)
    cluster = ClusterSpec.preset("h100", num_gpus=2)
    est = estimate(model, cluster, Layout(tp=2))
    layer = count_params(model).per_layer
    # 1000 -> 1024 (multiple of 128*2), embedding and LM head split over 2 ranks.
    per_gpu_layer_sharded = (2 * 4096 + 2 * 1024 + 3 * 64 * 160) / 2 + 2 * 64
    assert layer - 2 * 64 == 2 * (per_gpu_layer_sharded - 2 * 64)
    assert est.stages[0].num_params == 2 * per_gpu_layer_sharded + 2 * 1024 * 64 / 2 + 64


# ---------------------------------------------------------------------------- activations


def gpt(**kw):
    return ModelSpec.preset("gpt3-175b", **kw)


@pytest.mark.parametrize("b", [1, 4])
def test_korthikanti_table_2(b):
    """Korthikanti et al. 2022, Table 2, GPT-3 175B dims (s=2048, h=12288, a=96), t=8."""
    model = gpt()
    s, h, a, t = 2048, 12288, 96, 8
    sbh = s * b * h

    def act(**kw):
        return layer_activation_bytes(model, b, **kw)

    assert act() == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)
    assert act(tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert act(tp=t, sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h), rel=1e-12)
    assert act(tp=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)
    assert act(tp=t, sequence_parallel=True, recompute="selective") == pytest.approx(sbh * 34 / t, rel=1e-12)
    assert act(recompute="full") == 2 * sbh
    assert act(tp=t, sequence_parallel=True, recompute="full") == 2 * sbh / t


def test_activation_gqa_gated_by_hand():
    model = tiny_gqa()  # s=16, h=64, 8 heads, 2 kv heads of 8, SwiGLU 160, no dropout
    s, b, h, d = 16, 2, 64, 2
    outside = 4 * d * s * b * h  # two norm inputs, QKV input, MLP input
    inside = d * s * b * (64 // 2 + 64 // 2 + 2 * 8 + 3 * 160 // 2)  # Q, attn out, K+V (1 kv head), gate/up/act
    core = d * (8 // 2) * s * s * b  # softmax output of the 4 local heads
    assert layer_activation_bytes(model, b, tp=2) == outside + inside + core
    assert layer_activation_bytes(model, b, tp=2, recompute="selective") == outside + inside
    assert layer_activation_bytes(model, b, tp=2, sequence_parallel=True) == outside / 2 + inside + core
    # tp = 4 > 2 kv heads: each rank keeps one whole kv head.
    inside4 = d * s * b * (2 * 64 // 4 + 2 * 8 + 3 * 160 // 4)
    assert layer_activation_bytes(model, b, tp=4, recompute="selective") == outside + inside4


def test_pipeline_microbatches_in_flight():
    p, m, v = 4, 16, 2
    assert microbatches_in_flight("gpipe", 0, p, m) == m
    assert [microbatches_in_flight("1f1b", i, p, m) for i in range(p)] == [4, 3, 2, 1]
    assert microbatches_in_flight("1f1b", 0, p, 2) == 2
    # Korthikanti Sec. 4.2.3: stage 0 holds L * (1 + (p - 1)/(p v)) layers -> p * (1 + (p-1)/(p v)) stages' worth.
    assert microbatches_in_flight("interleaved", 0, p, m, v) == pytest.approx(p * (1 + (p - 1) / (p * v)))


@pytest.mark.parametrize("schedule, expected_layers", [("1f1b", 8), ("gpipe", 2 * 8), ("interleaved", 8 * 1.375)])
def test_first_stage_activations_per_schedule(schedule, expected_layers):
    """1F1B: stage 0 holds all L = 8 layers' worth; GPipe all m = 8 micro-batches of 2 layers;
    interleaved (p = 4, v = 2): L * (1 + 3/8)."""
    model = tiny_gqa(layers=8)
    cluster = ClusterSpec.preset("h100", num_gpus=4)
    v = 2 if schedule == "interleaved" else 1
    est = estimate(model, cluster, Layout(pp=4, num_microbatches=8, schedule=schedule, virtual_stages=v))
    per_layer = layer_activation_bytes(model, 1)
    assert est.stages[0].memory.activations == pytest.approx(expected_layers * per_layer)


def test_output_layer_activations():
    """Korthikanti Sec. 4.3: the last stage adds 4*s*b*h/t*(1 + V/h) with SP (fp32 logits)."""
    model = tiny_gqa(layers=2, vocab=512)
    cluster = ClusterSpec.preset("h100", num_gpus=4)
    est = estimate(model, cluster, Layout(tp=2, pp=2, num_microbatches=1, sequence_parallel=True))
    s, h, t, v = 16, 64, 2, 512
    last = est.stages[1].memory.activations
    assert last == pytest.approx(
        layer_activation_bytes(model, 1, tp=t, sequence_parallel=True) + 4 * s * h / t * (1 + v / h)
    )


def test_recompute_transient_layer_counted_once():
    """Full recompute: 4 stored layer inputs, one of which is rematerialised into the whole
    layer's activations during its backward; plus the output layer (norm and projection input,
    fp32 logits)."""
    model = tiny_gqa(layers=4)
    cluster = ClusterSpec.preset("h100", num_gpus=1)
    est = estimate(model, cluster, Layout(recompute="full"))
    logits = 2 * 2 * 16 * 64 + 4 * 16 * 256
    expected = 3 * layer_activation_bytes(model, recompute="full") + layer_activation_bytes(model) + logits
    assert est.memory.activations == pytest.approx(expected)


# ---------------------------------------------------------------------------- FLOPs and MFU


def test_narayanan_eq_3():
    """Narayanan et al. 2021 eq. 3 (full recompute) and its 3-pass form, GPT-3 with V = 51200."""
    model = gpt(vocab=51200)
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    eq3 = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    no_recompute = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert training_flops(model, B, "full") == pytest.approx(eq3, rel=1e-12)
    assert training_flops(model, B) == pytest.approx(no_recompute, rel=1e-12)
    # Through estimate: 51200 is a multiple of 128 * 8, so hardware FLOPs use the same V.
    cluster = ClusterSpec.preset("a100-80gb", num_gpus=256)
    layout = Layout(tp=8, pp=8, dp=4, num_microbatches=384, recompute="full", sequence_parallel=True)
    est = estimate(model, cluster, layout)
    assert est.valid
    assert est.model_flops == pytest.approx(no_recompute, rel=1e-12)
    assert est.hardware_flops == pytest.approx(eq3, rel=1e-12)


def test_selective_recompute_adds_attention_core_only():
    model = gpt(vocab=51200)
    B, s, L, h = 8, 2048, 96, 12288
    extra = training_flops(model, B, "selective") - training_flops(model, B)
    assert extra == pytest.approx(B * s * L * 4 * s * h, rel=1e-12)  # QK^T and AV: 2*s*h each per token


def test_mfu_definition():
    model = ModelSpec.preset("llama3-8b")
    cluster = ClusterSpec.preset("h100", num_gpus=8)
    est = estimate(model, cluster, Layout(tp=8, num_microbatches=4, sequence_parallel=True, recompute="selective"))
    assert est.mfu == pytest.approx(est.model_flops / (est.step_time_s * 8 * 989e12))
    assert est.step_time_s == pytest.approx(sum(est.time_breakdown.values()))
    assert 0 < est.mfu < Assumptions().compute_efficiency
    assert est.hardware_flops > est.model_flops


# ---------------------------------------------------------------------------- bubble and communication


def test_bubble_fraction():
    assert bubble_fraction(4, 8) == 3 / 8
    assert bubble_fraction(4, 8, "gpipe") == 3 / 8
    assert bubble_fraction(4, 8, "interleaved", 2) == 3 / 16
    assert bubble_fraction(1, 8) == 0
    model = tiny_gqa(layers=8)
    cluster = ClusterSpec.preset("h100", num_gpus=4)
    est = estimate(model, cluster, Layout(pp=4, num_microbatches=8, schedule="interleaved", virtual_stages=2))
    assert est.bubble_fraction == 3 / 16
    t = est.time_breakdown
    ideal = t["compute"] + t["tp"] + t["pp"]  # bubble / ideal, not bubble / total
    assert t["bubble"] == pytest.approx(3 / 16 * ideal)


def test_ring_costs():
    assert all_reduce_bytes(8e9, 4) == 2 * 3 / 4 * 8e9
    assert all_gather_bytes(8e9, 4) == reduce_scatter_bytes(8e9, 4) == 3 / 4 * 8e9
    assert all_reduce_bytes(8e9, 1) == all_gather_bytes(8e9, 1) == 0


def test_tp_bytes_per_layer():
    model = gpt()
    sbh2 = 2048 * 1 * 12288 * 2
    assert tp_bytes_per_layer(model, 1, 8, "none", 2) == 4 * 2 * 7 / 8 * sbh2  # 2 all-reduces fwd + 2 bwd
    assert tp_bytes_per_layer(model, 1, 8, "full", 2) == 6 * 2 * 7 / 8 * sbh2  # + the recomputed forward's 2
    assert tp_bytes_per_layer(model, 1, 8, "selective", 2) == tp_bytes_per_layer(model, 1, 8, "none", 2)


def test_tp_bytes_of_a_stage_by_hand():
    """tp = 4 > 2 kv heads: per layer 4 all-reduces of s*b*h plus, for k and v, the gradient of the
    one key/value head (8 rows of h) each rank holds sent to the one other rank holding it; the
    embedding's forward and LM head's backward all-reduce, and the cross-entropy's 3 all-reduces
    of s*b fp32 values."""
    est = estimate(tiny_gqa(), ClusterSpec.preset("h100", num_gpus=4), Layout(tp=4))
    ar = 2 * 3 / 4  # ring all-reduce factor for 4 ranks
    sbh = 16 * 64 * 2
    kv_grads = 2 * 8 * 64 * 2
    expected = 2 * (4 * ar * sbh + kv_grads) + 2 * ar * sbh + 3 * ar * 16 * 4
    assert est.comm_bytes_by_group["tp"] == pytest.approx(expected)
    assert est.comm_bytes == {"intra_node": pytest.approx(expected), "inter_node": 0.0}


def test_dp_bytes_zero_stages():
    """ZeRO paper Sec. 7: stages 0 and 2 move 2 psi, stage 3 3 psi (1.5x); torch's ZeRO-1 (DDP's
    all-reduce, then the partitions broadcast) 3 psi. One reduction per step whatever the
    micro-batches; stage 3 gathers the parameters twice per micro-batch."""
    p, n = 1e9, 8
    base = dp_bytes_per_step(p, n, 0, 1, Precision())
    assert base == 2 * 7 / 8 * 2e9
    assert dp_bytes_per_step(p, n, 1, 1, Precision()) == pytest.approx(1.5 * base)
    assert dp_bytes_per_step(p, n, 2, 1, Precision()) == pytest.approx(base)
    assert dp_bytes_per_step(p, n, 3, 1, Precision()) == pytest.approx(1.5 * base)
    for stage in (0, 1, 2):  # accumulating locally: no more than one micro-batch's worth
        assert dp_bytes_per_step(p, n, stage, 4, Precision()) == dp_bytes_per_step(p, n, stage, 1, Precision())
    assert dp_bytes_per_step(p, n, 3, 4, Precision()) == pytest.approx(base / 2 * (1 + 2 * 4))


def test_pp_bytes_and_comm_totals():
    model = tiny_gqa(layers=4)
    cluster = ClusterSpec.preset("h100", num_gpus=2)
    est = estimate(model, cluster, Layout(pp=2, num_microbatches=4))
    sbh2 = 16 * 64 * 2
    assert est.stages[0].comm_bytes_by_group["pp"] == 4 * sbh2  # activations forward only
    assert est.stages[1].comm_bytes_by_group["pp"] == 4 * sbh2  # gradients backward only
    assert sum(est.comm_bytes.values()) == pytest.approx(sum(est.comm_bytes_by_group.values()))


def test_link_classes():
    c64 = ClusterSpec.preset("h100", num_gpus=64)
    layout = Layout(tp=2, pp=8, dp=4)
    assert group_link(c64, layout, "tp") == "intra_node"
    assert group_link(c64, layout, "dp") == "intra_node"  # stride 2, 4 ranks: within a node of 8
    assert group_link(c64, layout, "pp") == "inter_node"
    pp_first = Layout(tp=2, pp=8, dp=4, rank_order="tp-pp-dp")
    assert group_link(c64, pp_first, "pp") == "inter_node" and group_link(c64, pp_first, "dp") == "inter_node"
    assert group_link(c64, Layout(tp=8, dp=8), "dp") == "inter_node"
    assert group_link(ClusterSpec.preset("h100", num_gpus=8), Layout(pp=2, dp=4), "pp") == "intra_node"
    est = estimate(ModelSpec.preset("llama3-8b"), c64, Layout(tp=8, dp=8, num_microbatches=2))
    assert est.comm_bytes["intra_node"] == est.comm_bytes_by_group["tp"]
    assert est.comm_bytes["inter_node"] == est.comm_bytes_by_group["dp"]


# ---------------------------------------------------------------------------- presets and HF configs


def test_cluster_presets():
    a100 = ClusterSpec.preset("a100-40gb", num_gpus=16)
    h100 = ClusterSpec.preset("h100", num_gpus=16)
    h200 = ClusterSpec.preset("h200-141gb")
    assert (a100.peak_flops, a100.hbm_bandwidth, a100.intra_node_bandwidth) == (312e12, 1.555e12, 300e9)
    assert h100.name == "h100-80gb" and h100.peak_flops == 989e12 and h100.inter_node_bandwidth == 50e9
    assert h200.hbm_bandwidth == 4.8e12 and h200.hbm_bytes > h100.hbm_bytes and h200.num_gpus == 8
    assert ClusterSpec.preset("a100-80gb").hbm_bandwidth == 2.039e12
    assert a100.num_nodes == 2


LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def test_from_hf_config_llama(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    for source in (tmp_path / "config.json", tmp_path, str(tmp_path), LLAMA3_8B_CONFIG):
        model = ModelSpec.from_hf_config(source)
        assert model.num_params == 8_030_261_248
        assert (model.kv_heads, model.ffn_hidden, model.seq_len) == (8, 14336, 8192)
        assert model.gated_mlp and not model.dropout and not model.tied_embeddings and model.norm == "rmsnorm"
    assert ModelSpec.from_hf_config(LLAMA3_8B_CONFIG, seq_len=2048).seq_len == 2048


def test_from_hf_config_gpt2(tmp_path):
    config = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024}
    config.update(vocab_size=50257, n_inner=None, resid_pdrop=0.1, layer_norm_epsilon=1e-5)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ModelSpec.from_hf_config(tmp_path / "config.json")
    assert model.num_params == 124_439_808  # HF's GPT-2 small
    assert not model.gated_mlp and model.tied_embeddings and model.dropout and model.ffn_hidden == 3072
    assert model.position_embedding == "learned" and model.norm == "layernorm" and model.linear_bias


def test_from_hf_config_errors(tmp_path):
    with pytest.raises(ValueError, match="no HuggingFace config"):
        ModelSpec.from_hf_config(tmp_path / "missing")
    with pytest.raises(ValueError, match="vocab_size"):
        ModelSpec.from_hf_config({k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "vocab_size"})


# ---------------------------------------------------------------------------- validation


def test_invalid_layouts_rejected_with_reason():
    model = ModelSpec.preset("llama3-70b")  # 64 heads, 8 kv heads, 80 layers
    reasons = validate_layout(model, ClusterSpec.preset("h100", num_gpus=3), Layout(tp=3))
    assert not any("heads" in r for r in reasons), reasons  # heads need not divide (uneven splits)
    few_heads = ModelSpec(layers=2, hidden=64, heads=4, vocab=100, seq_len=16)
    assert "heads (4) < tp (8): a rank would hold no attention head" in validate_layout(
        few_heads, ClusterSpec.preset("h100", num_gpus=8), Layout(tp=8)
    )
    cases = [
        (ClusterSpec.preset("h100", num_gpus=64), Layout(tp=8, pp=2, dp=2), "tp*pp*dp = 8*2*2 = 32 != 64 GPUs"),
        (ClusterSpec.preset("h100", num_gpus=64), Layout(tp=16, dp=4), "tp=16 > 8 GPUs per node"),
        (ClusterSpec.preset("h100", num_gpus=24), Layout(tp=8, pp=3), "layers (80) not divisible by pp (3)"),
    ]
    for cluster, layout, reason in cases:
        assert any(reason in r for r in validate_layout(model, cluster, layout)), (layout, reason)
        with pytest.raises(ValueError, match=re.escape(reason)):
            estimate(model, cluster, layout)  # bad input: every reason in the message


def test_tp_groups_must_not_span_nodes():
    model = ModelSpec(layers=24, hidden=3072, heads=24, kv_heads=24, ffn_hidden=9216, vocab=32000, seq_len=2048)
    cluster = ClusterSpec.preset("h100", num_gpus=24)  # 3 nodes of 8
    with pytest.raises(ValueError, match="tp=6 does not divide 8 GPUs per node"):
        estimate(model, cluster, Layout(tp=6, dp=4, num_microbatches=12))
    single_node = ClusterSpec.preset("h100", num_gpus=6)
    assert estimate(model, single_node, Layout(tp=6)).valid  # within one node any tp <= 8 is fine
    ranked = search(model, cluster, global_batch=48)
    # a grid's tp_c rows stay in a node; its tp_r columns may cross nodes (priced on the network)
    assert ranked and all(cluster.gpus_per_node % (layout.tp_grid or (0, layout.tp))[1] == 0 for layout, _ in ranked)
    assert any(layout.tp_grid for layout, _ in ranked)
    assert all(est.comm_links["tp"] == "intra_node" for layout, est in ranked if not layout.tp_grid)
    rejected = search(model, cluster, global_batch=48, include_invalid=True)
    assert any(layout.tp == 3 and not est.valid for layout, est in rejected)
    assert "INVALID" in format_estimate(next(est for layout, est in rejected if layout.tp == 3))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(micro_batches=(0,)), "micro_batches"),
        (dict(tp_sizes=(0,)), "tp_sizes"),
        (dict(zero_stages=(4,)), "zero_stage"),
    ],
)
def test_search_bad_options_raise_value_error(kwargs, message):
    model, cluster = ModelSpec.preset("llama3-8b"), ClusterSpec.preset("h100", num_gpus=8)
    with pytest.raises(ValueError, match=message):
        search(model, cluster, global_batch=8, **kwargs)


def test_precision_by_name_and_types():
    model, cluster = ModelSpec.preset("llama3-8b"), ClusterSpec.preset("h100", num_gpus=8)
    by_name = estimate(model, cluster, Layout(tp=8), "mixed-adam-fp32-grads")
    assert by_name.memory.optimizer == estimate(model, cluster, Layout(tp=8), Precision(2, 2, 16)).memory.optimizer
    with pytest.raises(ValueError, match="precision"):
        estimate(model, cluster, Layout(tp=8), "fp7-adam")
    assert all(isinstance(training_flops(model, 8, r), float) for r in ("none", "selective", "full"))


def test_no_pipeline_holds_one_micro_batch_whatever_the_schedule():
    assert microbatches_in_flight("gpipe", 0, 1, 8) == 1.0
    assert microbatches_in_flight("gpipe", 0, 4, 8) == 8.0


def test_schedule_and_sequence_parallel_rules():
    model = tiny_gqa(layers=6, seq_len=18)
    c4 = ClusterSpec.preset("h100", num_gpus=4)

    def reasons(**kw):
        return " | ".join(validate_layout(model, c4, Layout(**kw)))

    assert "pp*virtual_stages" in reasons(pp=2, tp=2, schedule="interleaved", virtual_stages=2, num_microbatches=2)
    assert "not divisible by pp (2)" in reasons(
        pp=2, tp=2, schedule="interleaved", virtual_stages=3, num_microbatches=3
    )
    assert "needs pp >= 2" in reasons(tp=4, schedule="interleaved", virtual_stages=2)
    assert "needs schedule='interleaved'" in reasons(pp=2, tp=2, virtual_stages=3, num_microbatches=2)
    assert reasons(tp=4, sequence_parallel=True) == ""  # 18 tokens split 5, 5, 4, 4
    assert "global batch 16" in " ".join(validate_layout(model, c4, Layout(dp=4, num_microbatches=3), global_batch=16))
    assert reasons(pp=2, tp=2, schedule="interleaved", virtual_stages=3, num_microbatches=4) == ""


def test_too_much_memory_is_rejected():
    model = ModelSpec.preset("llama3-70b")
    cluster = ClusterSpec.preset("a100-40gb", num_gpus=8)
    est = estimate(model, cluster, Layout(tp=8))
    assert est.valid and not est.fits
    assert est.memory.model_states == pytest.approx(model.num_params * 16 / 8, rel=0.01)
    assert any("GB per GPU" in r and "usable" in r for r in est.reasons)
    assert "DOES NOT FIT" in format_estimate(est)
    assert est.usable_hbm_bytes == pytest.approx(40 * 2**30 * 0.9)
    roomy = estimate(model, cluster, Layout(tp=8), assumptions=Assumptions(hbm_reserve_fraction=0))
    assert roomy.usable_hbm_bytes == 40 * 2**30


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'.*llama3-70b"):
        ModelSpec.preset("gpt5")
    with pytest.raises(ValueError, match="unknown cluster preset 'tpu-v5'.*a100-40gb.*h100-80gb"):
        ClusterSpec.preset("tpu-v5")
    with pytest.raises(ValueError, match="unknown precision preset.*mixed-adam"):
        Precision.preset("int4")
    with pytest.raises(ValueError, match="unknown recompute 'some'.*'none', 'selective', 'full'"):
        Layout(recompute="some")
    with pytest.raises(ValueError, match="unknown schedule 'zb'.*'gpipe', '1f1b', 'interleaved'"):
        Layout(schedule="zb")
    with pytest.raises(ValueError, match="unknown zero_stage 4; valid: 0, 1, 2, 3"):
        Layout(zero_stage=4)
    with pytest.raises(ValueError, match="Layout.tp must be a positive integer, got -2"):
        Layout(tp=-2)
    with pytest.raises(ValueError, match="ModelSpec.layers must be a positive integer, got -1"):
        tiny_gqa(layers=-1)
    with pytest.raises(ValueError, match="num_params must be a positive number"):
        ModelSpec(num_params=-5)
    with pytest.raises(ValueError, match="missing heads"):
        ModelSpec(layers=2, hidden=64, vocab=8, seq_len=8)
    with pytest.raises(ValueError, match="heads .8. must be divisible by kv_heads .3."):
        tiny_gqa(kv_heads=3)
    with pytest.raises(ValueError, match="num_params=1e\\+06"):
        tiny_gqa(num_params=1e6)
    with pytest.raises(ValueError, match="multiple of it"):
        ClusterSpec.preset("h100", num_gpus=12)
    with pytest.raises(ValueError, match="hbm_bytes must be a positive number"):
        ClusterSpec.preset("h100", hbm_bytes=-1)
    with pytest.raises(ValueError, match="Precision.grad_bytes"):
        Precision(grad_bytes=-2)


def test_count_only_model_limits():
    model = ModelSpec(num_params=1e9)
    cluster = ClusterSpec.preset("h100", num_gpus=8)
    est = estimate(model, cluster, Layout(tp=2, pp=2, dp=2, zero_stage=1))
    assert est.valid and est.fits and est.step_time_s is None and est.model_flops is None
    assert est.comm_bytes_by_group["tp"] is None and est.comm_bytes_by_group["dp"] > 0
    assert est.notes
    with pytest.raises(ValueError, match="dimensions"):
        search(model, cluster, 16)
    with pytest.raises(ValueError, match="dimensions"):
        count_params(model)
    with pytest.raises(ValueError, match="dimensions"):
        layer_activation_bytes(model)
    assert "note:" in format_estimate(est)


# ---------------------------------------------------------------------------- search and output


@pytest.fixture(scope="module")
def llama70b_search():
    model = ModelSpec.preset("llama3-70b")
    cluster = ClusterSpec.preset("h100", num_gpus=64)
    options = dict(micro_batches=(1, 2), virtual_stages=(2,))
    ranked = search(model, cluster, 128, **options)
    everything = search(model, cluster, 128, include_invalid=True, **options)
    return model, cluster, ranked, everything


def test_search_returns_only_valid_fitting_layouts(llama70b_search):
    model, cluster, ranked, everything = llama70b_search
    assert ranked
    for layout, est in ranked:
        assert validate_layout(model, cluster, layout, global_batch=128) == []
        assert est.fits and est.memory.total <= cluster.hbm_bytes
        assert est.layout == layout
    times = [est.step_time_s for _, est in ranked]
    assert times == sorted(times)
    rejected = everything[len(ranked) :]
    assert [pair for pair in everything if pair[1].fits] == ranked
    assert any(not est.valid for _, est in rejected)  # e.g. 80 layers over pp = 32
    assert any(est.valid and not est.fits for _, est in rejected)  # e.g. tp = 1, no ZeRO
    assert all(est.reasons for _, est in rejected)
    assert format_ranking(ranked, top=3).count("\n") == 3


def test_estimate_rows(llama70b_search):
    _, _, ranked, everything = llama70b_search
    rows = [estimate_to_dict(est) for _, est in ranked[:3] + everything[-3:]]
    assert all(tuple(row) == ESTIMATE_FIELDS for row in rows)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=ESTIMATE_FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    assert out.getvalue().count("\n") == len(rows) + 1
    best = rows[0]
    assert best["fits"] and best["step_time_s"] == ranked[0][1].step_time_s
    assert best["memory_total_bytes"] == ranked[0][1].memory.total
    assert "fits" in format_estimate(ranked[0][1])


# ---------------------------------------------------------------------------- invariants


FEW_LAYERS = st.integers(1, 4)


@st.composite
def models_and_tp(draw, max_vocab=1024, head_dims=(8, 16, 32), layers=FEW_LAYERS):
    """A valid (model, tp): heads, kv heads and ffn divisible as TP needs, seq_len % tp == 0."""
    tp = draw(st.sampled_from([1, 2, 4]))
    heads = tp * draw(st.integers(1, 4))
    kv_heads = draw(
        st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0 and (k % tp == 0 or tp % k == 0)])
    )
    model = ModelSpec(
        layers=draw(layers),
        hidden=heads * draw(st.sampled_from(head_dims)),
        heads=heads,
        kv_heads=kv_heads,
        ffn_hidden=tp * draw(st.integers(1, 64)),
        vocab=draw(st.integers(1, max_vocab)),
        seq_len=tp * draw(st.integers(1, 64)),
        gated_mlp=draw(st.booleans()),
        dropout=draw(st.booleans()),
    )
    return model, tp


@settings(max_examples=examples(40))
@given(models_and_tp(), st.integers(1, 4), st.sampled_from(["none", "selective", "full"]))
def test_sequence_parallel_never_increases_activations(model_tp, micro_batch, recompute):
    model, tp = model_tp
    kw = dict(tp=tp, recompute=recompute)
    with_sp = layer_activation_bytes(model, micro_batch, sequence_parallel=True, **kw)
    assert with_sp <= layer_activation_bytes(model, micro_batch, **kw)
    cluster = ClusterSpec.preset("h100", num_gpus=tp)
    layout = Layout(tp=tp, micro_batch=micro_batch, recompute=recompute)
    plain, sp = (estimate(model, cluster, replace(layout, sequence_parallel=s)) for s in (False, True))
    assert sp.memory.activations <= plain.memory.activations


@settings(max_examples=examples(30))
@given(
    st.floats(1e6, 1e12),
    st.sampled_from([1, 2, 8]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 3, 8]),
    st.sampled_from([0, 1, 2, 3]),
    st.sampled_from(["mixed-adam", "fp32-adam", "bf16-sgd"]),
)
def test_model_state_sharding_accounts_for_every_byte(num_params, tp, pp, dp, zero_stage, precision_name):
    precision = Precision.preset(precision_name)
    cluster = ClusterSpec(tp * pp * dp, 1e15, 80e9, 1e12, 1e11, 1e10, gpus_per_node=max(tp, 1))
    est = estimate(
        ModelSpec(num_params=num_params), cluster, Layout(tp=tp, pp=pp, dp=dp, zero_stage=zero_stage), precision
    )
    mem = est.memory
    assert mem.params * tp * pp * (dp if zero_stage == 3 else 1) == pytest.approx(num_params * precision.param_bytes)
    assert mem.grads * tp * pp * (dp if zero_stage >= 2 else 1) == pytest.approx(num_params * precision.grad_bytes)
    assert mem.optimizer * tp * pp * (dp if zero_stage >= 1 else 1) == pytest.approx(
        num_params * precision.optimizer_bytes
    )


@settings(max_examples=examples(30))
@given(
    st.sampled_from([1, 2]),
    st.integers(4, 6),
    st.sampled_from([4, 8]),
    st.sampled_from(["none", "selective", "full"]),
    st.data(),
)
def test_higher_zero_stage_never_needs_more_memory(pp, layers_per_stage, dp, recompute, data):
    """Model states never grow with the stage. The total neither, once the ZeRO-3 gather buffer
    (one layer, or the embedding) is smaller than what stage 3 saves: here >= 4 layers per stage,
    dp >= 4, hidden >= 64 and a vocabulary no wider than 128 (padded to 128*tp)."""
    model, tp = data.draw(models_and_tp(max_vocab=128, head_dims=(64,), layers=st.just(pp * layers_per_stage)))
    cluster = ClusterSpec.preset("h100", num_gpus=tp * pp * dp)
    previous = None
    for stage in range(4):
        layout = Layout(tp=tp, pp=pp, dp=dp, zero_stage=stage, num_microbatches=pp, recompute=recompute)
        mem = estimate(model, cluster, layout).memory
        if previous is not None:
            assert mem.model_states <= previous.model_states * (1 + 1e-12)
            assert mem.total <= previous.total * (1 + 1e-12)
        previous = mem


def test_comm_bytes_never_negative_and_finite(llama70b_search):
    _, _, ranked, _ = llama70b_search
    for _, est in ranked:
        assert all(v >= 0 and math.isfinite(v) for v in est.comm_bytes.values())
        assert all(v >= 0 for v in est.time_breakdown.values())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_step_time_is_divided_over_the_replicas_under_zero(stage):
    """ZeRO >= 1: each replica steps only its 1/dp of the parameters; stage 0 steps them all. A
    planner that drops the division (or divides at stage 0) fails here."""
    model, cluster = ModelSpec.preset("llama3-8b"), ClusterSpec.preset("h100", num_gpus=64)
    precision = Precision.preset("mixed-adam-fp32-grads")
    plain = estimate(model, cluster, Layout(tp=8, dp=8, zero_stage=0), precision).stages[0]
    zero = estimate(model, cluster, Layout(tp=8, dp=8, zero_stage=stage), precision).stages[0]
    touched = plain.num_params * (2 * precision.optimizer_bytes + precision.grad_bytes + precision.param_bytes)
    assert plain.time_breakdown["optimizer"] == pytest.approx(touched / cluster.hbm_bandwidth, rel=1e-12)
    assert zero.time_breakdown["optimizer"] == pytest.approx(plain.time_breakdown["optimizer"] / 8, rel=1e-12)


@pytest.mark.parametrize("name", ["llama3-8b", "gpt3-175b"])
@pytest.mark.parametrize("tp, pp, dp, zero_stage, sp", [(1, 1, 8, 3, False), (8, 4, 2, 1, True), (4, 2, 8, 2, True)])
def test_tensor_by_tensor_model_states_cover_every_parameter(name, tp, pp, dp, zero_stage, sp):
    """The per-tensor ZeRO accounting holds exactly the stage's parameters (padding aside): summed
    over the replicas, ZeRO's shards are the whole (the blocks' norms, kept whole under SP at
    stages 2-3, once per replica); the busiest replica holds at least the even share."""
    from tplayers.plan.estimate import model_state_bytes_per_rank

    model = ModelSpec.preset(name)
    layout = Layout(tp=tp, pp=pp, dp=dp, zero_stage=zero_stage, sequence_parallel=sp, num_microbatches=pp)
    precision = Precision.preset("fp32-adam")
    cluster = ClusterSpec.preset("h100", num_gpus=tp * pp * dp)
    for stage in range(pp):
        params = estimate(model, cluster, layout, precision).stages[stage].num_params
        per_rank = model_state_bytes_per_rank(model, layout, precision, stage=stage)
        assert len(per_rank) == dp
        norms = 2 * model.layers // pp * model.hidden * (2 if model.norm == "layernorm" else 1)
        whole = norms if sp and zero_stage >= 2 else 0
        expected = (params + (dp - 1) * whole) * precision.optimizer_bytes
        assert sum(o for _, _, o in per_rank) == pytest.approx(expected, rel=1e-12)
        # FSDP2's stage 2 keeps the params sharded at rest too (gathered once a step: `buffers`)
        even = model_state_bytes(params, precision, zero_stage=3 if zero_stage == 2 else zero_stage, dp=dp)
        for i in range(3):
            assert max(rank[i] for rank in per_rank) >= even[i] - 1e-6


@pytest.mark.parametrize("m, held", [(2, 2), (8, 4)])
def test_first_stage_keeps_embedding_masks_of_the_micro_batches_in_flight(m, held):
    """1F1B at pp 4: the first stage keeps the embedding's dropout mask of min(pp, m) micro-batches
    (all m when there are fewer than stages). A planner that drops the min, or holds pp or m
    regardless, fails here."""
    from tplayers.plan.memory import _embedding_activation_bytes

    model = ModelSpec(layers=8, hidden=256, heads=8, ffn_hidden=1024, vocab=1024, seq_len=128, dropout=True)
    layout = Layout(tp=2, pp=4, num_microbatches=m, micro_batch=1, schedule="1f1b")
    precision = Precision.preset("mixed-adam")
    est = estimate(model, ClusterSpec.preset("h100", num_gpus=8), layout, precision)
    per_layer = layer_activation_bytes(model, 1, tp=2, activation_bytes=precision.activation_bytes)
    layers = model.layers // 4 * microbatches_in_flight("1f1b", 0, 4, m) * per_layer
    embedding = _embedding_activation_bytes(model, 1, 2, False)
    assert embedding > 0
    assert est.stages[0].memory.activations == pytest.approx(layers + held * embedding, rel=1e-12)


def test_uneven_splits_are_priced_at_the_most_loaded_rank():
    """28 heads / 4 kv heads, ffn 18944, vocabulary 152064 (Qwen2-7B) at TP 8: no refusal; rank 0
    holds ceil shares (4 heads, 2368 ffn columns, 19008 rows) and of k / v the one head its queries
    read (rank 3's heads 12-15 read two), its FLOPs set the time, and the report names the imbalance."""
    from tplayers.plan.estimate import model_state_bytes_per_rank
    from tplayers.plan.specs import _layer_params, local_dims

    model = ModelSpec(layers=28, hidden=3584, heads=28, kv_heads=4, ffn_hidden=18944, vocab=152064, seq_len=4096)
    cluster = ClusterSpec.preset("h100", num_gpus=8)
    tplayers_edges = Assumptions(implementation="tplayers")
    est = estimate(model, cluster, Layout(tp=8), assumptions=tplayers_edges)
    assert [local_dims(model, 8, r).heads for r in range(8)] == [4, 4, 4, 4, 3, 3, 3, 3]
    first, last = local_dims(model, 8, 0), local_dims(model, 8, 7)
    assert (first.ffn, last.ffn, first.kv, first.kv_heads_computed) == (2368, 2368, 128, 4)
    assert local_dims(model, 8, 3).kv == 2 * 128
    per_rank = [model_state_bytes_per_rank(model, Layout(tp=8), assumptions=tplayers_edges, tp_rank=r)[0][0]
                for r in range(8)]  # fmt: skip
    assert est.memory.params == per_rank[1] == max(per_rank) > per_rank[7]  # rank 1 reads 2 key/value heads
    mean = sum(_layer_params(model, 8, r) for r in range(8)) / 8
    assert est.tp_imbalance == pytest.approx(_layer_params(model, 8, 1) / mean) and est.tp_imbalance > 1.01
    assert any("uneven tensor-parallel split" in note for note in est.notes)
    divisible = estimate(replace(model, heads=32, kv_heads=8, head_dim=112, num_params=None), cluster, Layout(tp=8))
    assert divisible.tp_imbalance == pytest.approx(1.0) and not any("uneven" in n for n in divisible.notes)


# -- gradient compression (data_parallel(compress=...)) -------------------------------------------
def test_compressed_gradient_bytes_by_hand():
    """One (1024, 512) weight and a 512 vector over 4 replicas: bf16 half the fp32 all-reduce;
    int8 1 + 4/64 bytes per entry (whole blocks); top-k 1 % (n-1) x 8 bytes per kept entry, at
    least one per tensor; PowerSGD rank 4: P (1024 x 4) with the vector whole, then Q (512 x 4)."""
    shapes, n = [(1024, 512), (512, 1)], 4
    entries = 1024 * 512 + 512
    fp32 = 2 * 3 / 4 * entries * 4
    assert compressed_mean_bytes(shapes, n, Compression.parse("bf16")) == fp32 / 2
    assert compressed_mean_bytes(shapes, n, Compression.parse("int8")) == 2 * 3 / 4 * entries * (1 + 4 / 64)
    assert compressed_mean_bytes(shapes, n, Compression.parse("topk:0.01")) == 3 * 8 * (5243 + 6)
    powersgd = 2 * 3 * 4 * (math.ceil((1024 * 4 + 512) / 4) + 512 * 4 / 4)
    assert compressed_mean_bytes(shapes, n, Compression.parse("powersgd:rank=4")) == powersgd


def test_compression_in_a_layout_is_checked_and_priced():
    model, cluster = ModelSpec.preset("llama2-7b"), ClusterSpec.preset("h100", num_gpus=128)
    plain = estimate(model, cluster, Layout(tp=8, dp=16, zero_stage=1), Precision.preset("fp32-adam"))
    int8 = estimate(model, cluster, Layout(tp=8, dp=16, zero_stage=1, compress="int8"), Precision.preset("fp32-adam"))
    ratio = (int8.comm_bytes_by_group["dp"] - plain.comm_bytes_by_group["dp"] / 3) / (
        plain.comm_bytes_by_group["dp"] * 2 / 3
    )  # ZeRO-1: the all-reduce (2 psi) compressed, the parameters' gather (psi) not
    assert ratio == pytest.approx((1 + 4 / 64) / 4, rel=1e-3)
    with pytest.raises(ValueError, match="compress 'int8' needs the whole gradient"):
        Layout(dp=2, zero_stage=3, compress="int8")
    with pytest.raises(ValueError, match="compress must be one of"):
        Layout(dp=2, compress="fp8")
    with pytest.raises(ValueError, match="PowerSGD's bytes depend on every weight's shape"):
        dp_bytes_per_step(1e9, 8, 0, 1, Precision.preset("fp32-adam"), Compression.parse("powersgd:rank=4"))
    ranked = search(model, cluster, 128, compress=("int8",), tp_sizes=(8,), pp_sizes=(1,), micro_batches=(1,))
    assert ranked and {layout.zero_stage for layout, _ in ranked} == {0, 1}
    assert all(layout.compress == "int8" for layout, _ in ranked)


def test_named_presets_are_built_specs():
    """`plan.MODEL_PRESETS` / `PRECISION_PRESETS` hold the specs `preset(name)` builds (presets.py
    keeps only their fields)."""
    from tplayers import plan

    assert plan.MODEL_PRESETS and all(v == plan.ModelSpec.preset(k) for k, v in plan.MODEL_PRESETS.items())
    precisions = plan.PRECISION_PRESETS.items()
    assert all(isinstance(v, plan.Precision) and v == plan.Precision.preset(k) for k, v in precisions)
