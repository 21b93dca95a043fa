"""Bad input raises a clear error on every rank before any collective; failures never hang."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import tplayers
from tplayers.nn.linear import splits_checked_together
from tplayers.testing import RemoteError

pytestmark = pytest.mark.multirank


def build_and_call(rank, tp, group, case):
    if case == "out_not_in_units":  # (widths that do not divide the TP size are split unevenly)
        tplayers.ColumnParallelLinear(8, 10, group=group, split_unit=4)
    elif case == "in_not_in_units":
        tplayers.RowParallelLinear(10, 8, group=group, split_unit=4)
    elif case == "split_sizes":  # an explicit split must cover the units once, one size per rank
        tplayers.ColumnParallelLinear(8, 12, group=group, split_unit=4, split_sizes=[2, 1, 1])
    elif case == "split_sizes_differ":  # each rank's split is valid, but not its peers'
        tplayers.RowParallelLinear(12, 8, group=group, split_unit=4, split_sizes=[1, 1, 1] if rank else [2, 1, 0])
    elif case == "split_sizes_differ_together":  # checked at the end of the block, the disagreeing layer named
        with splits_checked_together():
            tplayers.ColumnParallelLinear(8, 12, group=group, split_unit=4, split_sizes=[1, 1, 1])
            told = [1, 1, 1] if rank else [2, 1, 0]
            tplayers.ColumnParallelLinear(8, 12, group=group, split_unit=4, split_sizes=told)
    elif case == "layers_differ_together":  # a rank that built one layer more than its peers
        with splits_checked_together():
            for _ in range(2 if rank else 1):
                tplayers.RowParallelLinear(12, 8, group=group, split_unit=4, split_sizes=[1, 1, 1])
    elif case == "split_sizes_gathered":
        tplayers.ColumnParallelLinear(8, 12, group=group, split_sizes=[4, 4, 4], gather_output=True)
    col = tplayers.ColumnParallelLinear(8, 6 * tp, group=group, sequence_parallel=case.startswith("sp"))
    row = tplayers.RowParallelLinear(6 * tp, 8, group=group, sequence_parallel=case == "sp_row_seq")
    inputs = {
        "last_dim": torch.randn(2, 3, 7),
        "dtype": torch.randn(2, 3, 8, dtype=torch.float16),
        "device": torch.randn(2, 3, 8, device="meta"),
        "sp_not_3d": torch.randn(2, 3, 1, 8),
    }
    if case == "sp_row_seq":
        return row(torch.randn(2, 3 * tp + 1, 6))
    col(inputs[case])


CASES = {
    "out_not_in_units": (ValueError, r"split_unit 4 needs out_features \(10\) in whole units"),
    "in_not_in_units": (ValueError, r"split_unit 4 needs in_features \(10\) in whole units"),
    "split_sizes": (ValueError, r"split sizes \[2, 1, 1\] are not 3 non-negative sizes summing to 3"),
    "split_sizes_differ": (
        ValueError,
        r"the ranks were told different splits \(rank by rank: \[\[2, 1, 0\], \[1, 1, 1\]",
    ),
    "split_sizes_differ_together": (
        ValueError,
        r"ColumnParallelLinear: the ranks were told different splits \(rank by rank: \[\[2, 1, 0\], \[1, 1, 1\]",
    ),
    "layers_differ_together": (ValueError, r"the ranks built different layers"),
    "split_sizes_gathered": (ValueError, r"split_unit / split_sizes need gather_output=False"),
    "last_dim": (ValueError, r"input last dim \(7,\) does not match the layer's 8"),
    "dtype": (TypeError, "input dtype torch.float16 does not match the weight dtype torch.float32"),
    "device": (ValueError, "input is on meta but the weight is on cpu"),
    "sp_not_3d": (ValueError, r"sequence_parallel needs a \(batch, seq, hidden\) or \(tokens, hidden\) input"),
    "sp_row_seq": (
        ValueError,
        r"10 along dim 1 of \(2, 10, 6\) does not split over 3 ranks evenly.*sequence_split\(10",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_raises_before_any_collective(pool, case):
    error, pattern = CASES[case]
    start = time.monotonic()
    replies = pool.run(build_and_call, 3, case, return_exceptions=True)
    assert time.monotonic() - start < 30  # nobody waited for a collective timeout
    assert len(replies) == 3
    for reply in replies:
        assert isinstance(reply, RemoteError) and reply.type_name == error.__name__, reply
        assert re.search(pattern, reply.message), reply.message


def test_unknown_backend_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        tplayers.set_backend("cuda")


def raise_on_rank_one(rank, tp, group):
    if rank == 1:
        raise RuntimeError("injected failure on rank one")
    dist.all_reduce(torch.ones(1), group=group)  # rank 0 waits for rank 1, which never comes


def die_on_rank_one(rank, tp, group):
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1), group=group)


def test_failing_rank_traceback_surfaces_fast(pool):
    start = time.monotonic()
    with pytest.raises(tplayers.RankError, match="(?s)rank 1 of 2 raised RuntimeError.*raise_on_rank_one"):
        pool.run(raise_on_rank_one, 2)
    assert time.monotonic() - start < 20
    assert pool.run(lambda_free_sum, 2) == [2.0, 2.0]  # the pool recovered


def test_dead_rank_fails_the_others_fast(pool):
    start = time.monotonic()
    with pytest.raises(tplayers.RankError, match="rank 1 died"):
        pool.run(die_on_rank_one, 2)
    assert time.monotonic() - start < 20
    assert pool.run(lambda_free_sum, 2) == [2.0, 2.0]


def lambda_free_sum(rank, tp, group):
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item()


def launched(rank, world_size, fail):
    if fail and rank == 1:
        raise ValueError("launch: injected")
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_launch_returns_results_and_surfaces_failures():
    assert tplayers.launch(launched, 2, False) == [1.0, 1.0]
    start = time.monotonic()
    with pytest.raises(tplayers.RankError, match="(?s)rank 1 of 2 failed.*launch: injected"):
        tplayers.launch(launched, 2, True)
    assert time.monotonic() - start < 30


def test_init_mesh_rejects_wrong_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"world size 4 != dp\*pp\*tp = 1\*1\*3 = 3"):
        tplayers.init_mesh(tp=3)


def _heads_from_the_config(model):
    """Plant what a model's own code does when it reads its head count from the config instead of
    its projection (a raw crash once sharded): the first layer's attention reshapes to every head."""
    import types

    attention = model.model.layers[0].self_attn
    forward = attention.forward

    def by_config(self, hidden_states, *args, **kwargs):
        q = self.q_proj(hidden_states)
        heads = self.config.num_attention_heads
        q.view(*hidden_states.shape[:-1], heads, self.head_dim)  # the view HF's code would take
        return forward(hidden_states, *args, **kwargs)

    attention.forward = types.MethodType(by_config, attention)
    return model


