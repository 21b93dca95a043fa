"""Groups come from the placement record: every public call that reads placed parameters,
called without `group=`, equals the call with the right group on TP 2 x DP 2 (ZeRO 0 and 3),
PP 2 x TP 2 and TP 4; an explicit group that contradicts the record raises on every rank before
any collective (a rank that went on to a collective would leave the others waiting) and writes
nothing."""

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import tplayers
from tplayers.hf import gather_grads
from tplayers.placement import local_tensor

pytestmark = pytest.mark.multirank

VOCAB = 96
LAYOUTS = {
    "tp2-dp2-zero0": dict(tp=2, dp=2, zero=0),
    "tp2-dp2-zero3": dict(tp=2, dp=2, zero=3),
    "pp2-tp2": dict(pp=2, tp=2),
    "tp4": dict(tp=4),
}


def tiny_llama():
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                             tie_word_embeddings=False)  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def next_token_loss(logits, ids):
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _build(tp=1, dp=1, pp=1, zero=0):
    """(mesh, model, what a checkpoint saves: the model or this rank's stages, their parameters)
    after one backward, every replica on the same batch."""
    mesh = tplayers.init_mesh(dp=dp, pp=pp, tp=tp)
    model = tiny_llama()
    tplayers.parallelize(model, group=mesh["tp"], verify=False)
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    if pp > 1:
        stages = tplayers.pipeline_split(model, group=mesh["pp"])
        tplayers.ScheduleGPipe(stages[0], 2, next_token_loss).step(ids, target=ids)
        return mesh, model, stages, [p for s in stages for p in s.parameters()]
    if dp > 1:
        tplayers.data_parallel(model, group=mesh["dp"], zero_stage=zero)
    next_token_loss(model(ids).logits, ids).backward()
    return mesh, model, model, list(model.parameters())


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def defaults_equal_the_right_group(rank, world, group, layout, path):
    mesh, model, held, params = _build(**layout)
    # gather / load the full state dict and gradients: over the record's tensor-parallel group
    full = tplayers.gather_state_dict(model)
    assert _equal(full, tplayers.gather_state_dict(model, group=mesh["tp"]))
    assert _equal(gather_grads(model), gather_grads(model, group=mesh["tp"]))
    tplayers.load_full_state_dict(model, full)
    tplayers.load_full_state_dict(model, full, group=mesh["tp"])
    assert _equal(full, tplayers.gather_state_dict(model))
    # clipping: the records' groups (tensor, data, pipeline); group= may name the pipeline again
    grads = [p.grad.clone() if p.grad is not None else None for p in params]
    norm = tplayers.clip_grad_norm_(params, float("inf"))
    for p, g in zip(params, grads, strict=True):
        if g is not None:
            p.grad.copy_(g)
    assert torch.equal(norm, tplayers.clip_grad_norm_(params, float("inf"), group=mesh["pp"]))
    # checkpoints and HF directories: over every rank that holds the model (here, the world)
    tplayers.save_checkpoint(f"{path}/default", model=held)
    tplayers.save_checkpoint(f"{path}/explicit", model=held, group=group)
    for saved in ("default", "explicit"):
        tplayers.load_checkpoint(f"{path}/{saved}", model=held)
        assert _equal(full, tplayers.gather_state_dict(model))
    tplayers.load_checkpoint(f"{path}/default", model=held, group=group)
    if layout.get("pp", 1) == 1:  # save_pretrained takes the whole model
        tplayers.save_pretrained(model, f"{path}/hf-default")
        tplayers.save_pretrained(model, f"{path}/hf-explicit", group=group)
        tplayers.load_pretrained(model, f"{path}/hf-default")
        tplayers.load_pretrained(model, f"{path}/hf-explicit", group=group)
        assert _equal(full, tplayers.gather_state_dict(model))
    # the loss scaler: an inf on the last rank alone makes every rank skip, by default and with the world
    skipped = []
    opt = torch.optim.SGD(params, lr=0.1)
    for scaler in (tplayers.DynamicLossScaler(), tplayers.DynamicLossScaler(group=group)):
        if rank == world - 1:
            local_tensor(next(p.grad for p in params if p.grad is not None)).view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        scaler.step(opt)
        skipped.append(scaler.last_step_skipped)
    return norm, skipped


