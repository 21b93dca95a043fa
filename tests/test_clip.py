"""`tplayers.clip_grad_norm_` on tensor-parallel HuggingFace models against
`torch.nn.utils.clip_grad_norm_` on the same model unsharded: the returned norm, the clipped
gradients, tied and replicated parameters counted once, all-zero and non-finite gradients, the
extra (pipeline) group, and a negative control that counts replicated gradients once per rank."""

import copy
import math
import re

import pytest
import torch
import torch.distributed as dist

import tplayers
from tplayers.functional import comm
from tplayers.hf import gather_grads
from tplayers.testing import assert_close
from tplayers.testing.numerics import tolerance
from tplayers.train.clip import clip_grad_norm_

pytestmark = pytest.mark.multirank

VOCAB = 96
NORM_TYPES = [1.0, 2.0, 3.0, math.inf]
REPLICATED_GRAD_SCALE = 30.0


def tiny_model(family):
    import transformers as tf

    torch.manual_seed(0)
    if family == "llama":  # GQA: 4 query heads, 2 key/value heads (replicated at TP=4); RMSNorm weights
        cfg = tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            max_position_embeddings=64,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        return tf.LlamaForCausalLM(cfg)
    if family == "gpt2":  # Conv1D, fused c_attn, tied embeddings, LayerNorms, replicated row biases
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
        return tf.GPT2LMHeadModel(cfg)
    raise ValueError(family)


def _setup(group, family):
    """A parallelized model and its unsharded reference, both after one backward pass."""
    model = tiny_model(family).eval()
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=group)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    reference(ids, labels=ids).loss.backward()
    # Norm / bias gradients are tiny next to the matrices' at init: scale the replicated ones (on
    # both models alike) so that counting them once per rank shows clearly in every norm.
    for name, p in model.named_parameters():
        if not tplayers.get_placement(p).is_sharded:
            p.grad.mul_(REPLICATED_GRAD_SCALE)
            reference.get_parameter(name).grad.mul_(REPLICATED_GRAD_SCALE)
    return model, reference


def _params(model, family):
    params = list(model.parameters())
    if family == "gpt2":  # the tied head passed again explicitly: still counted once
        assert model.lm_head.weight is model.transformer.wte.weight
        params.append(model.lm_head.weight)
    return params


def _snapshot(module):
    return [(p, p.grad.clone()) for p in module.parameters() if p.grad is not None]


def _restore(snapshot):
    for p, g in snapshot:
        p.grad = g.clone()


def _wrong_norm(params, norm_type, group):
    """The classic bug: every local gradient's contribution summed over the TP group, so a
    replicated gradient counts once per rank."""
    norms = torch.stack([torch.linalg.vector_norm(p.grad, norm_type) for p in {id(p): p for p in params}.values()])
    if math.isinf(norm_type):
        total = norms.amax()
        gathered = torch.empty(dist.get_world_size(group), dtype=total.dtype)
        comm.all_gather_into(gathered, total.reshape(1), group)
        return gathered.amax()
    total = norms.pow(norm_type).sum()
    comm.all_reduce(total, group)
    return total.pow(1 / norm_type)