def crash_inside_the_model(rank, tp, group, verify):
    from test_fused_loss import tiny_llama

    model = _heads_from_the_config(tiny_llama())
    if verify:
        with pytest.raises(tplayers.hf.verify.VerifyError) as caught:
            tplayers.parallelize(model, group=group)
        return str(caught.value)
    tplayers.parallelize(model, group=group, verify=False)
    with pytest.raises(RuntimeError, match="is invalid for input of size") as caught:
        model(torch.randint(0, 50, (2, 6)))
    return "\n".join(caught.value.__notes__)


@pytest.mark.parametrize("verify", [True, False], ids=["self-check", "verify=False"])
def test_a_crash_inside_the_sharded_model_names_tplayers_the_model_and_the_module(pool, verify):
    """The self-check's failure, or (verify=False) the error of a later forward, names tplayers, the
    model and type and the innermost module that raised, not only the model's own raw error."""
    for message in pool.run(crash_inside_the_model, 2, verify):
        assert "LlamaForCausalLM (llama)" in message, message
        assert "in model.layers.0.self_attn (LlamaAttention)" in message, message
        assert ("parallelize(verify)" if verify else "tplayers: raised") in message, message


def compiled(rank, tp, group):
    from test_fused_loss import tiny_llama

    model = tplayers.parallelize(tiny_llama(), group=group)
    ids = torch.randint(0, 50, (2, 6))
    with pytest.raises(Exception) as caught:
        torch.compile(model, backend="eager")(ids, labels=ids)
    return "\n".join(getattr(caught.value, "__notes__", [str(caught.value)]))


