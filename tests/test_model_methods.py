"""The HF model's own methods on a parallelized model (`tplayers.hf.model_methods`; save_pretrained's
guard: tests/test_trainer.py). resize_token_embeddings is refused by name. generate() with sampling:
the ranks of a tensor-parallel group draw every token alike, from the group's first rank's stream,
also where the user seeded each rank apart (before, each rank sampled its own tokens and fed them to the next
forward, whose shards then summed parts of different sequences, silently); each rank's generator
comes back as it was, so ranks seeded apart stay apart and ranks seeded alike stay alike."""

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tplayers

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.multirank

PROMPT = torch.tensor([[5, 6, 7, 8]])
SAMPLING = dict(do_sample=True, max_new_tokens=12, top_k=0, temperature=3.0)


def tiny_llama():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=95)  # fmt: skip
    return tf.LlamaForCausalLM(cfg).eval()


def sampled(rank, tp, group, seed_by_rank, copied=False, bypass=False):
    """(this rank's sampled ids, whether its generator came back as the user left it / as the first rank's)."""
    warnings.simplefilter("ignore")
    model = tplayers.parallelize(tiny_llama(), group=group)
    if copied:  # a deep copy samples alike too
        model = copy.deepcopy(model)
    torch.manual_seed(10 + (rank if seed_by_rank else 0))
    before = torch.get_rng_state()
    ids = type(model).generate(model, PROMPT, **SAMPLING) if bypass else model.generate(PROMPT, **SAMPLING)
    return ids.tolist(), torch.equal(torch.get_rng_state(), before)


def unsharded(seed):
    model = tiny_llama()
    torch.manual_seed(seed)
    return model.generate(PROMPT, **SAMPLING).tolist()


@pytest.mark.parametrize("copied", [False, True], ids=["model", "deep-copy"])
def test_ranks_seeded_apart_sample_the_first_ranks_tokens_and_keep_their_own_stream(pool, copied):
    results = pool.run(sampled, 3, True, copied)
    assert [ids for ids, _ in results] == [unsharded(10)] * 3
    assert [restored for _, restored in results] == [False, True, True]  # the first rank's stream moved on


def test_ranks_seeded_alike_sample_as_the_unsharded_model_and_stay_alike(pool):
    results = pool.run(sampled, 2, False)
    assert [ids for ids, _ in results] == [unsharded(10)] * 2
    assert [restored for _, restored in results] == [False, False]  # one stream further, alike


def test_negative_control_the_classs_own_generate_samples_apart(pool):
    first, second = (ids for ids, _ in pool.run(sampled, 2, True, False, True))
    assert first != second


def resized(rank, tp, group):
    model = tplayers.parallelize(tiny_llama(), group=group)
    with pytest.raises(ValueError, match="resize the unsharded model") as caught:
        model.resize_token_embeddings(100)
    return model.get_input_embeddings().weight.shape[0], str(caught.value)


def test_resize_token_embeddings_is_refused_by_name(pool):
    for rows, message in pool.run(resized, 2):
        assert rows == 48 and "LlamaForCausalLM.resize_token_embeddings" in message  # the model as it was


def saved(rank, tp, group, root, family):
    """save_pretrained handed this rank's shards refuses; handed the full state dict, it writes what
    from_pretrained loads as the unsharded model."""
    from test_families import tiny_model

    model = tplayers.parallelize(tiny_model(family), group=group)
    with pytest.raises(ValueError, match="was handed this rank's shards"):
        model.save_pretrained(f"{root}/shards", state_dict=model.state_dict())
    full = tplayers.gather_state_dict(model)
    if rank == 0:
        model.save_pretrained(f"{root}/full", state_dict=full)
    return rank


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3", "mixtral"])  # gate | up interleaved, Conv1D, fused
def test_save_pretrained_takes_the_full_state_dict_and_refuses_this_ranks_shards(pool, tmp_path, family):
    """Handed `gather_state_dict(model)` (accelerate's `get_state_dict`), HF's own save_pretrained writes the
    unsharded checkpoint (its tensors contiguous: HF reads each as one span)."""
    import transformers as tf
    from test_families import tiny_model

    pool.run(saved, 2, str(tmp_path), family)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    for name, value in tiny_model(family).state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def added_inside(rank, tp, group):
    model = tplayers.parallelize(tiny_llama(), group=group)
    from torch.distributed.tensor import Replicate

    from tplayers.placement import set_placement

    extra = model.model.layers[0].self_attn.q_proj.extra = torch.nn.Linear(4, 4)  # inside a sharded module, after
    for p in extra.parameters():  # recorded (as a copy of a sharded module's would be), yet no export knows it
        set_placement(p, group, Replicate())
    with pytest.raises(ValueError, match="no export knows them") as caught:
        tplayers.gather_state_dict(model)
    return str(caught.value)


def test_a_parameter_no_export_knows_is_not_left_out_silently(pool):
    """gather_state_dict (save_pretrained, accelerate's get_state_dict) refuses, naming it, a parameter added
    inside a sharded module after parallelize, which no record exports (peft's modules_to_save added then was
    one: trained, and missing from every checkpoint)."""
    for message in pool.run(added_inside, 2):
        assert "model.layers.0.self_attn.q_proj.extra.weight" in message, message
