"""Models driven the way users drive them, beyond logits: one training step's loss (with the
auxiliary losses the config enables, with an attention mask) and every gradient equal the
unsharded model's. Each case here was silently wrong before (issue 33): MoE load-balancing
losses under sequence parallelism, learnable scalars between the column and row layers of an
MLP (Apertus' xIELU), per-head attention sinks."""

import copy
import warnings

import pytest
import torch

import tplayers
from tplayers.hf import gather_grads
from tplayers.testing.meshes import layout_mesh
from tplayers.tolerances import tolerance

pytestmark = pytest.mark.multirank

VOCAB = 96
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe"]


def tiny(family, **overrides):
    import transformers as tf

    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, head_dim=8, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, output_router_logits=True, router_aux_loss_coef=0.5)  # fmt: skip
    kw.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.AutoConfig.for_model(family, **kw)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "router_jitter_noise"):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    return tf.AutoModelForCausalLM.from_config(cfg)


def _batch(masked):
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if masked:
        mask[0, :3] = 0  # a left-padded row
    return ids, mask


def one_step(rank, world, group, family, sequence_parallel, masked, overrides):
    """(loss, unsharded loss, {name: (gradient, unsharded gradient)}) after one forward + backward."""
    mesh = layout_mesh(1, 1, world)
    model = tiny(family, **overrides)
    reference = copy.deepcopy(model)
    ids, mask = _batch(masked)
    expected = reference(ids, attention_mask=mask, labels=ids).loss
    expected.backward()
    tplayers.parallelize(model, group=mesh["tp"], sequence_parallel=sequence_parallel)
    loss = model(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    grads = gather_grads(model)
    return loss.detach(), expected.detach(), {n: (grads.get(n), p.grad) for n, p in reference.named_parameters()}


def _check(results):
    tol = tolerance(torch.float32)
    for loss, expected, grads in results:
        torch.testing.assert_close(loss, expected, **tol)
        for name, (grad, reference) in grads.items():
            if reference is None:
                assert grad is None or not grad.any(), name
                continue
            torch.testing.assert_close(grad, reference, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("family", MOE)
def test_moe_auxiliary_loss_under_sequence_parallelism(pool, family, masked):
    _check(pool.run(one_step, 2, family, True, masked, {}, mesh=(1, 1, 2)))


def test_moe_auxiliary_loss_without_sequence_parallelism_at_tp3(pool):
    _check(pool.run(one_step, 3, "mixtral", False, True, {}, mesh=(1, 1, 3)))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_learnable_activation_scalars_between_column_and_row(pool, sequence_parallel):
    """Apertus' xIELU keeps alpha_p / alpha_n between up_proj (column) and down_proj (row)."""
    _check(pool.run(one_step, 2, "apertus", sequence_parallel, False, {}, mesh=(1, 1, 2)))


@pytest.mark.parametrize("family", ["flint", "granitemoe_swa", "mimo_v2_flash"])
def test_attention_sinks_cut_to_each_ranks_heads(pool, family):
    """One sink per query head, held by the attention module itself: each rank holds its heads'."""
    _check(pool.run(one_step, 2, family, False, True, {"output_router_logits": False}, mesh=(1, 1, 2)))


# -- the self-check trains: it catches these classes on models it does not know --------------------
def planted(rank, world, group, bug):
    """parallelize with one of the fixes above undone: (the VerifyError message or None, whether
    verify='logits' alone saw anything)."""
    import importlib

    family, sequence_parallel, where, name, noop = {
        "missing gradient sum": ("apertus", False, "parallelize", "_inside_sharded_modules", lambda *a: None),
        "per-rank auxiliary loss": (
            "mixtral",
            True,
            "sequence_split",
            "_whole_sequence_outputs",
            lambda *a: lambda *b: None,
        ),
    }[bug]
    module = importlib.import_module(f"tplayers.hf.{where}")
    saved = getattr(module, name)
    setattr(module, name, noop)
    said = {}
    try:
        mesh = layout_mesh(1, 1, world)
        for mode in ("train", "logits"):
            try:
                tplayers.parallelize(tiny(family), group=mesh["tp"], sequence_parallel=sequence_parallel, verify=mode)
            except tplayers.hf.verify.VerifyError as e:
                said[mode] = str(e)
    finally:
        setattr(module, name, saved)
    return said


@pytest.mark.parametrize(
    "bug, named",
    # the per-rank load-balancing loss cannot even take the probe's attention mask (shaped for the whole batch)
    [("missing gradient sum", "mlp.act_fn.alpha_"), ("per-rank auxiliary loss", "must match the size of tensor b")],
)
def test_the_self_check_catches_a_planted_bug(pool, bug, named):
    for said in pool.run(planted, 2, bug, mesh=(1, 1, 2)):
        assert "train" in said and named in said["train"], said
        assert "logits" not in said  # the logits alone cannot see either
        assert "fp32 rounding" not in said["train"]  # a wrong gradient is never put down to rounding


def gradient_verdicts(rank, world, group):
    """The self-check's gradient comparison on a gradient up to 300: off by 1e-4 (below 1e-5 of its
    largest: rounding a model amplifies, said so, still refused) and off by half (said nothing of)."""
    from tplayers.hf.verify import Probe, VerifyError, _check_grads

    probe = Probe(torch.zeros(1), "train", grads={"w": torch.tensor([300.0, 1.0])})  # no model: no fp64 arbiter
    said = []
    for sharded in (torch.tensor([300.0, 1.0001]), torch.tensor([150.0, 1.0])):
        with pytest.raises(VerifyError) as caught:
            _check_grads(probe, {"w": sharded}, group)
        said.append(str(caught.value))
    return said


def test_a_gradient_off_by_rounding_of_its_largest_is_refused_and_said_so(pool):
    for rounding, wrong in pool.run(gradient_verdicts, 2, mesh=(1, 1, 2)):
        assert "w (largest |difference| 0.0001 in gradients up to 300" in rounding and "fp32 rounding" in rounding
        assert "w (largest |difference| 150" in wrong and "fp32 rounding" not in wrong


def arbiter_verdict(rank, world, group, planted):
    """The fp64 arbiter on a small model's probe: its own gradients pass; one weight's gradient off by
    `planted` x its largest at one element is refused, the arbiter naming it."""
    from tplayers.hf.verify import VerifyError, _check_grads, before

    model = tiny("llama")
    probe = before(model, True, world)
    assert probe.unsharded is not None
    grads = {k: v.clone() for k, v in probe.grads.items()}
    name = "model.layers.1.mlp.down_proj.weight"
    grads[name][0, 0] += planted * grads[name].abs().max()
    try:
        _check_grads(probe, grads, group)
    except VerifyError as e:
        return str(e)
    return None


def test_the_fp64_arbiter_refuses_a_gradient_off_by_more_than_rounding(pool):
    """Where a gradient is past the table, the unsharded model's fp64 gradient decides: 1 % off at one
    element is no rounding of a model whose own fp32 gradient is 1e-7 from fp64 (negative control: no
    difference, no error)."""
    for said in pool.run(arbiter_verdict, 2, 1e-2, mesh=(1, 1, 2)):
        assert said and "model.layers.1.mlp.down_proj.weight is " in said and "wrong, not rounding" in said, said
    assert pool.run(arbiter_verdict, 2, 0.0, mesh=(1, 1, 2)) == [None, None]


def verify_leaves_the_model_as_given(rank, world, group):
    """verify runs a backward in train mode with dropout off: afterwards no gradients, the modes and
    dropout rates as they were, the random stream untouched."""
    mesh = layout_mesh(1, 1, world)
    model = tiny("llama", attention_dropout=0.25)
    model.config.attention_dropout = 0.25  # tiny() zeroes it; a model trained with dropout keeps its rate
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.25
    model.eval()
    torch.manual_seed(5)
    tplayers.parallelize(model, group=mesh["tp"])
    return (
        all(p.grad is None for p in model.parameters()),
        not any(m.training for m in model.modules()),
        [layer.self_attn.attention_dropout for layer in model.model.layers] + [model.config.attention_dropout],
        torch.rand(1).item(),
    )


def test_verify_leaves_the_model_as_given(pool):
    torch.manual_seed(5)
    draw = torch.rand(1).item()
    for no_grads, eval_mode, rates, drawn in pool.run(verify_leaves_the_model_as_given, 2, mesh=(1, 1, 2)):
        assert no_grads and eval_mode and rates == [0.25, 0.25, 0.25] and drawn == draw