def test_torch_compile_of_a_parallelized_model_is_said_to_be_unsupported(pool):
    """torch.compile does not trace the sharded layers' hooks and collectives: its error from inside
    Dynamo carries a note saying so (the Trainer's torch_compile=True is refused: tests/test_trainer.py)."""
    for message in pool.run(compiled, 2):
        assert "torch.compile of a model tplayers parallelized is not supported yet" in message, message


def tie_left_whole(rank, tp, group, how):
    """A second embedding holding the input embedding's Parameter (tied): kept whole by the plan, the
    pass would shard the one and leave the other, two tensors from then on; unplanned, it is split
    as the other is (BART's encoder and decoder embeddings beside `shared`), the one Parameter still
    held by both. Untied (a copy), the second is simply whole."""
    from test_fused_loss import tiny_llama

    model = tiny_llama()
    embedding = model.model.embed_tokens
    model.extra = torch.nn.Embedding(*embedding.weight.shape)
    untied = how == "untied"
    model.extra.weight = torch.nn.Parameter(embedding.weight.detach().clone()) if untied else embedding.weight
    try:
        tplayers.parallelize(model, group=group, verify=False, plan={"extra": "replicate"} if how == "kept" else None)
    except ValueError as e:
        return str(e)
    return model.extra.weight is model.model.embed_tokens.weight


def test_a_tie_the_pass_would_break_is_refused_by_name(pool):
    for message in pool.run(tie_left_whole, 2, "kept"):
        assert "extra.weight is the same Parameter as model.embed_tokens.weight (tied)" in str(message), message
    assert pool.run(tie_left_whole, 2, "tied") == [True, True]  # split as one, still tied
    assert pool.run(tie_left_whole, 2, "untied") == [False, False]  # negative control: no tie, no refusal


# -- a refused parallelize gives the model back as it was given --------------------------------
def _fingerprint(model):
    """Everything of `model` a refused parallelize may have changed, for comparison by ==, with
    the objects themselves (an optimizer made before holds them)."""
    modules = list(model.named_modules())
    hooks = [name for name, m in modules for key, table in vars(m).items() if key.endswith("hooks") and table]
    tagged = [name for name, m in modules if any(k.startswith("_tplayers") for k in vars(m))]
    tagged += [name for name, p in model.named_parameters() if vars(p)]
    return dict(
        modules=[(name, type(m), id(m)) for name, m in modules],
        parameters=[(name, id(p), p.requires_grad) for name, p in model.named_parameters()],
        state={k: v.clone() for k, v in model.state_dict().items()},
        config=model.config.to_dict(),
        hooks=hooks,
        tagged=tagged,
    )


