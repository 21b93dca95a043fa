"""What the user froze stays frozen through `parallelize` (`tplayers.hf.frozen`): a frozen embedding
and layer, one half of a gated MLP frozen (gate_proj and up_proj are then kept apart, not fused),
BitFit's frozen weights with trainable biases (peft's frozen base under prompt tuning:
tests/test_peft_tuners.py). Before,
every parameter the sharding pass rebuilt came back trainable and the optimizer trained what the
user had frozen, silently. check_parallel compares every parameter and gradient (a frozen one has
none) against the unsharded model after two SGD steps; the negative control unfreezes as before."""

import warnings

import pytest
import torch
import transformers as tf

import tplayers
from tplayers.plan import Layout
from tplayers.testing import ParallelMismatch, check_parallel

pytestmark = pytest.mark.multirank

IDS = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1))  # 7 tokens: uneven under SP


def llama():
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=3)  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def frozen_llama():
    model = llama()
    model.model.embed_tokens.weight.requires_grad_(False)  # tied to nothing: the LM head trains
    model.model.layers[0].requires_grad_(False)
    model.model.layers[1].mlp.gate_proj.requires_grad_(False)  # up_proj trains: the two are not fused
    return model


def bitfit_gpt2():
    cfg = tf.GPT2Config(vocab_size=64, n_embd=24, n_layer=2, n_head=3, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)  # fmt: skip
    model = tf.GPT2LMHeadModel(cfg)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(".bias"))
    return model


def parallelized(model, mesh, layout):
    warnings.simplefilter("ignore")
    tplayers.parallelize(model, group=mesh["tp"], sequence_parallel=layout.sequence_parallel)
    return tplayers.data_parallel(model, group=mesh["dp"], zero_stage=layout.zero_stage)


def unfrozen_after(model, mesh, layout):
    """The negative control: every parameter trainable after parallelize, as the pass left them before."""
    model = parallelized(model, mesh, layout)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


LAYOUTS = [Layout(tp=2), Layout(tp=3, sequence_parallel=True), Layout(tp=2, dp=2, zero_stage=3)]


@pytest.mark.parametrize("build", [frozen_llama, bitfit_gpt2], ids=["llama", "bitfit"])
def test_frozen_parameters_stay_frozen(build):
    check_parallel(build, parallelized, IDS, layouts=LAYOUTS, steps=2)


def test_negative_control_unfrozen_parameters_train():
    with pytest.raises(ParallelMismatch, match="has a gradient the unsharded model's lacks"):
        check_parallel(frozen_llama, unfrozen_after, IDS, layouts=LAYOUTS[:1])


def flags_after(rank, world, group):
    model = tplayers.parallelize(frozen_llama(), group=group)
    mlp = model.model.layers[1].mlp
    return sorted(n for n, p in model.named_parameters() if not p.requires_grad), hasattr(mlp, "gate_proj")


def test_frozen_names_and_the_mixed_mlp_kept_apart(pool):
    names, apart = pool.run(flags_after, 2)[0]
    assert apart  # gate_proj frozen, up_proj not: not fused into one in_proj
    assert "model.embed_tokens.weight" in names and "model.layers.1.mlp.gate_proj.weight" in names
    assert not any(n.startswith("model.layers.1.mlp.up_proj") or n.startswith("lm_head") for n in names)
