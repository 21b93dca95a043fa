"""Sequence parallelism over lengths the TP size does not divide (tplayers.hf.sequence_split): the
loss and every gradient of training steps of different lengths equal the unsharded model's, with
HF's gradient checkpointing (which runs a block's forward again inside backward, outside the
block's hooks) and without; MoE router logits (the auxiliary loss) and Gemma 3n's stacked AltUp
streams gathered back whole from parts of different sizes."""

import copy

import pytest
import torch
from test_families import VOCAB, tiny_model

import tplayers
from tplayers.testing import RemoteError, assert_close, differing_grads, grads_as_state_dict

pytestmark = pytest.mark.multirank

# (family, its config overrides, TP size, lengths of the steps: none a multiple of the TP size but the last)
CASES = {
    "llama-tp3": ("llama", {}, 3, (7, 10, 5, 9)),
    "mixtral-aux-loss-tp4": ("mixtral", {"output_router_logits": True, "router_aux_loss_coef": 0.5}, 4, (9, 6, 8)),
    "gemma3n-altup-tp2": ("gemma3n_text", {}, 2, (7, 5, 6)),
}


def steps_of_other_lengths(rank, tp, group, family, config, lengths, checkpointing):
    model = tiny_model(family, **config).train()
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=group, sequence_parallel=True)
    if checkpointing:
        for m in (model, reference):
            m.gradient_checkpointing_enable()
    for length in lengths:
        ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        want = reference(ids, labels=ids, use_cache=False).loss
        want.backward()
        got = model(ids, labels=ids, use_cache=False).loss
        got.backward()
        assert_close(got, want, msg=lambda m, n=length: f"loss of {n} tokens: {m}")
        wrong = differing_grads(model, grads_as_state_dict(reference))
        assert not wrong, f"{length} tokens: {wrong[:3]}"


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
@pytest.mark.parametrize("case", CASES)
def test_lengths_the_group_does_not_divide(pool, case, checkpointing):
    family, config, tp, lengths = CASES[case]
    pool.run(steps_of_other_lengths, tp, family, config, lengths, checkpointing)


def too_short(rank, tp, group):
    model = tplayers.parallelize(tiny_model("llama"), group=group, sequence_parallel=True)
    model(torch.zeros(1, 2, dtype=torch.long))  # 3 ranks, 2 tokens: one rank would hold none


def test_a_sequence_shorter_than_the_group_is_refused_on_every_rank(pool):
    for reply in pool.run(too_short, 3, return_exceptions=True):
        assert isinstance(reply, RemoteError), reply
        assert "no sequence (dimension 1) of at least 3 tokens, one for each rank" in reply.message, reply.message


def after_a_stopped_backward(rank, tp, group):
    """A backward stopped early (`torch.autograd.grad` of an inner tensor) leaves the split it reopened for a
    block's recompute open: the next forward, of another length, must not read it."""
    from tplayers.functional.sequence import open_split

    open_split(5, tp, reopened=True)  # what such a backward leaves
    steps_of_other_lengths(rank, tp, group, "llama", {}, (7,), True)


def test_a_split_a_stopped_backward_left_open_is_not_read(pool):
    pool.run(after_a_stopped_backward, 3)