def check_clip(rank, tp, group, family):
    model, reference = _setup(group, family)
    saved, saved_ref = _snapshot(model), _snapshot(reference)
    replicated = [p for p in model.parameters() if not tplayers.get_placement(p).is_sharded]
    assert replicated, "the model must have replicated parameters for this test to mean anything"

    for norm_type in NORM_TYPES:
        _restore(saved), _restore(saved_ref)
        ref_params = [p for p in reference.parameters()]
        unclipped = torch.nn.utils.get_total_norm([p.grad for p in ref_params], norm_type)
        max_norm = 0.5 * unclipped.item()
        assert 0 < max_norm < unclipped.item() and math.isfinite(max_norm)  # clipping is not vacuous

        # negative control: counting replicated gradients once per rank gives another norm
        wrong = _wrong_norm(model.parameters(), norm_type, group)
        if not math.isinf(norm_type):  # the inf-norm is a max: double counting cannot show there
            with pytest.raises(AssertionError):
                assert_close(wrong, unclipped)

        with comm.count_bytes() as counted:
            total = clip_grad_norm_(_params(model, family), max_norm, norm_type)
        expected = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, norm_type)
        assert_close(total, expected, msg=lambda m, n=norm_type: f"norm {n}: {m}")
        assert total.item() > max_norm
        # one collective over the TP group, a buffer of 3 fp32 (partial norm, nan flag, inf flag)
        assert set(counted) == ({"all_gather"} if math.isinf(norm_type) else {"all_reduce"})

        grads = gather_grads(model, group=group)
        for name, p in reference.named_parameters():
            assert_close(grads[name], p.grad, msg=lambda m, k=name, n=norm_type: f"clipped grad of {k}, norm {n}: {m}")

    # a parameter without grad is skipped (here on the model and the reference alike)
    _restore(saved), _restore(saved_ref)
    name, _ = next((n, p) for n, p in reference.named_parameters() if "norm" in n or "ln_" in n)
    model.get_parameter(name).grad = None
    reference.get_parameter(name).grad = None
    total = clip_grad_norm_(model.parameters(), 1e-3)
    assert_close(total, torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3))

    # all-zero gradients: norm 0, no nan, gradients stay zero
    for norm_type in NORM_TYPES:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        total = clip_grad_norm_(model.parameters(), 1.0, norm_type)
        assert total.item() == 0.0
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def check_nonfinite(rank, tp, group, family):
    """nan / inf on one rank only, in a sharded or (as if by a bug) a replicated gradient: every
    rank reaches the same verdict."""
    model, _ = _setup(group, family)
    saved = _snapshot(model)
    sharded = next(p for p in model.parameters() if tplayers.get_placement(p).is_sharded)
    replicated = next(p for p in model.parameters() if not tplayers.get_placement(p).is_sharded)
    for target, bad, verdict in [(sharded, math.nan, math.isnan), (replicated, math.inf, math.isinf)]:
        for norm_type in NORM_TYPES:
            _restore(saved)
            if rank == tp - 1:
                target.grad.view(-1)[0] = bad
            total = clip_grad_norm_(model.parameters(), 1.0, norm_type)
            assert verdict(total.item()), (norm_type, total)
            _restore(saved)
            if rank == tp - 1:
                target.grad.view(-1)[0] = bad
            with pytest.raises(RuntimeError, match="non-finite"):
                clip_grad_norm_(model.parameters(), 1.0, norm_type, error_if_nonfinite=True)


def check_pipeline_group(rank, tp, group, family):
    """Two 'pipeline stages' of TP 2 on four ranks: stage s clips only its half of the
    parameters; the extra `group` (the ranks with the same TP index) combines the stages."""
    assert tp == 4
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    stage, tp_rank = divmod(rank, 2)
    model, reference = _setup(tp_groups[stage], family)
    names = [n for n, _ in reference.named_parameters()]
    half = len(names) // 2
    mine = set(names[:half] if stage == 0 else names[half:])
    saved, saved_ref = _snapshot(model), _snapshot(reference)
    for norm_type in NORM_TYPES:
        _restore(saved), _restore(saved_ref)
        ref_params = [p for p in reference.parameters()]
        max_norm = 0.5 * torch.nn.utils.get_total_norm([p.grad for p in ref_params], norm_type).item()
        total = clip_grad_norm_([model.get_parameter(n) for n in mine], max_norm, norm_type, group=pp_groups[tp_rank])
        expected = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, norm_type)
        assert_close(total, expected, msg=lambda m, n=norm_type: f"norm {n}: {m}")
        grads = gather_grads(model, group=tp_groups[stage])
        for name in mine:
            assert_close(grads[name], reference.get_parameter(name).grad, msg=lambda m, k=name: f"{k}: {m}")


