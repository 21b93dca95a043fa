"""peft's tuners besides LoRA (`tplayers.hf.peft_tuners`): prompt tuning, p-tuning (its MLP or LSTM
prompt encoder kept whole on every rank) and LN tuning train exactly as unsharded, their frozen
base frozen; the adapter saves under peft's names and loads into the unsharded model; greedy
generation follows the virtual tokens. The other tuners are refused by name before anything is
sharded (before: "could not place" their base layers, or a raw size mismatch in the self-check)."""

import warnings

import peft
import pytest
import torch
import transformers as tf

import tplayers
from tplayers.plan import Layout
from tplayers.testing import check_parallel

pytestmark = pytest.mark.multirank

IDS = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1))
LAYOUTS = [Layout(tp=2), Layout(tp=3, sequence_parallel=True), Layout(tp=2, dp=2, zero_stage=3)]


def llama():
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=3, eos_token_id=63)  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def tuned(config):
    model = peft.get_peft_model(llama(), config)
    with torch.no_grad():  # away from peft's initial values, which may leave the output unchanged
        for p in (p for p in model.parameters() if p.requires_grad):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    return model


def prompt_tuned():
    return tuned(peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))


def p_tuned_mlp():
    return tuned(peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=16))


def p_tuned_lstm():
    return tuned(peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=16,
                                          encoder_reparameterization_type="LSTM"))  # fmt: skip


def ln_tuned():
    return tuned(peft.LNTuningConfig(task_type="CAUSAL_LM", target_modules=["input_layernorm", "norm"]))


def parallelized(model, mesh, layout):
    warnings.simplefilter("ignore")
    tplayers.parallelize(model, group=mesh["tp"], sequence_parallel=layout.sequence_parallel)
    return tplayers.data_parallel(model, group=mesh["dp"], zero_stage=layout.zero_stage)


@pytest.mark.parametrize(
    "build, layouts",
    [(prompt_tuned, LAYOUTS), (p_tuned_mlp, LAYOUTS[:1]), (p_tuned_lstm, LAYOUTS[1:2]), (ln_tuned, LAYOUTS[1:])],
    ids=["prompt", "p-tuning-mlp", "p-tuning-lstm", "ln-tuning"],
)
def test_tuner_trains_as_unsharded(build, layouts):
    check_parallel(build, parallelized, IDS, layouts=layouts, steps=2)


def saved_and_generated(rank, tp, group, path):
    model = tplayers.parallelize(p_tuned_mlp(), group=group)
    with torch.no_grad():
        model.prompt_encoder.default.embedding.weight.mul_(2)  # as training would change it
    tplayers.save_pretrained(model, path, group=group)
    return model.generate(input_ids=IDS[:1], max_new_tokens=5, do_sample=False).tolist()


def test_the_adapter_saves_for_the_unsharded_model_and_generates_alike(pool, tmp_path):
    generated = pool.run(saved_and_generated, 2, str(tmp_path))
    loaded = peft.PeftModel.from_pretrained(llama(), str(tmp_path))
    expected = p_tuned_mlp()
    with torch.no_grad():
        expected.prompt_encoder.default.embedding.weight.mul_(2)
    want = expected.generate(input_ids=IDS[:1], max_new_tokens=5, do_sample=False).tolist()
    assert generated == [want, want]
    # peft saves p-tuning's encoder output, the virtual tokens' embeddings, which the loaded model uses
    assert loaded.generate(input_ids=IDS[:1], max_new_tokens=5, do_sample=False).tolist() == want


CONFIGS = {
    "ia3": (
        lambda: peft.IA3Config(
            task_type="CAUSAL_LM", target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]
        ),
        "peft's IA3",
    ),  # fmt: skip
    "loha": (lambda: peft.LoHaConfig(task_type="CAUSAL_LM", target_modules=["q_proj"]), "peft's LOHA"),
    "prefix": (lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3), "prefix tuning"),
}


def refused(rank, tp, group, kind):
    config, _ = CONFIGS[kind]
    model = peft.get_peft_model(llama(), config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as caught:
        tplayers.parallelize(model, group=group)
    after = model.state_dict()
    return str(caught.value), before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_other_tuners_are_refused_by_name_and_the_model_given_back(pool, kind):
    for message, untouched in pool.run(refused, 2, kind):
        assert CONFIGS[kind][1] in message and "supported" in message, message
        assert untouched