def contradicting_groups_raise(rank, world, group, layout, path):
    """Each call with a group the record contradicts: its message (every rank must raise)."""
    mesh, model, held, params = _build(**layout)
    not_tp = group if layout["tp"] < world else mesh["dp"]  # other ranks than the tensor-parallel group's
    partial = mesh["tp"] if layout["tp"] < world else mesh["dp"]  # leaves out ranks holding the model
    calls = {
        "gather_state_dict": lambda: tplayers.gather_state_dict(model, group=not_tp),
        "gather_grads": lambda: gather_grads(model, group=not_tp),
        "load_full_state_dict": lambda: tplayers.load_full_state_dict(model, {}, group=not_tp),
        "clip_grad_norm_": lambda: tplayers.clip_grad_norm_(params, 1.0, group=mesh["tp"]),
        "save_checkpoint": lambda: tplayers.save_checkpoint(f"{path}/refused", model=held, group=partial),
        "load_checkpoint": lambda: tplayers.load_checkpoint(f"{path}/refused", model=held, group=partial),
    }
    if layout.get("pp", 1) == 1:
        calls["save_pretrained"] = lambda: tplayers.save_pretrained(model, f"{path}/refused-hf", group=partial)
        calls["load_pretrained"] = lambda: tplayers.load_pretrained(model, f"{path}/refused-hf", group=partial)
    said = {}
    for name, call in calls.items():
        try:
            call()
        except ValueError as e:
            said[name] = str(e)
    return said


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_calls_without_group_equal_the_right_group(pool, tmp_path, layout):
    results = pool.run(defaults_equal_the_right_group, 4, LAYOUTS[layout], str(tmp_path))
    assert all(torch.equal(norm, results[0][0]) for norm, _ in results)  # one global norm on every rank
    assert all(skipped == [True, True] for _, skipped in results)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_group_that_contradicts_the_record_raises_on_every_rank(pool, tmp_path, layout):
    expected = {"gather_state_dict", "gather_grads", "load_full_state_dict", "clip_grad_norm_", "save_checkpoint",
                "load_checkpoint"}  # fmt: skip
    if "pp" not in LAYOUTS[layout]:
        expected |= {"save_pretrained", "load_pretrained"}
    for said in pool.run(contradicting_groups_raise, 4, LAYOUTS[layout], str(tmp_path)):
        assert said.keys() == expected, sorted(expected - said.keys())
        for name, message in said.items():
            assert message.startswith(f"{name}: ") and "placement records name" in message, message
    assert not any(Path(tmp_path).iterdir()), "a refused call wrote something"


def overlapping_groups_raise(rank, world, group):
    """TP 2 x DP 2: data_parallel, pipeline_split and train_step(dp_group=) given the world or the
    tensor-parallel group (which hold different shards, not replicas or stages): every rank raises."""
    mesh = tplayers.init_mesh(dp=2, tp=2)
    said = {}
    for name, call in {
        "data_parallel": lambda m, o: tplayers.data_parallel(m, group=group),
        "pipeline_split": lambda m, o: tplayers.pipeline_split(m, group=mesh["tp"]),
        "train_step": lambda m, o: tplayers.train_step(
            m, o, [torch.zeros(1, 4, dtype=torch.long)], None, dp_group=mesh["tp"]
        ),  # fmt: skip
    }.items():
        model = tiny_llama()
        tplayers.parallelize(model, group=mesh["tp"], verify=False)
        try:
            call(model, torch.optim.SGD(model.parameters(), lr=0.1))
        except ValueError as e:
            said[name] = str(e)
    return said


def test_groups_that_overlap_the_records_are_refused_on_every_rank(pool):
    for said in pool.run(overlapping_groups_raise, 4):
        assert said.keys() == {"data_parallel", "pipeline_split", "train_step"}, said
        assert "overlaps the tensor-parallel group" in said["data_parallel"], said
        assert "pipeline group [0, 1] overlaps" in said["pipeline_split"] or "[2, 3] overlaps" in said["pipeline_split"]
        assert "dp_group" in said["train_step"] and "overlaps" in said["train_step"], said