def check_low_precision(rank, tp, group, family, dtype):
    """fp16 / bf16 gradients: the norm is accumulated and returned in fp32 and equals torch's
    on the unsharded gradients (upcast, so torch's own fp16 overflow does not hide the truth)."""
    model, reference = _setup(group, family)
    model.to(dtype)  # parameters and their gradients
    reference.to(dtype)
    for norm_type in NORM_TYPES:
        saved, saved_ref = _snapshot(model), _snapshot(reference)
        ref_grads = [p.grad.float() for p in reference.parameters()]
        unclipped = torch.nn.utils.get_total_norm(ref_grads, norm_type)
        max_norm = 0.5 * unclipped.item()
        total = clip_grad_norm_(_params(model, family), max_norm, norm_type)
        assert total.dtype == torch.float32 and total.item() > max_norm
        torch.testing.assert_close(total, unclipped, **tolerance(dtype))
        coef = min(max_norm / (unclipped.item() + 1e-6), 1.0)  # torch's clipping factor, on the fp32 grads
        grads = gather_grads(model, group=group)
        for (name, _), g in zip(reference.named_parameters(), ref_grads, strict=True):
            assert grads[name].dtype == dtype
            expected = (g * coef).to(dtype).float()
            torch.testing.assert_close(
                grads[name].float(), expected, **tolerance(dtype), msg=lambda m, k=name: f"{k}: {m}"
            )
        _restore(saved), _restore(saved_ref)
    # a norm beyond fp16's range (65504) is finite in fp32 and clips, rather than zeroing grads
    for p in model.parameters():
        p.grad = torch.full_like(p, 1000.0)
    total = clip_grad_norm_(model.parameters(), 1.0)
    assert math.isfinite(total.item()) and total.item() > 65504
    assert all(bool((p.grad > 0).all()) for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_clip_low_precision_grads(pool, dtype):
    pool.run(check_low_precision, 2, "llama", dtype)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("tp", [2, 4])
def test_clip_matches_unsharded(pool, family, tp):
    pool.run(check_clip, tp, family)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_nonfinite_same_verdict_on_every_rank(pool, family):
    pool.run(check_nonfinite, 4, family)


def test_pipeline_stages_combined_over_extra_group(pool):
    pool.run(check_pipeline_group, 4, "gpt2")


def test_bad_norm_type_raises():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="norm_type"):
            clip_grad_norm_([p], 1.0, bad)


def users_loop_with_torchs_clipping(rank, world, group, mesh_sizes, pipeline):
    """A user's own loop on a parallelized model: torch.nn.utils.clip_grad_norm_ (tplayers wraps it
    at import) clips by the unsharded gradient's norm; 2 AdamW steps equal the unsharded model's."""
    from tplayers.testing.meshes import layout_mesh

    dp, pp, tp = mesh_sizes
    mesh = layout_mesh(dp, pp, tp)
    model = tiny_model("llama").train()
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=mesh["tp"], verify=False)
    if pipeline:
        stages = tplayers.pipeline_split(model, group=mesh["pp"])
        schedule = tplayers.ScheduleGPipe(stages[0], 2, tplayers.next_token_loss(model))
    else:
        tplayers.data_parallel(model, group=mesh["dp"], zero_stage=3 if dp > 1 else 0)
    params = [p for p in model.parameters()]
    opt, ref_opt = torch.optim.AdamW(params, lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    norms = []
    for step in range(2):
        ids = torch.randint(0, VOCAB, (2 * dp, 7), generator=torch.Generator().manual_seed(step))
        if pipeline:
            schedule.step(ids if stages[0].is_first else None, target=ids)
        else:
            mine = ids.chunk(dp)[mesh["dp"].get_local_rank()]
            model(mine, labels=mine).loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
        opt.step()
        opt.zero_grad()
        reference(ids, labels=ids).loss.backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05).item()
        ref_opt.step()
        ref_opt.zero_grad()
        assert norms[-1] == pytest.approx(expected, rel=1e-4), (step, norms[-1], expected)
    full = tplayers.gather_state_dict(model, group=mesh["tp"])
    for key, value in reference.state_dict().items():
        if not pipeline or _on_stage(key, stages[0]):
            assert_close(full[key], value, msg=lambda m, k=key: f"{k} after 2 steps: {m}")
    return norms


def _on_stage(key, stage):
    index = re.match(r"model\.layers\.(\d+)\.", key)
    if index:
        return int(index[1]) in stage.module.layer_indices
    return stage.is_first if "embed_tokens" in key else stage.is_last


@pytest.mark.parametrize("mesh_sizes, pipeline", [((1, 1, 3), False), ((2, 1, 2), False), ((1, 2, 2), True)],
                         ids=["tp3", "dp2-zero3-tp2", "pp2-tp2"])  # fmt: skip
def test_torchs_own_clip_grad_norm_clips_by_the_unsharded_norm(pool, mesh_sizes, pipeline):
    norms = pool.run(users_loop_with_torchs_clipping, math.prod(mesh_sizes), mesh_sizes, pipeline, mesh=mesh_sizes)
    assert all(n == norms[0] for n in norms)


def local_norms_of_torchs_own(rank, world, group):
    model, _ = _setup(group, "llama")
    return torch.nn.utils.clip_grad_norm_.__wrapped__(list(model.parameters()), 1.0).item()


def test_negative_control_torchs_unwrapped_clip_takes_each_ranks_local_norm(pool):
    first, second = pool.run(local_norms_of_torchs_own, 2)
    assert first != second