def _differences(before, after):
    out = [key for key in ("modules", "parameters", "config", "hooks", "tagged") if before[key] != after[key]]
    same_keys = before["state"].keys() == after["state"].keys()
    if not same_keys or any(not torch.equal(before["state"][k], after["state"][k]) for k in before["state"]):
        out.append("state")
    return out


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def refused_then_given_back(rank, tp, group, how, rollback=True):
    """parallelize refused at `how` (mid-pass: a Linear no adapter places; at the self-check: a
    crash inside the sharded model; the same on a peft model): the model after it against before
    (what differs, by kind), the same training step bitwise, and a second parallelize that can
    succeed (the cause removed) exact by its self-check."""
    import contextlib
    import importlib

    import peft
    from test_fused_loss import tiny_llama

    module = importlib.import_module("tplayers.hf.parallelize")

    model = tiny_llama()
    if how == "peft":
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    base = model.get_base_model() if how == "peft" else model
    if how == "unplaced":
        base.model.layers[1].mlp.extra = torch.nn.Linear(24, 24)  # after layer 0 is sharded
    else:
        _heads_from_the_config(base)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    before, reference = _fingerprint(model), _step(model, ids)
    model.zero_grad(set_to_none=True)
    saved = module.restored_if_refused
    module.restored_if_refused = saved if rollback else lambda model: contextlib.nullcontext()
    try:
        with pytest.raises((ValueError, tplayers.hf.verify.VerifyError)) as refused:
            tplayers.parallelize(model, group=group)
    finally:
        module.restored_if_refused = saved
    differences = _differences(before, _fingerprint(model))
    if not rollback:
        return differences
    logits, grads = _step(model, ids)
    same_step = torch.equal(logits, reference[0]) and grads.keys() == reference[1].keys()
    same_step = same_step and all(torch.equal(grads[n], reference[1][n]) for n in grads)
    if how == "unplaced":
        del base.model.layers[1].mlp.extra
    else:
        del base.model.layers[0].self_attn.forward  # the instance's patch: the class's forward again
    model.zero_grad(set_to_none=True)
    tplayers.parallelize(model, group=group)  # verify on: exact against the unsharded model, or raises
    return type(refused.value).__name__, differences, same_step


@pytest.mark.parametrize("how", ["unplaced", "self-check", "peft"])
def test_a_refused_parallelize_gives_the_model_back_as_it_was_given(pool, how):
    """Every module, parameter (the same objects, bitwise), buffer, config field and hook as before;
    no tplayers record left; the same training step bitwise; parallelize again works."""
    expected = "ValueError" if how == "unplaced" else "VerifyError"
    assert pool.run(refused_then_given_back, 2, how) == [(expected, [], True)] * 2


def test_without_the_rollback_the_model_is_left_changed(pool):
    """Negative control of the comparison above: the pass changes the model in place."""
    for differences in pool.run(refused_then_given_back, 2, "unplaced", False):
        assert {"modules", "parameters", "state", "hooks", "tagged"} <= set(differences), differences


def test_the_rollback_restores_what_a_block_changed_and_refuses_what_it_cannot():
    """tplayers.hf.rollback on a plain module: a swapped child, a new attribute, a hook, a tensor's
    `.data` and attributes put back (the same objects); a tensor written in place cannot be, so the
    module then refuses every forward, and the error says why."""
    from tplayers.hf.rollback import restored_if_refused

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
    first, weight, data = model[0], model[0].weight, model[0].weight.data
    with pytest.raises(ValueError, match="refused here"), restored_if_refused(model):
        model[0] = torch.nn.Linear(2, 1)
        first.weight.data = torch.zeros(1, 2)
        first.weight.tagged = True
        first.heads = 1
        model.register_forward_hook(lambda *a: None)
        raise ValueError("refused here")
    assert model[0] is first and first.weight is weight and first.weight.data.data_ptr() == data.data_ptr()
    assert not hasattr(first.weight, "tagged") and not hasattr(first, "heads") and not model._forward_hooks
    model(torch.ones(2))  # runs as given

    with pytest.raises(ValueError) as caught, restored_if_refused(model):
        with torch.no_grad():
            weight.mul_(2)
        raise ValueError("refused here")
    assert "could not put the model back as it was given" in "\n".join(caught.value.__notes__)
    with pytest.raises(RuntimeError, match="changed in place by a refused tplayers.hf.parallelize"):
        model(torch.ones(2))
