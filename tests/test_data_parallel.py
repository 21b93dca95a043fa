"""Data parallelism and ZeRO 0-3 (`tplayers.data_parallel`) composed with tensor parallelism on
a (dp, tp) mesh of 4 local ranks: a parallelized tiny Llama trained for a few AdamW steps with
global-norm clipping equals the unsharded model trained on the whole batch (every loss, every
clipped norm, every weight after); the errors a user can make are refused on every rank."""

import copy
import re
import warnings

import pytest
import torch
import torch.distributed as dist

import tplayers
from tplayers.testing import RemoteError, assert_close

pytestmark = pytest.mark.multirank

VOCAB = 96


def tiny_llama(layers=2):
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False)  # fmt: skip
    return tf.LlamaForCausalLM(cfg).eval()


def build(dp, tp, stage, sequence_parallel):
    mesh = tplayers.init_mesh(dp=dp, tp=tp)
    model = tiny_llama()
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=mesh["tp"], sequence_parallel=sequence_parallel, verify=False)
    tplayers.data_parallel(model, group=mesh["dp"], zero_stage=stage)
    return mesh, model, reference


def batch(step, dp):
    return torch.randint(3, VOCAB, (2 * dp, 8), generator=torch.Generator().manual_seed(10 + step))


def trains_like_unsharded(rank, world, group, dp, tp, stage, sequence_parallel, steps=3):
    mesh, model, reference = build(dp, tp, stage, sequence_parallel)
    # eps 1e-4: Adam's division must not turn the reduction-order noise of a near-zero gradient
    # (1e-9) into a whole step (lr); with eps 1e-8 one weight in thousands differs by 2e-5
    opt = tplayers.data_parallel_optimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-4)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    for step in range(steps):
        ids = batch(step, dp)
        mine = ids.chunk(dp)[dp_rank]
        loss = model(mine, labels=mine).loss
        loss.backward()
        norm = tplayers.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        ref_loss = reference(ids, labels=ids).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=dp_group)
        assert_close(mean_loss / dp, ref_loss.detach(), msg=lambda m, s=step: f"loss at step {s}: {m}")
        assert_close(norm, ref_norm, msg=lambda m, s=step: f"clipped norm at step {s}: {m}")
    full = tplayers.gather_state_dict(model, group=mesh["tp"])
    for key, value in reference.state_dict().items():
        assert_close(full[key], value, msg=lambda m, k=key: f"{k} after {steps} steps: {m}")
    if stage <= 1:  # replicas hold identical shards
        for name, p in model.named_parameters():
            copies = [torch.empty_like(p) for _ in range(dp)]
            dist.all_gather(copies, p.detach().contiguous(), group=dp_group)
            assert all(torch.equal(c, copies[0]) for c in copies), name


LAYOUTS = [(2, 2), (1, 4), (4, 1)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp, tp", LAYOUTS, ids=[f"dp{d}xtp{t}" for d, t in LAYOUTS])
def test_zero_stage_matches_unsharded(pool, dp, tp, stage):
    pool.run(trains_like_unsharded, 4, dp, tp, stage, False)


@pytest.mark.parametrize("stage", [0, 3])
def test_zero_stage_with_sequence_parallelism(pool, stage):
    pool.run(trains_like_unsharded, 4, 2, 2, stage, True)
