"""Placement records nothing can lose: after each operation users (and HF Trainer, accelerate,
peft) apply to a model, on each layout, clipping, `gather_state_dict` and a checkpoint round
trip still equal the unsharded model's. And a parameter of a parallelized model that has no
record is an error in every call that reads records, never taken as replicated."""

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import tplayers
from tplayers.placement import PlacementError
from tplayers.testing.meshes import layout_mesh
from tplayers.tolerances import tolerance

pytestmark = pytest.mark.multirank

VOCAB = 64
LAYOUTS = {
    "tp4": dict(tp=4),
    "grid2x2": dict(tp=(2, 2)),
    "tp2-dp2-zero3": dict(tp=2, dp=2, zero=3),
    "tp2-dp2-zero0": dict(tp=2, dp=2, zero=0),
    "pp2-tp2": dict(pp=2, tp=2),
}


def _assign(model):
    model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)


def _to_empty(model, full):
    """As a model built on the meta device is materialised: empty tensors, then the weights loaded
    and the non-persistent buffers (rotary frequencies) computed again."""
    model.to_empty(device="cpu")
    tplayers.load_full_state_dict(model, full)
    fresh = dict(tiny_llama().named_buffers())
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(fresh[name])


OPERATIONS = {
    "to": lambda model, full: model.to("cpu"),  # HF Trainer's constructor
    "dtype-round-trip": lambda model, full: model.double().float(),
    "assign-load": lambda model, full: _assign(model),
    "to_empty": _to_empty,
    "requires_grad_": lambda model, full: model.requires_grad_(False).requires_grad_(True),
    "deepcopy": lambda model, full: copy.deepcopy(model),
}


def tiny_llama(layers=2):
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             tie_word_embeddings=False)  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def next_token_loss(logits, ids):
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


IDS = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))


def _sizes(tp, dp=1, pp=1, zero=0):
    return (dp, pp, *tp) if isinstance(tp, tuple) else (dp, pp, tp)


def _layout_model(tp, dp=1, pp=1, zero=0, layers=2):
    mesh = layout_mesh(*_sizes(tp, dp, pp))
    model = tiny_llama(layers)
    group = mesh["tp_r", "tp_c"] if isinstance(tp, tuple) else mesh["tp"]
    tplayers.parallelize(model, group=group, verify=False)
    if dp > 1:
        tplayers.data_parallel(model, group=mesh["dp"], zero_stage=zero)
    return mesh, model


def _backward(model, mesh, pp):
    """(what a checkpoint saves, the parameters a step reads) after one backward on IDS."""
    if pp > 1:
        stages = tplayers.pipeline_split(model, group=mesh["pp"])
        tplayers.ScheduleGPipe(stages[0], 2, next_token_loss).step(IDS, target=IDS)
        return stages, [p for s in stages for p in s.parameters()]
    next_token_loss(model(IDS).logits, IDS).backward()
    return model, list(model.parameters())


def survives(rank, world, group, layout, operation, path):
    reference = tiny_llama()
    full = {k: v.clone() for k, v in reference.state_dict().items()}
    next_token_loss(reference(IDS).logits, IDS).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    mesh, model = _layout_model(**{k: v for k, v in layout.items()})
    changed = OPERATIONS[operation](model, full)
    model = changed if isinstance(changed, nn.Module) else model
    held, params = _backward(model, mesh, layout.get("pp", 1))
    norm = tplayers.clip_grad_norm_(params, float("inf"))
    gathered = tplayers.gather_state_dict(model)
    tplayers.save_checkpoint(f"{path}/ckpt", model=held)
    with torch.no_grad():
        for p in params:
            p.zero_()
    tplayers.load_checkpoint(f"{path}/ckpt", model=held)
    reloaded = tplayers.gather_state_dict(model)
    return expected, norm, full, gathered, reloaded


