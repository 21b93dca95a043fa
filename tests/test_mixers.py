"""Hybrid and state-space models under tensor parallelism: Gated DeltaNet (Qwen3-Next, Qwen3.5)
and Mamba 2 mixers (Mamba2, Bamba, Nemotron-H, Granite-4 hybrid, Falcon-H1, Zamba2) split by
heads (`tplayers.hf.mixers`), exact against the unsharded model: logits, loss, every parameter
after one SGD step through `gather_state_dict`, and greedy `generate()` with the cache holding
each rank's heads; head and group counts that do not divide the ranks."""

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tplayers
from tplayers.testing import assert_close, examples

sys.path.insert(0, str(Path(__file__).parent))
from test_families import matches_unsharded  # noqa: E402

pytestmark = pytest.mark.multirank

# Gated DeltaNet: 3 key heads of 8, each with 2 value heads of 8; one linear-attention layer and
# one full-attention layer; Qwen3-Next's MoE on both.
DELTANET = dict(linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])  # fmt: skip
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
# Mamba 2: hidden 36, 9 heads of 8 (expand 2), state 8, chunks of 4 over the 8 tokens, one group
# over every head (B / C whole on every rank, the gated norm's sum of squares over the group).
MAMBA2 = dict(hidden_size=36, num_heads=9, head_dim=8, expand=2, n_groups=1, state_size=8, conv_kernel=4,
              chunk_size=4)  # fmt: skip
MAMBA_HYBRID = dict(hidden_size=36, mamba_n_heads=9, mamba_d_head=8, mamba_expand=2, mamba_n_groups=1,
                    mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4, num_attention_heads=6,
                    num_key_value_heads=2, head_dim=6)  # fmt: skip
LFM2 = dict(hidden_size=36, num_attention_heads=6, num_key_value_heads=2, conv_L_cache=3,
            layer_types=["conv", "full_attention"])  # fmt: skip
# At TP 4: 4 key heads (Gated DeltaNet), 4 groups (Mamba 2 with groups) where the others have 3.
TP4 = {f: dict(linear_num_key_heads=4, linear_num_value_heads=8) for f in ("qwen3_next", "qwen3_5_text",
                                                                           "qwen3_5_moe_text")}  # fmt: skip
