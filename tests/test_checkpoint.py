"""Sharded checkpoints (`tplayers.save_checkpoint` / `load_checkpoint`): saved at one layout and
loaded at another, the state gathers to exactly the saved one and training goes on equal to the
unsharded model; the same layout resumes bit for bit; damaged or mismatched checkpoints raise
and leave the model as it was."""

import contextlib
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tplayers
from tplayers.testing import RemoteError, assert_close

pytestmark = pytest.mark.multirank

VOCAB = 96


def tiny_llama(seed, layers=2, hidden=32, dropout=0.0, vocab=VOCAB, ffn=64):
    import transformers as tf

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False, attention_dropout=dropout)  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def next_token_loss(logits, ids):
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def batch(step):
    return torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(100 + step))


class Run:
    """The tiny Llama at a layout (tp, dp, zero, pp, sp) on this rank: model, optimizer, step()."""

    def __init__(self, group, seed, tp=1, dp=1, pp=1, zero=0, sp=False, **model_kw):
        self.model = tiny_llama(seed, **model_kw)
        world = tp * dp * pp
        mesh = tplayers.init_mesh(dp=dp, pp=pp, tp=tp) if world == dist.get_world_size() else None
        groups = {name: (mesh[name] if mesh is not None else group) for name in ("tp", "dp", "pp")}
        self.tp_group, self.dp_rank = groups["tp"], (mesh["dp"].get_local_rank() if mesh is not None else 0)
        self.dp, self.group = dp, group
        if tp > 1:
            tplayers.parallelize(self.model, group=groups["tp"], sequence_parallel=sp, verify=False)
        self.schedule = None
        modules = [self.model]
        if pp > 1:
            stages = tplayers.pipeline_split(self.model, group=groups["pp"])
            modules = [s.module for s in stages]
            self.schedule = tplayers.Schedule1F1B(stages[0], 2, next_token_loss)
        if dp > 1:
            for m in modules:
                tplayers.data_parallel(m, group=groups["dp"], zero_stage=zero)
        params = [p for m in modules for p in m.parameters()]
        self.opt = (
            tplayers.data_parallel_optimizer(modules[0], torch.optim.AdamW, lr=1e-2, eps=1e-4)
            if dp > 1
            else torch.optim.AdamW(params, lr=1e-2, eps=1e-4)
        )

    def step(self, step):
        ids = batch(step).chunk(self.dp)[self.dp_rank]
        if self.schedule is not None:
            self.schedule.step(ids, target=ids)
        else:
            next_token_loss(self.model(ids).logits, ids).backward()
        self.opt.step()
        self.opt.zero_grad()

    def gathered(self):
        """{name: full tensor} of what this rank holds (its stages' under pipeline parallelism)."""
        full = tplayers.gather_state_dict(self.model, group=self.tp_group)
        return {k: full[k].detach().clone() for k in _held(self)}


