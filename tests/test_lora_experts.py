"""LoRA on experts (peft's target_parameters, `tplayers.hf.lora_experts`): adapters on the experts'
gate_up_proj / down_proj of an expert- and tensor-parallel MoE, against the unsharded peft model:
the loss of each step and every parameter after AdamW steps (DDP over the experts' own replicas),
peft's names and shapes in gather_state_dict and checkpoints, in both orders."""

import copy

import peft
import pytest
import torch

import tplayers
from tests.test_families import VARIANTS, VOCAB, tiny_model
from tplayers.hf.state_dict import gather_grads
from tplayers.testing import assert_close
from tplayers.testing.meshes import expert_mesh

pytestmark = pytest.mark.multirank

MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MICRO = 2
GPT_OSS = dict(VARIANTS["gpt_oss"][1], num_local_experts=6, intermediate_size=16)


def config(**kwargs):
    return peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"], target_parameters=EXPERTS, **kwargs)


def reference_model():
    """A Qwen3-MoE (6 experts, top 2) with adapters on q / o and on the experts, B nonzero."""
    model = tiny_model("qwen3_moe", **MOE)
    torch.manual_seed(1)
    out = peft.get_peft_model(model, config())
    with torch.no_grad():
        for i, (name, p) in enumerate(out.named_parameters()):
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(i))
    return out


def batch(step, dp):
    return torch.randint(3, VOCAB, (dp * MICRO, 8), generator=torch.Generator().manual_seed(step))


def _groups(dp, ep, tp):
    g = expert_mesh(dp, max(ep, 1), 1, tp)
    return g, (g["ep"] if ep else None)


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def order_one_matches(rank, world, _, dp, ep, tp, sp):
    """Adapters made on the unsharded model, then parallelize (EP x TP, SP) and DDP: each rank its
    micro-batch; the reference runs every micro-batch, its gradient the mean."""
    g, expert_group = _groups(dp, ep, tp)
    reference = reference_model()
    model = tplayers.parallelize(copy.deepcopy(reference), group=g["tp"], expert_group=expert_group,
                                 sequence_parallel=sp)  # fmt: skip
    tplayers.data_parallel(model, group=g["dp"], zero_stage=0)
    opt = torch.optim.AdamW(_trainable(model), lr=1e-2)
    ref_opt = torch.optim.AdamW(_trainable(reference), lr=1e-2)
    me = torch.distributed.get_rank(g["dp"])
    for step in range(2):
        ids = batch(step, dp)
        loss = model(ids.chunk(dp)[me], labels=ids.chunk(dp)[me]).loss
        loss.backward()
        ref_losses = []
        for part in ids.chunk(dp):
            ref_loss = reference(part, labels=part).loss
            (ref_loss / dp).backward()
            ref_losses.append(ref_loss.detach())
        assert_close(loss.detach(), ref_losses[me], msg=lambda m, s=step: f"loss, step {s}: {m}")
        if step == 0:
            grads, want = gather_grads(model), {n: p.grad for n, p in reference.named_parameters()}
            adapted = [k for k in grads if "experts" in k and "lora_" in k]
            assert len(adapted) == 2 * 2 * 2  # two layers, two parameters, A and B
            for key in adapted:
                assert_close(grads[key], want[key], msg=lambda m, k=key: f"grad {k}: {m}")
            # clipping counts each factor once: the TP-replicated ones once, the experts' summed over EP
            norm = tplayers.clip_grad_norm_(_trainable(model), max_norm=1e9)
            assert_close(norm, torch.nn.utils.clip_grad_norm_(_trainable(reference), max_norm=1e9))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = tplayers.gather_state_dict(model)
    want = reference.state_dict()
    assert list(full) == list(want)
    for key, value in want.items():
        assert_close(full[key], value, msg=lambda m, k=key: f"{k} after 2 steps: {m}")
    return True


@pytest.mark.parametrize(
    "dp, ep, tp, sp",
    [(2, 2, 1, False), (4, 2, 1, False), (2, 2, 2, True), (1, 0, 3, False)],
    # dp4-ep2: the adapters averaged over the experts' 2 replicas; tp3: features 16 as 8, 4, 4
    ids=["ep2", "dp4-ep2", "ep2-tp2-sp", "tp3"],
)
def test_adapters_on_experts_match_the_unsharded_peft_model(tplayers_pool, dp, ep, tp, sp):
    assert all(tplayers_pool.run(order_one_matches, dp * tp, dp, ep, tp, sp, mesh=("ep", dp, max(ep, 1), 1, tp)))


def order_two(rank, world, _):
    """parallelize, then tplayers.get_peft_model: peft makes each rank's factors; exported under the
    unsharded peft model's names and shapes, they give it the same logits."""
    g, expert_group = _groups(2, 2, 2)
    torch.manual_seed(0)
    model = tplayers.parallelize(tiny_model("qwen3_moe", **MOE), group=g["tp"], expert_group=expert_group)
    torch.manual_seed(1)
    model = tplayers.get_peft_model(model, config(init_lora_weights=False))
    ids = batch(0, 1)
    full = tplayers.gather_state_dict(model)
    reference = reference_model()
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in reference.state_dict().items()}
    reference.load_state_dict(full)
    with torch.no_grad():
        want = reference(ids).logits
        got = model(ids).logits
    assert_close(got, want)
    return True


def test_adapters_added_after_parallelize(tplayers_pool):
    assert all(tplayers_pool.run(order_two, 4, mesh=("ep", 2, 2, 1, 2)))


def saved(rank, world, group, path):
    g, expert_group = _groups(2, 2, 2)
    model = tplayers.parallelize(reference_model(), group=g["tp"], expert_group=expert_group, sequence_parallel=True)
    with torch.no_grad():
        for p in _trainable(model):
            p.add_(0.5)  # not the reference's any more: the checkpoint must carry them
    tplayers.save_checkpoint(path, model=model, group=group)
    return {k: v.detach().clone() for k, v in tplayers.gather_state_dict(model).items()}


def loaded(rank, world, group, path):
    model = reference_model()
    tplayers.load_checkpoint(path, model=model, group=group)
    return model.state_dict()


def test_a_checkpoint_of_expert_adapters_loads_unsharded(tplayers_pool, tmp_path):
    """Saved at EP 2 x TP 2 (B's rows split over TP and its columns over EP), loaded into the
    unsharded peft model, bitwise."""
    path = str(tmp_path / "lora-experts")
    want = tplayers_pool.run(saved, 4, path, mesh=("ep", 2, 2, 1, 2))[0]
    got = tplayers_pool.run(loaded, 1, path)[0]
    assert list(got) == list(want)
    for key, value in want.items():
        assert_close(got[key], value, exact=True, msg=lambda m, k=key: f"{k}: {m}")


def refusals(rank, world, _):
    g, expert_group = _groups(2, 2, 1)
    model = tplayers.parallelize(reference_model(), group=g["tp"], expert_group=expert_group)
    with pytest.raises(ValueError, match="ZeRO-3 with LoRA on experts' parameters"):
        tplayers.data_parallel(model, group=g["dp"], zero_stage=3)
    gpt_oss = peft.get_peft_model(tiny_model("gpt_oss", **GPT_OSS), config())
    with pytest.raises(ValueError, match="ClampedGluExperts.down_proj: LoRA on a parameter"):
        tplayers.parallelize(gpt_oss, group=g["tp"], expert_group=expert_group)
    return True


def test_what_expert_adapters_cannot_do_is_refused(tplayers_pool):
    assert all(tplayers_pool.run(refusals, 2, mesh=("ep", 2, 2, 1, 1)))
