"""The planner's mixtures of experts (`tplayers.plan.experts`): configs read, parameters counted as
HF counts them, expert parallelism priced (memory, all-to-all bytes, grouped GEMM time, search),
and the prices checked against a real expert-parallel step on local ranks."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tplayers import plan
from tplayers.plan.experts import destinations, ep_bytes_per_layer, remote_destinations
from tplayers.plan.specs import expert_ffn_share, expert_share
from tplayers.testing import examples

# Qwen3-30B-A3B's config.json (published: 30.5 B parameters, 3.3 B activated)
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, vocab_size=151936, max_position_embeddings=40960, intermediate_size=6144, moe_intermediate_size=768,
    num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
)  # fmt: skip
# Mixtral-8x7B's (published: 46.7 B parameters, 12.9 B active)
MIXTRAL_8X7B = dict(
    model_type="mixtral", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=32000, max_position_embeddings=32768, intermediate_size=14336, num_local_experts=8,
    num_experts_per_tok=2, tie_word_embeddings=False,
)  # fmt: skip


@pytest.mark.parametrize("config, total, active", [(QWEN3_30B_A3B, 30.5e9, 3.3e9), (MIXTRAL_8X7B, 46.7e9, 12.9e9)])
def test_published_moe_configs_are_read(config, total, active):
    model = plan.ModelSpec.from_hf_config(config)
    counts = plan.count_params(model)
    assert counts.total == model.num_params
    assert counts.total == pytest.approx(total, rel=0.005) and counts.active == pytest.approx(active, rel=0.02)
    assert counts.moe_layers == model.layers and model.experts_per_token == config["num_experts_per_tok"]


def test_shared_experts_and_leading_dense_layers_are_read():
    glm = dict(MIXTRAL_8X7B, model_type="glm4_moe", n_routed_experts=16, num_local_experts=None, n_shared_experts=2,
               moe_intermediate_size=256, first_k_dense_replace=3)  # fmt: skip
    model = plan.ModelSpec.from_hf_config(glm)
    assert (model.experts, model.expert_ffn, model.shared_ffn, model.dense_layers) == (16, 256, 512, 3)
    counts = plan.count_params(model)
    assert counts.moe_layers == 29 and counts.per_layer > counts.active_per_moe_layer


@pytest.mark.parametrize(
    "extra, match",
    [
        (dict(kv_lora_rank=512, q_lora_rank=1536), "latent attention"),
        (dict(layer_types=["linear_attention", "full_attention"]), "linear_attention"),
        (dict(ffn_config=dict(moe_num_experts=16)), "ffn_config"),
        (dict(mlp_only_layers=[0, 2]), "some layers only"),
        (dict(decoder_sparse_step=2), "some layers only"),
        (dict(interleave_moe_layer_step=2), "some layers only"),
        (dict(attn_layer_period=8, expert_layer_period=2), "some layers only"),  # Jamba: Mamba layers too
        (dict(num_experts_per_tok=None), "no picks per token"),
    ],
)
def test_what_the_planner_cannot_price_is_refused_by_name(extra, match):
    with pytest.raises(ValueError, match=match):
        plan.ModelSpec.from_hf_config({**MIXTRAL_8X7B, **extra})


def test_llama4_reads_its_shared_expert_and_chunked_layers():
    scout = dict(MIXTRAL_8X7B, model_type="llama4_text", num_local_experts=16, num_experts_per_tok=1,
                 intermediate_size=8192, intermediate_size_mlp=16384, interleave_moe_layer_step=1,
                 layer_types=["chunked_attention"] * 3 + ["full_attention"])  # fmt: skip
    model = plan.ModelSpec.from_hf_config(scout)
    assert (model.experts, model.expert_ffn, model.shared_ffn) == (16, 8192, 8192)


def test_shared_experts_add_their_own_tensor_parallel_bytes():
    """A MoE layer runs its shared experts as an MLP of their own: one more pair of all-reduces
    (all-gather + reduce-scatter under SP) than without them, at any ep."""
    config = dict(MIXTRAL_8X7B, num_local_experts=16)
    base = plan.ModelSpec.from_hf_config(config, seq_len=4096)
    shared = plan.ModelSpec.from_hf_config(dict(config, shared_expert_intermediate_size=4096), seq_len=4096)
    cluster = plan.ClusterSpec.preset("h100", num_gpus=8)
    for layout in (plan.Layout(tp=4, dp=2, ep=2, sequence_parallel=True), plan.Layout(tp=4, dp=2),
                   plan.Layout(tp=4, dp=2, sequence_parallel=True)):  # fmt: skip
        tp = [plan.estimate(m, cluster, layout, "mixed-adam").comm_bytes_by_group["tp"] for m in (base, shared)]
        pair = 2 * plan.all_reduce_bytes(4096 * 4096 * 2, 4) * base.layers
        assert tp[1] - tp[0] == pytest.approx(pair, rel=1e-9), layout.describe()


def test_interleaved_stages_hold_their_chunks_of_dense_and_moe_layers():
    from tplayers.plan.estimate import _Context

    model = plan.ModelSpec.from_hf_config(dict(MIXTRAL_8X7B, num_hidden_layers=8, first_k_dense_replace=3))
    layout = plan.Layout(pp=2, schedule="interleaved", virtual_stages=2, num_microbatches=2)
    ctx = _Context(model, None, layout, plan.Precision(), plan.Assumptions())
    assert [ctx.layers(s) for s in (0, 1)] == [(2, 2), (1, 3)]  # chunks 0, 2 (layers 0-1, 4-5) and 1, 3


def test_moe_fields_are_checked():
    with pytest.raises(ValueError, match="experts is 0"):
        plan.ModelSpec.preset("llama3-8b", experts_per_token=2)
    with pytest.raises(ValueError, match="experts_per_token"):
        plan.ModelSpec.preset("llama3-8b", experts=8)
    with pytest.raises(ValueError, match="> experts"):
        plan.ModelSpec.preset("llama3-8b", experts=2, experts_per_token=3)
    with pytest.raises(ValueError, match="dimensions"):
        plan.ModelSpec(num_params=1e9, experts=8, experts_per_token=2)


def test_count_params_equals_the_hf_model():
    """Every parameter of a (tiny) Mixtral, as HF builds it from the same config."""
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=6,
                           num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    hf = tf.MixtralForCausalLM(cfg)
    assert plan.count_params(plan.ModelSpec.from_hf_config(cfg.to_dict())).total == sum(
        p.numel() for p in hf.parameters()
    )


@settings(max_examples=examples(40), deadline=None)
@given(st.integers(1, 9), st.integers(1, 5), st.data())
def test_destinations_enumerate_every_choice_of_experts(experts, ep, data):
    """Expected ranks a token reaches under uniform routing = the mean over every k-subset of experts."""
    k = data.draw(st.integers(1, experts))
    owner = [r for r in range(ep) for _ in range(expert_share(experts, ep, r))]
    reached = [len({owner[e] for e in pick}) for pick in itertools.combinations(range(experts), k)]
    assert destinations(experts, k, ep) == pytest.approx(sum(reached) / len(reached), rel=1e-12)
    assert remote_destinations(experts, k, ep) == pytest.approx(destinations(experts, k, ep) * (ep - 1) / ep)


@pytest.mark.parametrize("f, tp", [(16, 2), (16, 3), (48, 4), (14, 4), (7, 3), (768, 8), (2048, 3)])
def test_expert_features_split_as_the_layer_splits_them(f, tp):
    from tplayers.nn.experts import aligned_unit
    from tplayers.placement import even_sizes

    unit = aligned_unit(f, tp)
    assert [expert_ffn_share(f, tp, r) for r in range(tp)] == [n * unit for n in even_sizes(f // unit, tp)]


def test_expert_parallel_layouts_are_checked():
    cluster = plan.ClusterSpec.preset("h100", num_gpus=8)
    moe = plan.ModelSpec.from_hf_config(MIXTRAL_8X7B, seq_len=4096)
    dense = plan.ModelSpec.preset("llama3-8b")
    with pytest.raises(ValueError, match="ep .3. must divide dp .4."):
        plan.Layout(dp=4, ep=3)
    reasons = plan.validate_layout(dense, cluster, plan.Layout(tp=2, dp=4, ep=2))
    assert any("needs a mixture of experts" in r for r in reasons)
    assert not plan.validate_layout(moe, cluster, plan.Layout(tp=2, dp=4, ep=2, zero_stage=1))
    reasons = plan.validate_layout(moe, cluster, plan.Layout(tp=(2, 2), dp=2))
    assert any("grid takes dense models" in r for r in reasons)
    assert plan.Layout(tp=2, dp=4, ep=2).describe().startswith("tp=2 pp=1 dp=4 ep=2")
    with pytest.raises(ValueError, match="routing_imbalance"):
        plan.Assumptions(routing_imbalance=0.9)


def test_expert_parallelism_moves_expert_memory_to_all_to_all_bytes():
    """At ZeRO 0 each step of ep takes the experts' states off a GPU, exactly, and prices the
    all-to-alls; the dense part is unchanged."""
    model = plan.ModelSpec.from_hf_config(QWEN3_30B_A3B, seq_len=4096)
    cluster = plan.ClusterSpec.preset("h100", num_gpus=64)
    precision = plan.Precision.preset("mixed-adam")
    ests = {ep: plan.estimate(model, cluster, plan.Layout(tp=4, pp=2, dp=8, ep=ep), precision) for ep in (1, 2, 8)}
    per_expert = 3 * model.hidden * expert_ffn_share(model.expert_ffn, 4)  # on one TP rank of four
    for ep in (2, 8):
        held = model.experts - expert_share(model.experts, ep)  # experts no longer on this GPU
        saved = held * per_expert * (model.layers // 2) * precision.model_state_bytes
        assert ests[1].memory.model_states - ests[ep].memory.model_states == pytest.approx(saved, rel=1e-12)
        tokens = model.seq_len  # per micro-batch of one sequence, no sequence parallelism: every TP rank all of them
        a2a = ep_bytes_per_layer(model, tokens, ep, precision.activation_bytes) * (model.layers // 2)
        assert ests[ep].comm_bytes_by_group["ep"] == pytest.approx(a2a, rel=1e-12)
        assert (
            ests[ep].time_breakdown["ep"] > 0 and ests[ep].comm_bytes_by_group["dp"] < ests[1].comm_bytes_by_group["dp"]
        )
    assert ests[1].comm_bytes_by_group["ep"] == 0
    assert ests[8].comm_links["ep"] == "inter_node" and ests[2].comm_links["ep"] == "intra_node"


def test_zero1_with_experts_shards_the_state_over_the_experts_replicas():
    """tplayers' ZeRO-1 with expert parallelism: one ZeroRedundancyOptimizer over the dp / ep
    replicas holding the same experts, so the optimizer state is split dp / ep ways, dense and experts."""
    model = plan.ModelSpec.from_hf_config(MIXTRAL_8X7B, seq_len=4096)
    cluster = plan.ClusterSpec.preset("h100", num_gpus=64)
    zero0, zero1 = (plan.estimate(model, cluster, plan.Layout(tp=8, dp=8, ep=2, zero_stage=z), "mixed-adam")
                    for z in (0, 1))  # fmt: skip
    assert zero1.memory.params == zero0.memory.params and zero1.memory.grads == zero0.memory.grads
    assert zero1.memory.optimizer == pytest.approx(zero0.memory.optimizer / 4, rel=0.05)  # edp = 4
    assert zero1.comm_bytes_by_group["dp"] > zero0.comm_bytes_by_group["dp"]  # the updated weights gathered


def test_routing_imbalance_and_grouped_gemm_efficiency_slow_the_step():
    model = plan.ModelSpec.from_hf_config(QWEN3_30B_A3B, seq_len=4096)
    cluster = plan.ClusterSpec.preset("h100", num_gpus=16)
    layout = plan.Layout(tp=2, dp=8, ep=4, zero_stage=3, num_microbatches=4)
    base = plan.estimate(model, cluster, layout, "mixed-adam")
    skewed = plan.estimate(model, cluster, layout, "mixed-adam", assumptions=plan.Assumptions(routing_imbalance=1.5))
    slow = plan.estimate(
        model, cluster, layout, "mixed-adam", assumptions=plan.Assumptions(grouped_gemm_efficiency=0.25)
    )
    assert skewed.time_breakdown["compute"] > base.time_breakdown["compute"]
    assert skewed.comm_bytes_by_group["ep"] > base.comm_bytes_by_group["ep"]
    assert skewed.memory.activations > base.memory.activations
    assert (
        slow.time_breakdown["compute"] > base.time_breakdown["compute"]
        and slow.comm_bytes_by_group == base.comm_bytes_by_group
    )


def test_search_tries_expert_parallelism():
    """A wide MoE whose experts' states only fit spread over the replicas: search finds ep > 1, and
    lists no ep for a dense model."""
    model = plan.ModelSpec.from_hf_config(MIXTRAL_8X7B, seq_len=4096)
    cluster = plan.ClusterSpec.preset("h100", num_gpus=16)
    ranked = plan.search(model, cluster, 64, "mixed-adam", zero_stages=(0,), micro_batches=(1,), recompute=("full",))
    assert ranked and all(layout.ep > 1 for layout, _ in ranked[:3])
    assert {layout.ep for layout, _ in ranked} > {1}
    dense = plan.search(plan.ModelSpec.preset("llama3-8b"), cluster, 64, micro_batches=(1,), recompute=("full",))
    assert {layout.ep for layout, _ in dense} == {1}
    assert math.isfinite(ranked[0][1].step_time_s)


# ---------------------------------------------------------------------------- against a real step

PICKS = list(itertools.combinations(range(4), 2))  # every pair of 4 experts: uniform routing, exactly


def _measured_step(rank, world, _, zero):
    """A tiny Mixtral (4 experts, top 2) at dp 4 x ep 2 with ZeRO `zero`, its tokens routed through
    every pair of experts in turn (the uniform routing's mean, exactly): the parameter bytes each
    rank holds and the "ep" bytes of one forward and backward, against the plan's."""
    import torch
    import transformers as tf

    import tplayers
    from tplayers.plan.measure import _held_bytes
    from tplayers.testing.meshes import expert_mesh

    g = expert_mesh(4, 2, 1, 1)
    torch.manual_seed(0)
    cfg = tf.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    model = tf.MixtralForCausalLM(cfg)
    tplayers.parallelize(model, group=g["tp"], expert_group=g["ep"])
    picks = torch.tensor(PICKS)
    for block in model.model.layers:  # the routing replaced as the experts are called
        block.mlp.experts.register_forward_pre_hook(
            lambda mod, args: (args[0], picks[torch.arange(args[0].shape[0]) % len(PICKS)], args[2])
        )
    tplayers.data_parallel(model, group=g["dp"], zero_stage=zero)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(rank))  # 24 tokens: 4 x 6 pairs
    with tplayers.count_bytes() as counted:
        model(ids, labels=ids).loss.backward()
    params = _held_bytes(list(model.parameters()), padded=zero >= 2)
    return params, counted.by_axis()["ep"], cfg.to_dict()


@pytest.mark.multirank
@pytest.mark.parametrize("zero", [0, 3])
def test_plan_prices_a_real_expert_parallel_step(tplayers_pool, zero):
    results = tplayers_pool.run(_measured_step, 4, zero, mesh=("ep", 4, 2, 1, 1))
    spec = plan.ModelSpec.from_hf_config(results[0][2], seq_len=12)
    layout = plan.Layout(dp=4, ep=2, zero_stage=zero, micro_batch=2)
    precision = plan.Precision.preset("fp32-adam")
    from tplayers.plan.estimate import model_state_bytes_per_rank

    tplayers_layers = plan.Assumptions(implementation="tplayers")  # the vocabulary split as it is, not padded
    planned = [p for p, _, _ in model_state_bytes_per_rank(spec, layout, precision, assumptions=tplayers_layers)]
    assert [params for params, _, _ in results] == planned
    est = plan.estimate(
        spec, plan.ClusterSpec.preset("h100", num_gpus=4), layout, precision, assumptions=tplayers_layers
    )
    assert [ep for _, ep, _ in results] == [est.comm_bytes_by_group["ep"]] * 4
