"""Hooks put on a module `parallelize` replaces (`tplayers.hf.attached`). Before, they were dropped
with the module and stopped running without an error. Now they move to the replacement where its
output is the unsharded module's (an embedding, an MLP, a row projection; a hooked down_proj is
then not fused into a ParallelMLP), the user's handles still remove them, and HF's own
`enable_input_require_grads` keeps working; on a column projection or the LM head they are refused
by name, and the model is given back with its hooks. A parametrized projection (weight norm) is
refused by name: the self-check found its gradients wrong, naming no cause; so is a plain linear
holding a parameter, buffer or module of the user's (dropped with it before, silently)."""

import warnings

import pytest
import torch

import tplayers

pytestmark = pytest.mark.multirank

IDS = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1))
MOVED = ["model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"]


def llama():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=3)  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def captured(model, names):
    """{name: the output its hook saw}, and the handles."""
    seen = {}

    def hook_for(name):
        def capture(module, args, out):
            seen[name] = out.detach().clone()

        return capture

    return seen, [model.get_submodule(n).register_forward_hook(hook_for(n)) for n in names]


def hooked_then_parallelized(rank, tp, group):
    warnings.simplefilter("ignore")
    model = llama()
    seen, handles = captured(model, MOVED)
    tplayers.parallelize(model, group=group)
    model(IDS)
    first = dict(seen)
    seen.clear()
    for handle in handles:
        handle.remove()
    model(IDS)
    kept_apart = hasattr(model.model.layers[1].mlp, "down_proj")
    return first, sorted(seen), kept_apart


def test_hooks_move_with_their_modules_and_their_handles_remove_them(pool):
    reference = llama()
    expected, _ = captured(reference, MOVED)
    reference(IDS)
    for seen, after_removal, kept_apart in pool.run(hooked_then_parallelized, 3):
        assert sorted(seen) == sorted(MOVED)
        for name in MOVED:
            torch.testing.assert_close(seen[name], expected[name], msg=lambda m, n=name: f"{n}: {m}")
        assert after_removal == [] and kept_apart


def input_grads_required(rank, tp, group):
    model = llama()
    model.requires_grad_(False)
    model.enable_input_require_grads()  # HF's forward hook on the input embeddings
    tplayers.parallelize(model, group=group, verify=False)
    return model.get_input_embeddings()(IDS).requires_grad


def test_hfs_enable_input_require_grads_survives(pool):
    assert pool.run(input_grads_required, 2) == [True, True]


def refused(rank, tp, group, name):
    model = llama()
    seen, _ = captured(model, [name])
    with pytest.raises(ValueError) as caught:
        tplayers.parallelize(model, group=group)
    model(IDS)  # given back as it was: its hook runs
    return str(caught.value), sorted(seen)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj", "lm_head"], ids=["column", "lm-head"])
def test_hooks_on_a_column_projection_or_the_head_are_refused_by_name(pool, name):
    for message, seen in pool.run(refused, 2, name):
        assert f"{name} (Linear) holds hooks (captured.<locals>.hook_for.<locals>.capture)" in message, message
        assert seen == [name]


def weight_normed(rank, tp, group, name):
    model = llama()
    torch.nn.utils.parametrizations.weight_norm(model.get_submodule(name))
    with pytest.raises(ValueError) as caught:
        tplayers.parallelize(model, group=group)
    return str(caught.value)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"])
def test_a_parametrized_projection_is_refused_by_name(pool, name):
    for message in pool.run(weight_normed, 2, name):
        assert f"{name} (ParametrizedLinear) is parametrized ({{'weight': ['_WeightNorm']}})" in message, message


EXTRAS = {
    "parameter": lambda lin: setattr(lin, "extra", torch.nn.Parameter(torch.ones(3))),
    "buffer": lambda lin: lin.register_buffer("extra", torch.ones(3)),
    "module": lambda lin: setattr(lin, "extra", torch.nn.Linear(3, 3)),
}


def with_extra(rank, tp, group, kind):
    model = llama()
    EXTRAS[kind](model.model.layers[0].self_attn.q_proj)
    with pytest.raises(ValueError) as caught:
        tplayers.parallelize(model, group=group)
    return str(caught.value), "model.layers.0.self_attn.q_proj.extra" in str(list(model.state_dict()))


@pytest.mark.parametrize("kind", list(EXTRAS))
def test_a_linear_holding_more_than_its_own_is_refused_by_name(pool, kind):
    for message, kept in pool.run(with_extra, 2, kind):
        assert "model.layers.0.self_attn.q_proj (Linear) holds ['extra'], which its class does not" in message
        assert kept  # given back as it was


def test_a_hook_inside_a_module_replaced_whole_is_refused_by_name(pool):
    """The MLP's activation is no module of the ParallelMLP that replaces the MLP."""
    for message, seen in pool.run(refused, 2, "model.layers.0.mlp.act_fn"):
        assert "model.layers.0.mlp.act_fn (SiLUActivation) holds hooks" in message, message
        assert "replaces model.layers.0.mlp with ParallelMLP, which holds no such module" in message, message
        assert seen == ["model.layers.0.mlp.act_fn"]