def reference_after(steps, **model_kw):
    model = tiny_llama(0, **model_kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    for step in range(steps):
        next_token_loss(model(batch(step)).logits, batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def save_after_one_step(rank, world, group, path, layout):
    run = Run(group, 0, **layout)
    run.step(0)
    tplayers.save_checkpoint(path, model=run.model, optimizer=run.opt, extra={"step": 1}, group=group)
    return run.gathered()


def load_and_step(rank, world, group, path, layout, staged=True):
    run = Run(group, 7, **layout)  # other weights: everything must come from the checkpoint
    extra = tplayers.load_checkpoint(path, model=run.model, optimizer=run.opt, group=group, staged=staged)
    loaded = run.gathered()
    run.step(1)
    return extra, loaded, run.gathered()


def _held(run):
    """The state-dict names this rank's layout holds (all, or its pipeline stages')."""
    from tplayers.checkpoint.chunks import model_pieces

    return sorted(model_pieces(run.model))


# tp4: 2 key/value heads over 4 ranks, each held by the two ranks that read it (their AdamW state too)
SAVED_AT = {"tp2-dp2-zero3": dict(tp=2, dp=2, zero=3), "pp2": dict(pp=2), "tp2-dp2-zero1": dict(tp=2, dp=2, zero=1),
            "tp4": dict(tp=4)}  # fmt: skip
LOADED_AT = {
    "tp2-dp2-zero3": ["tp4", "tp1", "pp2-tp2-sp", "tp2-dp2-zero1"],
    "pp2": ["tp1", "tp2-dp2-zero2"],
    "tp2-dp2-zero1": ["tp2-dp2-zero3"],  # ZeRO-1: each replica wrote the optimizer state it owns
    "tp4": ["tp2-dp2-zero3", "tp1"],
}
LAYOUTS = {"tp4": dict(tp=4), "tp1": dict(), "pp2-tp2-sp": dict(pp=2, tp=2, sp=True),
           "tp2-dp2-zero2": dict(tp=2, dp=2, zero=2), "tp2-dp2-zero1": dict(tp=2, dp=2, zero=1),
           "tp2-dp2-zero3": dict(tp=2, dp=2, zero=3)}  # fmt: skip


def _world(layout):
    return layout.get("tp", 1) * layout.get("dp", 1) * layout.get("pp", 1)


@pytest.mark.parametrize("saved_at", list(SAVED_AT))
def test_a_checkpoint_loads_at_another_layout_and_trains_on_like_unsharded(pool, tmp_path, saved_at):
    path = str(tmp_path / "ckpt")
    layout = SAVED_AT[saved_at]
    saved = pool.run(save_after_one_step, _world(layout), path, layout)
    saved = {k: v for rank in saved for k, v in rank.items()}  # under pp, each rank its own stages
    reference = reference_after(2)
    for name in LOADED_AT[saved_at]:
        staged = name != "tp4"  # tp4: each chunk written into the model as it arrives
        for extra, loaded, trained in pool.run(load_and_step, _world(LAYOUTS[name]), path, LAYOUTS[name], staged):
            assert extra == {"step": 1}
            for key in loaded:
                assert torch.equal(loaded[key], saved[key]), f"{saved_at} -> {name}: {key} not loaded exactly"
                where = f"{saved_at} -> {name}: {key}"
                assert_close(trained[key], reference[key], msg=lambda m, w=where: f"{w}: {m}")


def test_uneven_splits_saved_at_one_layout_load_at_others(pool, tmp_path):
    """A vocabulary of 97: [49, 48] rows at TP 2 (each then split over ZeRO-3's two replicas),
    [25, 25, 25, 22] at TP 4; an intermediate size of 67: [34, 33] and [17, 17, 17, 16]."""
    path, sizes = str(tmp_path / "ckpt"), dict(vocab=97, ffn=67)
    saved = pool.run(save_after_one_step, 4, path, dict(tp=2, dp=2, zero=3, **sizes))[0]
    reference = reference_after(2, **sizes)
    for layout in (dict(tp=4, **sizes), dict(sizes), dict(tp=2, **sizes)):
        for extra, loaded, trained in pool.run(load_and_step, _world(layout), path, layout):
            assert extra == {"step": 1}
            for key in loaded:
                assert torch.equal(loaded[key], saved[key]), f"{layout}: {key} not loaded exactly"
                assert_close(trained[key], reference[key], msg=lambda m, k=key, at=layout: f"{at} {k}: {m}")


# ---------------------------------------------------------------------------- exact resume


def resume(rank, world, group, path, split_at):
    """4 steps of a bf16 model with fp32 masters, a dynamic loss scaler and dropout (the RNG in
    play): straight through, or `split_at` steps, save, a fresh run loads and does the rest."""

    def fresh(seed):
        model = tiny_llama(seed, dropout=0.2).to(torch.bfloat16)
        tplayers.parallelize(model, group=group, verify=False)
        opt = tplayers.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
        return model, opt, tplayers.DynamicLossScaler(init_scale=2.0**10, growth_interval=2, group=group)

    def steps(model, opt, scaler, start, stop):
        for step in range(start, stop):
            ids = batch(step)
            tplayers.train_step(model, opt, [ids], lambda m, b: next_token_loss(m(b).logits, b), scaler=scaler)

    torch.manual_seed(1000 + rank)
    model, opt, scaler = fresh(0)
    steps(model, opt, scaler, 0, split_at)
    if split_at < 4:
        tplayers.save_checkpoint(path, model=model, optimizer=opt, scaler=scaler, extra={"step": split_at}, group=group)
        torch.manual_seed(5)  # the RNG moves on: the checkpoint's must come back
        model, opt, scaler = fresh(3)
        extra = tplayers.load_checkpoint(path, model=model, optimizer=opt, scaler=scaler, group=group)
        steps(model, opt, scaler, extra["step"], 4)
    masters = [m.detach().clone() for m in opt._masters]
    return {k: v.clone() for k, v in model.state_dict().items()}, masters, scaler.state_dict()


def test_resume_at_the_same_layout_is_bit_identical(pool, tmp_path):
    straight = pool.run(resume, 2, str(tmp_path / "unused"), 4)
    resumed = pool.run(resume, 2, str(tmp_path / "ckpt"), 2)
    for (weights, masters, scaler), (weights2, masters2, scaler2) in zip(straight, resumed, strict=True):
        assert scaler == scaler2
        for key in weights:
            assert torch.equal(weights[key], weights2[key]), key
        assert all(torch.equal(a, b) for a, b in zip(masters, masters2, strict=True))


# ---------------------------------------------------------------------------- faults


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_tp2(rank, world, group, path, die_on_rank=None):
    run = Run(group, 0, tp=2)
    run.step(0)
    if die_on_rank == rank:
        from tplayers.checkpoint import planners

        def die(self, item):
            os._exit(3)

        planners.SavePlannerForChunks.resolve_data = die
    tplayers.save_checkpoint(path, model=run.model, optimizer=run.opt, group=group)
    return run.gathered()


def load_tp2(rank, world, group, path, model_kw=None):
    run = Run(group, 7, tp=2, **(model_kw or {}))
    before = _snapshot(run.model)
    try:
        tplayers.load_checkpoint(path, model=run.model, optimizer=run.opt, group=group)
    except tplayers.CheckpointError as e:
        after = _snapshot(run.model)
        assert all(torch.equal(before[k], after[k]) for k in before), "a failed load changed the model"
        assert not run.opt.state, "a failed load changed the optimizer"
        return str(e)
    return run.gathered()


def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint(pool, tmp_path):
    path = str(tmp_path / "ckpt")
    first = pool.run(save_tp2, 2, path)[0]
    with pytest.raises(tplayers.RankError, match="rank 1 died"):
        pool.run(save_tp2, 2, path, 1)
    assert (tmp_path / "ckpt.partial").is_dir()
    loaded = pool.run(load_tp2, 2, path)[0]
    assert all(torch.equal(loaded[k], first[k]) for k in first)
    message = pool.run(load_tp2, 2, path + ".partial")[0]
    assert "is not a complete tplayers checkpoint" in message


def test_damaged_or_mismatched_checkpoints_raise_and_change_nothing(pool, tmp_path):
    path = tmp_path / "ckpt"
    pool.run(save_tp2, 2, str(path))
    cases = {
        r"model.model.layers.2.* is not in the checkpoint": dict(layers=3),  # a tensor the checkpoint lacks
        r"model.model.embed_tokens.weight: the checkpoint holds \(96, 32\) torch.float32, the model \(96, 48\)": dict(
            hidden=48
        ),
    }
    for pattern, kw in cases.items():
        for message in pool.run(load_tp2, 2, str(path), kw):
            assert isinstance(message, str) and re.search(pattern, message), message
    shard = next(Path(path).glob("__1_*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    for message in pool.run(load_tp2, 2, str(path), return_exceptions=False):
        expected = r"cannot be read \(a truncated .*EOFError.*unchanged"
        assert isinstance(message, str) and re.search(expected, message), message


def load_with_scaler(rank, world, group, path):
    run = Run(group, 7, tp=2)
    try:
        tplayers.load_checkpoint(path, model=run.model, scaler=tplayers.DynamicLossScaler(group=group), group=group)
    except tplayers.CheckpointError as e:
        return str(e)


def test_a_scaler_the_checkpoint_lacks_is_named(pool, tmp_path):
    path = str(tmp_path / "ckpt")
    pool.run(save_tp2, 2, path)  # no scaler saved
    for message in pool.run(load_with_scaler, 2, path):
        assert "scaler is not in the checkpoint (saved without it?)" in message, message


def test_unexpected_tensors_in_the_checkpoint_are_named(pool, tmp_path):
    path = str(tmp_path / "ckpt")
    pool.run(save_after_one_step, 2, path, dict(tp=2))
    small = pool.run(load_tp2, 2, path, dict(layers=1), return_exceptions=True)
    assert all(isinstance(m, str) and "model.model.layers.1" in m and "not in the model" in m for m in small), small
    assert not any(isinstance(m, RemoteError) for m in small)


# ---------------------------------------------------------------------------- HuggingFace directories


@contextlib.contextmanager
def counting_reads():
    """[elements read from HF checkpoint files] inside the block (load_pretrained's reader counted)."""
    from tplayers.checkpoint import hf

    read, original = [0], hf._Reader.read

    def counted(self, *args):
        out = original(self, *args)
        read[0] += out.numel()
        return out

    hf._Reader.read = counted
    try:
        yield read
    finally:
        hf._Reader.read = original


def from_hf_directory(rank, world, group, source, target, family):
    """Build on meta, shard, read this rank's slices of the HF directory, train a step, export."""
    import transformers as tf

    with counting_reads() as read:
        with tplayers.parameters_on_meta():
            model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(source))
        tplayers.parallelize(model, group=group, verify=False)
        assert all(p.device.type == "meta" for p in model.parameters())  # nothing allocated yet
        tplayers.load_pretrained(model, source, group=group)
    held = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = batch(0)
    next_token_loss(model(ids).logits, ids).backward()
    opt.step()
    with torch.no_grad():
        logits = model(batch(1)).logits
    tplayers.save_pretrained(model, target, group=group)
    return read[0], held, logits


# gpt2: fused c_attn, Conv1D, tied head; phi3: fused qkv_proj and gate_up_proj; a vocabulary of 97:
# uneven slices of the safetensors' rows
@pytest.mark.parametrize("family, vocab", [("llama", None), ("gpt2", None), ("phi3", None), ("gpt2", 97)])
def test_hf_directory_loads_sliced_on_meta_and_exports_back(pool, tmp_path, family, vocab):
    import transformers as tf
    from test_families import tiny_model

    reference = tiny_model(family, vocab=vocab)
    reference.save_pretrained(tmp_path / "source")
    full = sum(p.numel() for p in reference.parameters())
    for read, held, logits in pool.run(from_hf_directory, 2, tmp_path / "source", tmp_path / "trained", family):
        assert read == held < full  # each rank read exactly the slices it holds
        back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "trained")
        with torch.no_grad():
            assert_close(back(batch(1)).logits, logits)


def load_bin(rank, world, group, source, allow):
    import transformers as tf

    with tplayers.parameters_on_meta():
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(source))
    try:
        tplayers.load_pretrained(model, source, group=group, allow_pickle=allow)
    except tplayers.CheckpointError as e:
        return str(e)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_pickled_hf_weights_are_refused_unless_trusted(pool, tmp_path):
    from test_families import tiny_model

    reference = tiny_model("llama")
    reference.config.save_pretrained(tmp_path)  # transformers 5 writes safetensors only: the .bin by hand
    torch.save(reference.state_dict(), tmp_path / "pytorch_model.bin")
    refused, loaded = pool.run(load_bin, 1, tmp_path, False)[0], pool.run(load_bin, 1, tmp_path, True)[0]
    assert "pickled .bin weights" in refused and "allow_pickle=True" in refused
    assert all(torch.equal(loaded[k], v) for k, v in reference.state_dict().items())


def save_from_stages(rank, world, group, path):
    """PP2 x TP2: one step, saved from the model, then the model dropped and saved again from
    this rank's stages alone (their export records and names are theirs)."""
    import gc

    mesh = tplayers.init_mesh(pp=2, tp=2)
    model = tiny_llama(0)
    tplayers.parallelize(model, group=mesh["tp"], verify=False)
    stages = tplayers.pipeline_split(model, group=mesh["pp"])
    schedule = tplayers.Schedule1F1B(stages[0], 2, next_token_loss)
    opt = torch.optim.AdamW(stages[0].parameters(), lr=1e-2, eps=1e-4)
    schedule.step(batch(0), target=batch(0))
    opt.step()
    tplayers.save_checkpoint(f"{path}/from-model", model=model, optimizer=opt)
    del model
    gc.collect()
    tplayers.save_checkpoint(f"{path}/from-stages", model=stages, optimizer=opt)


def load_whole(rank, world, group, path):
    run = Run(group, 7)
    tplayers.load_checkpoint(path, model=run.model, optimizer=run.opt, group=group)
    state = {f"optim.{k}": v for k, v in run.opt.state_dict()["state"].items()}
    return run.gathered(), state


def test_a_pipeline_rank_saves_from_its_stages_once_the_model_is_gone(pool, tmp_path):
    pool.run(save_from_stages, 4, str(tmp_path))
    (from_model, opt_a), (from_stages, opt_b) = (
        pool.run(load_whole, 1, str(tmp_path / name))[0] for name in ("from-model", "from-stages")
    )
    assert from_model.keys() == from_stages.keys()
    assert all(torch.equal(from_model[k], from_stages[k]) for k in from_model)
    assert all(torch.equal(a, b) for k in opt_a for a, b in zip(opt_a[k].values(), opt_b[k].values(), strict=True))


# ---------------------------------------------------------------------------- what a save may replace


def _tiny(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def save_tiny(rank, world, group, path, seed, keep=None):
    """Save a tiny model (weights from `seed`); the refusal's message, or None."""
    try:
        tplayers.save_checkpoint(path, model=_tiny(seed), group=group, keep=keep)
    except tplayers.CheckpointError as e:
        return str(e)


def load_tiny(rank, world, group, path):
    model = _tiny(99)
    tplayers.load_checkpoint(path, model=model, group=group)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_weights(loaded, seed):
    return all(torch.equal(loaded[k], v) for k, v in _tiny(seed).state_dict().items())


def _tree(path: Path) -> dict:
    """{relative path: bytes} of everything under `path` (or the file itself)."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def test_a_save_never_replaces_what_tplayers_did_not_write(pool, tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("my results")
    foreign = tmp_path / "my_experiment"
    (foreign / "data").mkdir(parents=True)
    (foreign / "data" / "train.csv").write_text("1,2,3\n")
    (foreign / "README").write_text("keep me")
    squatted = tmp_path / "ckpt"  # the name is free, but its .partial is the user's
    (tmp_path / "ckpt.partial").mkdir()
    (tmp_path / "ckpt.partial" / "mine.txt").write_text("not a checkpoint")
    for target, said in [
        (a_file, "exists and is not a directory"),
        (foreign, "is a directory that is not a tplayers checkpoint"),
        (squatted, "ckpt.partial exists and was not written by tplayers"),
    ]:
        before = _tree(tmp_path)
        for message in pool.run(save_tiny, 2, str(target), 0):  # every rank refuses
            assert message is not None and said in message and str(target.name) in message, message
        assert _tree(tmp_path) == before, f"a refused save onto {target} changed the disk"


def test_a_save_replaces_an_old_checkpoint_or_an_empty_directory(pool, tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()  # empty: nothing to lose
    assert pool.run(save_tiny, 2, str(path), 0) == [None, None]
    assert pool.run(save_tiny, 2, str(path), 1) == [None, None]  # the old checkpoint: replaced
    assert _same_weights(pool.run(load_tiny, 2, str(path))[0], 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .old or .partial left


def test_an_interrupted_save_is_finished_or_undone_by_the_next_save_or_load(pool, tmp_path):
    path = tmp_path / "ckpt"
    pool.run(save_tiny, 1, str(path), 0)
    # died between its two renames: the old checkpoint moved aside, the new one complete
    path.rename(tmp_path / "ckpt.old")
    pool.run(save_tiny, 1, str(tmp_path / "other"), 1)
    (tmp_path / "other").rename(tmp_path / "ckpt.partial")
    assert _same_weights(pool.run(load_tiny, 2, str(path))[0], 1)  # the newer one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    # died before its renames: only the old checkpoint moved aside
    path.rename(tmp_path / "ckpt.old")
    assert _same_weights(pool.run(load_tiny, 2, str(path))[0], 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_keep_leaves_the_last_checkpoints_of_the_series_and_nothing_else(pool, tmp_path):
    (tmp_path / "step_notes").mkdir()  # not a checkpoint
    pool.run(save_tiny, 1, str(tmp_path / "best"), 0)  # a checkpoint of another name
    for step in (100, 200, 300, 400, 500):
        assert pool.run(save_tiny, 2, str(tmp_path / f"step_{step}"), step, 2) == [None, None]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step_400", "step_500", "step_notes"]
    assert _same_weights(pool.run(load_tiny, 1, str(tmp_path / "step_500"))[0], 500)
    assert "keep must be a positive int" in str(pytest.raises(ValueError, tplayers.save_checkpoint, "x", model=None,
                                                               keep=0).value)  # fmt: skip


def test_a_save_after_a_rank_died_mid_save_then_loads(pool, tmp_path):
    path = str(tmp_path / "ckpt")
    pool.run(save_tp2, 2, path)
    with pytest.raises(tplayers.RankError, match="rank 1 died"):
        pool.run(save_tp2, 2, path, 1)
    second = pool.run(save_after_one_step, 2, path, dict(tp=2))[0]  # cleans the partial save up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    extra, loaded, _ = pool.run(load_and_step, 2, path, dict(tp=2))[0]
    assert extra == {"step": 1} and all(torch.equal(loaded[k], second[k]) for k in second)


# ---------------------------------------------------------------------------- optimizer hyperparameters, schedulers


def schedule_run(rank, world, group, path, split_at, steps=6):
    """A TP-2 tiny Llama under AdamW with a StepLR (the learning rate halves every 2 steps):
    straight through, or `split_at` steps, save, and a fresh optimizer and scheduler (at the
    constructor's learning rate) load and do the rest."""

    def fresh(seed):
        run = Run(group, seed, tp=2)
        return run, torch.optim.lr_scheduler.StepLR(run.opt, step_size=2, gamma=0.5)

    run, scheduler = fresh(0)
    lrs = []
    for step in range(steps):
        if step == split_at:
            tplayers.save_checkpoint(path, model=run.model, optimizer=run.opt, scheduler=scheduler, group=group)
            run, scheduler = fresh(3)
            tplayers.load_checkpoint(path, model=run.model, optimizer=run.opt, scheduler=scheduler, group=group)
        lrs.append(run.opt.param_groups[0]["lr"])
        run.step(step)
        scheduler.step()
    return lrs, run.gathered()


def test_a_resumed_scheduler_continues_its_schedule_exactly(pool, tmp_path):
    straight = pool.run(schedule_run, 2, str(tmp_path / "unused"), -1)
    resumed = pool.run(schedule_run, 2, str(tmp_path / "ckpt"), 3)
    for (lrs, weights), (lrs2, weights2) in zip(straight, resumed, strict=True):
        assert lrs == lrs2 == [1e-2, 1e-2, 5e-3, 5e-3, 2.5e-3, 2.5e-3]
        assert all(torch.equal(weights[k], weights2[k]) for k in weights)


def param_groups_after_load(rank, world, group, path):
    """The optimizer's hyperparameters once a checkpoint saved after a scheduler changed them
    is loaded into a fresh optimizer (no scheduler: the param groups alone must carry them)."""
    run = Run(group, 0, tp=2)
    for group_ in run.opt.param_groups:
        group_.update(lr=1.25e-3, betas=(0.8, 0.95), weight_decay=0.3)
    tplayers.save_checkpoint(path, model=run.model, optimizer=run.opt, group=group)
    fresh = Run(group, 1, tp=2)
    tplayers.load_checkpoint(path, model=fresh.model, optimizer=fresh.opt, group=group)
    return [{k: v for k, v in g.items() if k != "params"} for g in fresh.opt.param_groups]


def test_the_optimizers_hyperparameters_are_restored(pool, tmp_path):
    for groups in pool.run(param_groups_after_load, 2, str(tmp_path / "ckpt")):
        assert [(g["lr"], g["betas"], g["weight_decay"]) for g in groups] == [(1.25e-3, (0.8, 0.95), 0.3)]


def save_family(rank, world, group, path, family):
    from test_families import tiny_model

    model = tplayers.parallelize(tiny_model(family), group=group, verify=False)
    tplayers.save_checkpoint(path, model=model, group=group)
    return tplayers.gather_state_dict(model, group=group)


def load_family(rank, world, group, path, family):
    from test_families import tiny_model

    torch.manual_seed(7)  # other weights: everything must come from the checkpoint
    model = tiny_model(family)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    tplayers.parallelize(model, group=group, verify=False)
    tplayers.load_checkpoint(path, model=model, group=group)
    return tplayers.gather_state_dict(model, group=group)


# MLA (latents whole, heads split, experts in 3-D), gpt-oss (experts in gate / up pairs with biases, the down
# bias whole), DBRX (experts stacked by expert): saved at TP 2, read at TP 3 and 4
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "dbrx"])
def test_2026_layouts_load_at_other_sizes(pool, tmp_path, family):
    saved = pool.run(save_family, 2, tmp_path / "ckpt", family)[0]
    for tp in (3, 4):
        loaded = pool.run(load_family, tp, tmp_path / "ckpt", family)[0]
        assert list(loaded) == list(saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), f"{family} {key} at TP {tp}"