@pytest.mark.parametrize("operation", list(OPERATIONS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_records_survive(pool, tmp_path, layout, operation):
    if operation == "deepcopy" and "pp" in LAYOUTS[layout]:
        pytest.skip("pipeline stages hold the original model's modules: a deep copy of the model has no stages")
    if operation == "deepcopy" and "dp" in LAYOUTS[layout]:
        pytest.skip("torch's FSDP2 and DDP refuse deepcopy themselves ('use state dict for serialization')")
    tol = tolerance(torch.float32)
    for expected, norm, full, gathered, reloaded in pool.run(
        survives,
        math.prod(_sizes(**LAYOUTS[layout])),
        LAYOUTS[layout],
        operation,
        str(tmp_path),
        mesh=_sizes(**LAYOUTS[layout]),
    ):
        torch.testing.assert_close(norm, expected, **tol)
        for name, state in (("gather_state_dict", gathered), ("checkpoint round trip", reloaded)):
            assert state.keys() == full.keys(), (name, sorted(set(state) ^ set(full)))
            for key in full:
                assert torch.equal(state[key], full[key]), (name, key, tuple(state[key].shape))


def unplaced_parameter_raises(rank, world, group):
    """A parameter put into a parallelized model without a record: every call that reads records raises."""
    mesh, model = _layout_model(tp=4)
    model.model.layers[0].mlp.extra = nn.Linear(4, 4)  # added after parallelize, placed by no one
    next_token_loss(model(IDS).logits, IDS).backward()
    said = {}
    for name, call in {
        "clip_grad_norm_": lambda: tplayers.clip_grad_norm_(model.parameters(), 1.0),
        "gather_state_dict": lambda: tplayers.gather_state_dict(model),
        "scaler": lambda: tplayers.DynamicLossScaler().unscale_(torch.optim.SGD(model.parameters(), lr=0.1)),
    }.items():
        try:
            call()
        except PlacementError as e:
            said[name] = str(e)
    return said


def test_a_parameter_without_a_record_is_an_error(pool):
    for said in pool.run(unplaced_parameter_raises, 4, mesh=(1, 1, 4)):
        assert said.keys() == {"clip_grad_norm_", "gather_state_dict", "scaler"}, said
        assert all(
            "model.layers.0.mlp.extra." in message and "no placement record" in message for message in said.values()
        )


def compiled(rank, world, group, path):
    """torch.compile (the eager backend: dynamo's graph capture, no code generation) over a block
    of tplayers layers at TP 4 (an HF model's capture takes minutes on 2 cores): forward and backward
    through the compiled module, then clip, gather and a checkpoint round trip of the block it
    wraps, against the unsharded block."""
    mesh = layout_mesh(1, 1, world)
    torch.manual_seed(0)
    first, second = nn.Linear(8, 12), nn.Linear(12, 8)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    reference = nn.Sequential(first, nn.GELU(), second)
    reference(x).square().mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    block = nn.Sequential(
        tplayers.ColumnParallelLinear.from_linear(first, group=mesh["tp"]),
        nn.GELU(),
        tplayers.RowParallelLinear.from_linear(second, group=mesh["tp"]),
    )
    for p in reference.parameters():
        p.grad = None
    torch.compile(block, backend="eager")(x).square().mean().backward()
    norm = tplayers.clip_grad_norm_(list(block.parameters()), float("inf"))
    tplayers.save_checkpoint(f"{path}/ckpt", model=block)
    with torch.no_grad():
        for p in block.parameters():
            p.zero_()
    tplayers.load_checkpoint(f"{path}/ckpt", model=block)
    return (
        expected,
        norm,
        [p.detach().clone() for p in block.parameters()],
        [p.detach() for p in reference.parameters()],
    )


def test_records_survive_torch_compile(pool, tmp_path):
    for rank, (expected, norm, mine, full) in enumerate(pool.run(compiled, 4, str(tmp_path), mesh=(1, 1, 4))):
        torch.testing.assert_close(norm, expected, **tolerance(torch.float32))
        column_weight, column_bias, row_weight, row_bias = mine
        assert torch.equal(column_weight, full[0].chunk(4, 0)[rank]) and torch.equal(
            column_bias, full[1].chunk(4)[rank]
        )
        assert torch.equal(row_weight, full[2].chunk(4, 1)[rank]) and torch.equal(row_bias, full[3])