TP4["mamba2-groups"] = dict(n_groups=4, num_heads=8, head_dim=9)
MIXERS = {
    "qwen3_next": ("qwen3_next", dict(DELTANET, **QWEN_MOE)),
    "qwen3_5_text": ("qwen3_5_text", DELTANET),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", dict(DELTANET, **QWEN_MOE)),
    "mamba2": ("mamba2", MAMBA2),
    "mamba2-groups": ("mamba2", dict(MAMBA2, n_groups=3)),  # 3 groups of 3 heads: whole groups per rank
    "bamba": ("bamba", dict(MAMBA_HYBRID, attn_layer_indices=[1])),
    "granitemoehybrid": (
        "granitemoehybrid",
        dict(
            MAMBA_HYBRID,
            layer_types=["mamba", "attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=16,
        ),
    ),  # fmt: skip
    "nemotron_h": (
        "nemotron_h",
        dict(
            hidden_size=36,
            mamba_num_heads=9,
            mamba_head_dim=8,
            expand=2,
            n_groups=1,
            ssm_state_size=8,
            chunk_size=4,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=6,
            layers_block_type=["mamba", "attention", "mlp"],
            num_hidden_layers=3,
        ),
    ),  # fmt: skip
    "falcon_h1": (
        "falcon_h1",
        dict(MAMBA_HYBRID, mamba_d_ssm=72, ssm_multipliers=[1.5, 0.5, 2.0, 0.75, 1.25], mamba_rms_norm=False),
    ),  # fmt: skip
    # Mamba 1: 72 channels (36 x 2: 36 / 36 at TP 2, 24 at TP 3, 18 at TP 4), state 8, dt rank 5
    "mamba": ("mamba", dict(hidden_size=36, state_size=8, expand=2, conv_kernel=4, time_step_rank=5)),
    # Falcon-Mamba: weightless norms on dt / B / C
    "falcon_mamba": ("falcon_mamba", dict(hidden_size=36, state_size=8, expand=2, conv_kernel=4, time_step_rank=5)),
    # Jamba: Mamba 1 layers with weighted norms on dt / B / C, attention every 2nd layer, experts every 2nd
    "jamba": (
        "jamba",
        dict(
            hidden_size=36,
            mamba_d_state=8,
            mamba_expand=2,
            mamba_d_conv=4,
            mamba_dt_rank=5,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            num_attention_heads=6,
            num_key_value_heads=2,
        ),
    ),
    # LFM2: gated short convolutions (kernel 3) over 36 channels, w1 / w3 / w2 MLPs; LFM2-MoE with experts
    "lfm2": ("lfm2", dict(LFM2, block_ff_dim=64)),
    "lfm2_moe": (
        "lfm2_moe",
        dict(LFM2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_dense_layers=1),
    ),  # fmt: skip
    # MiniMax: lightning attention (6 heads of 6, blocks of 4 over the 8 tokens) and softmax attention layers
    "minimax": (
        "minimax",
        dict(
            hidden_size=36,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=6,
            block_size=4,
            layer_types=["linear_attention", "full_attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    # Falcon-H1-7B's own gated norm (weight in fp32, the gate before it) over 3 groups split whole
    "falcon_h1-norm": (
        "falcon_h1",
        dict(MAMBA_HYBRID, mamba_d_ssm=72, mamba_rms_norm=True, mamba_n_groups=3, mamba_norm_before_gate=False),
    ),  # fmt: skip
}
TP4["falcon_h1-norm"] = dict(mamba_n_groups=1)  # one group over every head at TP 4


def hybrid_matches_unsharded(rank, tp, group, family, sequence_parallel, config):
    import test_families

    test_families.VARIANTS.update(MIXERS)  # in this rank's process
    matches_unsharded(rank, tp, group, family, sequence_parallel, torch.float32, config=config)


# Every variant at TP 2 with and without SP; TP 3 (uneven heads, channels and groups) and TP 4 + SP
# for one variant of each mixer layout (the rest share their adapter with one of these)
WIDE = ["qwen3_next", "qwen3_5_text", "mamba2", "mamba2-groups", "nemotron_h", "falcon_h1-norm", "jamba", "lfm2",
        "minimax"]  # fmt: skip
LAYOUTS = [(f, 2, sp) for f in MIXERS for sp in (False, True)] + [(f, t, t == 4) for f in WIDE for t in (3, 4)]


@pytest.mark.parametrize("family, tp, sequence_parallel", LAYOUTS,
                         ids=[f"{f}-tp{t}{'-sp' * s}" for f, t, s in LAYOUTS])  # fmt: skip
def test_hybrid_matches_unsharded(pool, family, tp, sequence_parallel):
    pool.run(hybrid_matches_unsharded, tp, family, sequence_parallel, TP4.get(family, {}) if tp == 4 else {},
             mesh=(1, 1, tp))  # fmt: skip


# ---- the standalone mixer against transformers' own, over heads, groups, state sizes, TP 1-4 ----


class _Holder(torch.nn.Module):
    """One mixer as a model: parallelize places it like any module of a model."""

    def __init__(self, mixer):
        super().__init__()
        self.mixer = mixer

    def forward(self, x):
        return self.mixer(x)


def _mixer(kind, shape):
    import copy
    import warnings

    import transformers as tf

    torch.manual_seed(shape["seed"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "mamba2":
            heads, hd, groups = shape["heads"], shape["head_dim"], shape["groups"]
            cfg = tf.Mamba2Config(hidden_size=heads * hd // 2, num_heads=heads, head_dim=hd, expand=2, n_groups=groups,
                                  state_size=shape["state"], conv_kernel=shape["kernel"], chunk_size=shape["chunk"],
                                  num_hidden_layers=1, use_conv_bias=shape["bias"], use_bias=shape["bias"])  # fmt: skip
            mixer = tf.models.mamba2.modeling_mamba2.Mamba2Mixer(cfg, layer_idx=0)
            with torch.no_grad():  # away from the init's ones: a norm weight tplayers split wrongly shows
                mixer.norm.weight.uniform_(0.5, 1.5)
        elif kind == "mamba1":
            cfg = tf.MambaConfig(hidden_size=shape["hidden"], state_size=shape["state"], expand=2,
                                 conv_kernel=shape["kernel"], time_step_rank=shape["dt_rank"], num_hidden_layers=1,
                                 use_conv_bias=shape["bias"], use_bias=shape["bias"])  # fmt: skip
            mixer = tf.models.mamba.modeling_mamba.MambaMixer(cfg, layer_idx=0)
        else:
            kh, per = shape["heads"], shape["per"]
            cfg = tf.Qwen3NextConfig(hidden_size=24, linear_num_key_heads=kh, linear_num_value_heads=kh * per,
                                     linear_key_head_dim=shape["head_dim"], linear_value_head_dim=shape["state"],
                                     linear_conv_kernel_dim=shape["kernel"], num_hidden_layers=1,
                                     layer_types=["linear_attention"])  # fmt: skip
            mixer = tf.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
            with torch.no_grad():
                mixer.norm.weight.uniform_(0.5, 1.5)
    return _Holder(mixer).train(), copy.deepcopy(_Holder(mixer)).train(), cfg.hidden_size


def standalone_mixer_matches(rank, tp, group, kind, shape):
    from tplayers.hf import gather_grads

    model, reference, hidden = _mixer(kind, shape)
    tplayers.parallelize(model, group=group, verify=False)
    x = torch.randn(2, shape["seq"], hidden, generator=torch.Generator().manual_seed(7))
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = model(xs), reference(xr)
    assert_close(out, expected, msg=lambda m: f"{kind} {shape} output: {m}")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    out.backward(grad)
    expected.backward(grad)
    assert_close(xs.grad, xr.grad, msg=lambda m: f"{kind} input gradient: {m}")
    grads = gather_grads(model)
    for name, p in reference.named_parameters():
        assert_close(grads[name], p.grad, msg=lambda m, k=name: f"{kind} {shape} {k}: {m}")


@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_standalone_mixers_match_transformers(pool, data):
    """A Mamba 1 and a Mamba 2 mixer and a Gated DeltaNet alone, at TP 1-4 with heads, groups and state sizes
    drawn (uneven splits, one group over every head, whole groups per rank): output, input
    gradient and every parameter's gradient equal transformers' unsharded mixer's."""
    kind = data.draw(st.sampled_from(["mamba2", "gated_deltanet", "mamba1"]), label="kind")
    tp = data.draw(st.integers(1, 4), label="tp")
    shape = dict(seed=data.draw(st.integers(0, 99), label="seed"), seq=data.draw(st.integers(1, 9), label="seq"),
                 kernel=data.draw(st.integers(2, 4), label="kernel"),
                 bias=data.draw(st.booleans(), label="bias"))  # fmt: skip
    if kind == "mamba2":
        groups = data.draw(st.sampled_from([1] + [g for g in (2, 3, 4) if g >= tp]), label="groups")
        heads = groups * data.draw(st.integers(max(1, -(-tp // groups)), 3), label="heads per group")
        shape.update(heads=heads, groups=groups, head_dim=data.draw(st.sampled_from([2, 4]), label="head_dim"),
                     state=data.draw(st.sampled_from([2, 5, 8]), label="state"),
                     chunk=data.draw(st.integers(2, 5), label="chunk"))  # fmt: skip
    elif kind == "mamba1":  # 2 x hidden channels, unevenly over 3
        shape.update(hidden=data.draw(st.sampled_from([4, 7, 10]), label="hidden"),
                     state=data.draw(st.sampled_from([2, 5, 8]), label="state"),
                     dt_rank=data.draw(st.integers(1, 4), label="dt rank"))  # fmt: skip
    else:
        shape.update(heads=data.draw(st.integers(tp, 4), label="key heads"), per=data.draw(st.integers(1, 2)),
                     head_dim=data.draw(st.sampled_from([4, 8]), label="head_k_dim"),
                     state=data.draw(st.sampled_from([4, 6]), label="head_v_dim"))  # fmt: skip
    pool.run(standalone_mixer_matches, tp, kind, shape, mesh=(1, 1, tp))


# ---- pipelines of hybrid stacks ----------------------------------------------------------------


def hybrid_pipeline_trains_like_unsharded(rank, world, group, pp, tp, sequence_parallel, family):
    """tests/test_pipeline.py's check (3 AdamW steps with clipping over the stages equal the
    unsharded model's) on a 4-layer hybrid whose stages hold different layer types: [linear,
    linear] and [linear, full attention]."""
    import test_pipeline

    model_type, config = MIXERS[family]
    config = dict(config, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    test_pipeline.hf_split_trains_like_unsharded(rank, world, group, pp, tp, "1f1b", sequence_parallel, False,
                                                 model_type, config)  # fmt: skip


@pytest.mark.parametrize("family, tp, sequence_parallel", [("qwen3_5_text", 1, False), ("qwen3_next", 2, True)],
                         ids=["qwen3_5-pp2", "qwen3_next-pp2-tp2-sp"])  # fmt: skip
def test_pipeline_split_of_hybrid_stacks(pool, family, tp, sequence_parallel):
    pool.run(hybrid_pipeline_trains_like_unsharded, 2 * tp, 2, tp, sequence_parallel, family)


# ---- LoRA on the mixers' projections -----------------------------------------------------------

# peft's regexes over the full names (out_proj alone would also name tplayers' fused MLP layers);
# peft itself refuses out_proj (and conv1d) on Mamba models: mamba_ssm's fused path reads its weight
LORA_TARGETS = {
    "qwen3_5_text": r".*linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)",
    "qwen3_next": r".*linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj)",
    "mamba2": r".*mixer\.in_proj",
    "mamba2-groups": r".*mixer\.in_proj",
}


def lora_on_mixers(rank, world, group, family, order, sequence_parallel):
    import test_families
    import test_lora

    test_families.VARIANTS.update(MIXERS)
    test_lora.TARGETS.update(LORA_TARGETS)
    return test_lora.train_against_unsharded(rank, world, group, family, order, sequence_parallel)


LORA_CASES = [(f, order, tp, sp) for f in sorted(LORA_TARGETS) for order, tp, sp in ((1, 2, False), (2, 2, True),
                                                                                     (1, 3, False))]  # fmt: skip
# peft (0.21) also wraps Qwen3-Next's shared_expert.out_proj, which its regex does not name, where the
# model was parallelized first (tplayers' fused MLP there): refused by tplayers, naming the layer
LORA_CASES.remove(("qwen3_next", 2, 2, True))
# one group over every head: parallelize computes B / C once and gathers them; an adapter on in_proj
# goes on before (order 1), which keeps them whole for it (test_lora_after_gathered_bc_is_refused)
LORA_CASES.remove(("mamba2", 2, 2, True))


@pytest.mark.parametrize("family, order, tp, sequence_parallel", LORA_CASES,
                         ids=[f"{f}-order{o}-tp{t}{'-sp' * s}" for f, o, t, s in LORA_CASES])  # fmt: skip
def test_lora_on_mixer_projections(pool, family, order, tp, sequence_parallel):
    """peft's LoRA on in_proj / out_proj (and Gated DeltaNet's projections), both orders: the
    losses, every adapter gradient and weight after 2 AdamW steps equal the unsharded peft model's."""
    pool.run(lora_on_mixers, tp, family, order, sequence_parallel, mesh=(1, 1, tp))


def lora_after_gathered_bc(rank, world, group):
    import test_families
    import test_lora

    test_families.VARIANTS.update(MIXERS)
    test_lora.TARGETS.update(LORA_TARGETS)
    with pytest.raises(ValueError, match="computed once and gathered.*add the adapter before tplayers.parallelize"):
        test_lora.sharded("mamba2", 2, group, False)


def test_lora_after_gathered_bc_is_refused(pool):
    pool.run(lora_after_gathered_bc, 2, mesh=(1, 1, 2))


# ---- checkpoints -------------------------------------------------------------------------------
CHECKPOINTED = ["qwen3_next", "mamba2", "mamba2-groups", "jamba", "falcon_h1-norm", "lfm2"]


@pytest.mark.parametrize("family", CHECKPOINTED)
def test_hf_directory_loads_sliced_on_meta_and_exports_back(pool, tmp_path, family):
    """`load_pretrained` of a hybrid's HF directory into the model built on meta and sharded at
    TP 2 (each rank reads exactly the slices it holds), a step, `save_pretrained`: transformers
    loads it back and gives the same logits."""
    import test_checkpoint
    import test_families
    import transformers as tf

    test_families.VARIANTS.update(MIXERS)
    reference = test_families.tiny_model(family)
    reference.save_pretrained(tmp_path / "source")
    full = sum(p.numel() for p in reference.parameters())
    for read, held, logits in pool.run(test_checkpoint.from_hf_directory, 2, tmp_path / "source",
                                       tmp_path / "trained", family):  # fmt: skip
        assert read == held < full  # each rank read exactly the slices it holds
        back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "trained")
        with torch.no_grad():
            assert_close(back(test_checkpoint.batch(1)).logits, logits)


def checkpoint_at(rank, world, group, family, path, save, seed):
    """Save (or load into a model of other weights) a tplayers checkpoint of the hybrid at TP
    `world`; the full state after it."""
    import test_families

    test_families.VARIANTS.update(MIXERS)
    torch.manual_seed(seed)
    model = test_families.tiny_model(family)
    if seed:  # other weights: everything must come from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    tplayers.parallelize(model, group=group, verify=False)
    if save:
        tplayers.save_checkpoint(path, model=model, group=group)
    else:
        tplayers.load_checkpoint(path, model=model, group=group)
    return tplayers.gather_state_dict(model, group=group)


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2", "jamba"])
def test_a_checkpoint_saved_at_tp2_loads_at_tp3(pool, tmp_path, family):
    """The sharded checkpoint holds each tensor once in the HF layout: saved at TP 2 (Mamba 2's B /
    C computed 1/2 per rank and gathered), loaded at TP 3 (whole groups differently split) bitwise."""
    saved = pool.run(checkpoint_at, 2, family, tmp_path / "ckpt", True, 0, mesh=(1, 1, 2))[0]
    loaded = pool.run(checkpoint_at, 3, family, tmp_path / "ckpt", False, 1, mesh=(1, 1, 3))[0]
    assert list(saved) == list(loaded)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
