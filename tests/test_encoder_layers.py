"""BERT-style encoders (`tplayers/hf/encoder_layers.py`): the base model (no pooler) of BERT,
RoBERTa, ELECTRA and RoFormer at TP 2, with and without sequence parallelism, through
`parallelize` (its self-check on): the last hidden states, every gradient of a loss on them and
the gathered state dict equal the unsharded model's. Their masked-LM heads (a prediction-head
transform whole on every rank, the LM head vocabulary-parallel with its bias held twice: by the
decoder and by the head): loss, logits, every gradient and both bias entries of the state dict. Their
causal-LM forms are in the newcomer sweep."""

import copy
import inspect
import warnings

import pytest
import torch

import tplayers
from tplayers.hf import gather_grads
from tplayers.hf.encoder_layers import is_intermediate_output_mlp, is_self_output_attention
from tplayers.testing import assert_close, tiny_config

pytestmark = pytest.mark.multirank


def encoder_matches_unsharded(rank, tp, group, model_type, sequence_parallel):
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tiny_config(model_type, heads=4)
        for key, value in list(vars(cfg).items()):
            if type(value) is float and "dropout" in key:
                setattr(cfg, key, 0.0)
        torch.manual_seed(0)
        cls = tf.MODEL_MAPPING[type(cfg)]
        pooler = "add_pooling_layer" in inspect.signature(cls.__init__).parameters
        reference = cls(cfg, add_pooling_layer=False) if pooler else cls(cfg)
    model = tplayers.parallelize(copy.deepcopy(reference), group=group, sequence_parallel=sequence_parallel)
    assert sum(is_self_output_attention(m) for m in reference.modules()) == cfg.num_hidden_layers
    assert sum(is_intermediate_output_mlp(m) for m in reference.modules()) == cfg.num_hidden_layers
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    hidden, expected = model(ids).last_hidden_state, reference(ids).last_hidden_state
    (hidden @ weights).square().mean().backward()
    (expected @ weights).square().mean().backward()
    assert_close(hidden, expected)
    grads = gather_grads(model, group=group)
    for name, p in reference.named_parameters():
        if p.grad is not None:
            assert_close(grads[name], p.grad, msg=lambda m, name=name: f"{model_type} {name}: {m}")
    full = tplayers.gather_state_dict(model, group=group)
    for key, value in reference.state_dict().items():
        assert_close(full[key], value, exact=True, msg=lambda m, k=key: f"{model_type} {k}: {m}")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("model_type", ["bert", "roberta", "electra", "roformer", "roberta-prelayernorm"])
def test_encoder_matches_unsharded(pool, model_type, sequence_parallel):
    pool.run(encoder_matches_unsharded, 2, model_type, sequence_parallel)


def masked_lm_matches_unsharded(rank, tp, group, model_type, sequence_parallel):
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tiny_config(model_type, heads=4, vocab_size=101)  # 51, 50 a rank: uneven
        for key, value in list(vars(cfg).items()):
            if type(value) is float and "dropout" in key:
                setattr(cfg, key, 0.0)
        torch.manual_seed(0)
        reference = tf.MODEL_FOR_MASKED_LM_MAPPING[type(cfg)](cfg)
    model = tplayers.parallelize(copy.deepcopy(reference), group=group, sequence_parallel=sequence_parallel)
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.where(torch.arange(8) % 3 == 0, ids, -100)  # a third of the tokens masked
    out, expected = model(ids, labels=labels), reference(ids, labels=labels)
    assert_close(out.logits, expected.logits)
    assert_close(out.loss, expected.loss)
    out.loss.backward()
    expected.loss.backward()
    grads = gather_grads(model, group=group)
    for name, p in reference.named_parameters():
        if p.grad is not None:
            assert_close(grads[name], p.grad, msg=lambda m, name=name: f"{model_type} {name}: {m}")
    full = tplayers.gather_state_dict(model, group=group)
    assert list(full) == list(reference.state_dict())  # the bias under both of its names
    for key, value in reference.state_dict().items():
        assert_close(full[key], value, exact=True, msg=lambda m, k=key: f"{model_type} {k}: {m}")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("model_type", ["bert", "roberta", "electra"])
def test_masked_lm_heads_match_unsharded(pool, model_type, sequence_parallel):
    pool.run(masked_lm_matches_unsharded, 2, model_type, sequence_parallel)
