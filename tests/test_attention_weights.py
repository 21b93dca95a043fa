"""output_attentions=True on a parallelized model (`tplayers.hf.attention_weights`): every rank
returns the unsharded model's attention weights, every head (gathered in head order, parts of any
size: 4 heads over 3 ranks are 2, 1, 1), also under sequence parallelism and through fused
query / key / value layouts. Before, each rank returned its own heads' only, without an error."""

import importlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tplayers
from tplayers.testing import assert_close

sys.path.insert(0, str(Path(__file__).parent))
from test_families import tiny_model  # noqa: E402

pytestmark = pytest.mark.multirank

FAMILIES = ["llama", "gpt2", "phi3", "falcon", "bloom", "mixtral"]  # GQA, Conv1D, fused qkv, multi-query, ALiBi
IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])  # 7 tokens: parts of 4 and 3 under sequence parallelism at TP 2


def eager(family):
    return tiny_model(family, attn_implementation="eager").eval()  # the attention that returns its weights


def attention_weights(rank, tp, group, family, sequence_parallel, gathered=True):
    warnings.simplefilter("ignore")
    entry = importlib.import_module("tplayers.hf.parallelize")  # the module (the package names its function)

    kept = entry.gather_attention_weights
    if not gathered:  # the negative control: each rank's own heads, as before
        entry.gather_attention_weights = lambda *args, **kwargs: None
    try:
        model = tplayers.parallelize(eager(family), group=group, sequence_parallel=sequence_parallel)
    finally:
        entry.gather_attention_weights = kept
    with torch.no_grad():
        return [a.clone() for a in model(IDS, output_attentions=True).attentions]


@pytest.mark.parametrize("tp, sequence_parallel", [(2, False), (3, False), (2, True)], ids=["tp2", "tp3", "tp2-sp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_attention_weights_are_the_unsharded_models(pool, family, tp, sequence_parallel):
    with torch.no_grad():
        expected = eager(family)(IDS, output_attentions=True).attentions
    for got in pool.run(attention_weights, tp, family, sequence_parallel):
        assert len(got) == len(expected)
        for layer, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_close(a, b, msg=lambda m, layer=layer: f"layer {layer}: {m}")


def test_negative_control_each_ranks_own_heads_differ(pool):
    expected = eager("llama")(IDS, output_attentions=True).attentions[0]
    for got in pool.run(attention_weights, 2, "llama", False, False):
        assert got[0].shape != expected.shape  # 2 of the 4 heads


def under_context_parallelism(rank, world, group):
    from tplayers.testing.meshes import context_mesh

    groups = context_mesh(1, 1, 2, 2)
    model = tplayers.parallelize(eager("llama"), group=groups["tp"], context_group=groups["cp"])
    with pytest.raises(ValueError, match="output_attentions under context parallelism"):
        model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), output_attentions=True)


def test_output_attentions_under_context_parallelism_is_refused(pool):
    pool.run(under_context_parallelism, 4, mesh=("cp", 1, 1, 2, 2))


def encoder_decoder_weights(rank, tp, group, model_type):
    from test_seq2seq import batch, tiny_seq2seq

    warnings.simplefilter("ignore")
    model = tplayers.parallelize(tiny_seq2seq(model_type, 4, attn_implementation="eager").eval(), group=group)
    inputs = {k: v for k, v in batch().items() if k != "labels"}
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    return {k: [a.clone() for a in getattr(out, k)] for k in ("encoder_attentions", "decoder_attentions",
                                                              "cross_attentions")}  # fmt: skip


@pytest.mark.parametrize("model_type", ["bart", "t5"])  # T5's layers return their position bias beside the weights
def test_encoder_decoder_self_and_cross_attention_weights(pool, model_type):
    from test_seq2seq import batch, tiny_seq2seq

    reference = tiny_seq2seq(model_type, 4, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(**{k: v for k, v in batch().items() if k != "labels"}, output_attentions=True)
    for got in pool.run(encoder_decoder_weights, 2, model_type):
        for key, weights in got.items():
            assert len(weights) == len(getattr(expected, key)), key
            for a, b in zip(weights, getattr(expected, key), strict=True):
                assert_close(a, b, msg=lambda m, key=key: f"{key}: {m}")
