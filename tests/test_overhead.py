"""No overhead from being parallel: a training step of a parallelized HF Llama on the torch
backend runs no more ops than the unsharded model's, per layer, at TP 1, and no more than the
Megatron collectives add at TP 2; it waits on the device nowhere. Ops are counted through the
dispatcher (`tplayers.testing.ops.count_ops`): what a GPU would launch, backward included."""

import pytest
import torch

import tplayers
from tplayers.testing.ops import count_ops

pytestmark = pytest.mark.multirank

VOCAB = 128


def llama(layers, dtype):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    config._attn_implementation = "sdpa"
    return tf.LlamaForCausalLM(config).to(dtype).train()


def ops_per_step(model, warm=4):
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(warm):  # the same-inputs check, the first gradients
        model(input_ids=ids, labels=ids).loss.backward()
    with count_ops() as ops:
        model(input_ids=ids, labels=ids).loss.backward()
    return ops


def counts(rank, tp, group, dtype, extra_clone=False):
    """{(provider, layers): (launches, syncs)} of one step at 1 and 3 layers."""
    tplayers.set_backend("torch")
    out = {}
    for layers in (1, 3):
        out["hf", layers] = ops_per_step(llama(layers, dtype))
        model = tplayers.parallelize(llama(layers, dtype), group=group, verify=False, overlap=False)
        if extra_clone:  # negative control: one more copy per layer
            for block in model.model.layers:
                block.register_forward_hook(
                    lambda m, a, o: (o[0].clone(), *o[1:]) if isinstance(o, tuple) else o.clone()
                )
        out["tp", layers] = ops_per_step(model)
    return {k: (v.launches, v.syncs, dict(v.by_name)) for k, v in out.items()}


def per_layer(c, provider):
    return (c[provider, 3][0] - c[provider, 1][0]) / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tp1_runs_no_more_than_the_unsharded_model(pool, dtype):
    (c,) = pool.run(counts, 1, dtype)
    assert per_layer(c, "tp") <= per_layer(c, "hf"), c
    # the rest of the step: the fused loss's few row-statistics ops in place of HF's loss
    assert c["tp", 1][0] - c["hf", 1][0] <= 50, (c["tp", 1][0], c["hf", 1][0])
    assert c["tp", 1][1] == c["tp", 3][1] == 0  # no host sync anywhere in the step
    for copy in ("clone", "copy_", "_to_copy"):  # no copy or cast per layer beyond the unsharded model's
        grows = {p: c[p, 3][2].get(copy, 0) - c[p, 1][2].get(copy, 0) for p in ("tp", "hf")}
        assert grows["tp"] <= grows["hf"], (copy, grows)


def test_tp2_adds_only_the_megatron_collectives(pool):
    """Per layer at TP 2: 2 all-reduces forward, 2 backward, their input-gradient copies
    (all-reduced in place) and the attention's per-head bookkeeping; a budget of 12."""
    c = pool.run(counts, 2, torch.float32)[0]
    assert per_layer(c, "tp") <= per_layer(c, "hf") + 12, (per_layer(c, "tp"), per_layer(c, "hf"))
    assert c["tp", 3][2]["allreduce_"] - c["tp", 1][2]["allreduce_"] == 2 * 4


def test_negative_control_an_extra_copy_per_layer_is_counted(pool):
    base = pool.run(counts, 1, torch.float32)[0]
    more = pool.run(counts, 1, torch.float32, True)[0]
    assert per_layer(more, "tp") == per_layer(base, "tp") + 1
    grows = {p: more[p, 3][2].get("clone", 0) - more[p, 1][2].get("clone", 0) for p in ("tp", "hf")}
    assert grows["tp"] == grows["hf"] + 2  # one per layer, over the two more layers: what the copy check catches
