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
from tplayers.placement import update_placement
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


def trains_like_unsharded(rank, world, group, dp, tp, stage, sequence_parallel, steps=3, miscount=False):
    mesh, model, reference = build(dp, tp, stage, sequence_parallel)
    if miscount:  # negative control: the ZeRO shards' norms not summed over the replicas
        for p in model.parameters():
            update_placement(p, dp_sharded=False)
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


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_with_sequence_parallelism(pool, stage):
    pool.run(trains_like_unsharded, 4, 2, 2, stage, True)


def test_negative_control_shards_counted_once_too_few_fail_the_norm(pool):
    with pytest.raises(tplayers.RankError, match="clipped norm at step 0"):
        pool.run(trains_like_unsharded, 4, 2, 2, 3, False, 1, True)


def half_like_mixed_precision(rank, world, group, stage, dtype):
    """ZeRO with FSDP2's 16-bit compute and fp32 sharded masters (fp16: with the loss scaler)
    against the unsharded model in 16-bit with fp32 master weights (MixedPrecisionOptimizer):
    every clipped norm, loss and weight within the 16-bit tolerance."""
    mesh = tplayers.init_mesh(dp=2, tp=2)
    model = tiny_llama()
    reference = copy.deepcopy(model).to(dtype)
    tplayers.parallelize(model, group=mesh["tp"], verify=False)
    tplayers.data_parallel(model, group=mesh["dp"], zero_stage=stage, param_dtype=dtype)
    opt = tplayers.data_parallel_optimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-4)
    ref_opt = tplayers.MixedPrecisionOptimizer(torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4))
    fp16 = dtype == torch.float16
    scaler, ref_scaler = (tplayers.DynamicLossScaler(init_scale=2.0**8, enabled=fp16) for _ in range(2))
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(2):
        ids = batch(step, 2)
        mine = ids.chunk(2)[dp_rank]
        step_kw = dict(max_grad_norm=0.5)
        result = tplayers.train_step(model, opt, [mine], lambda m, b: m(b, labels=b).loss, scaler=scaler, **step_kw)
        ref = tplayers.train_step(
            reference, ref_opt, [ids], lambda m, b: m(b, labels=b).loss, scaler=ref_scaler, **step_kw
        )
        assert not result.skipped and not ref.skipped
        assert_close(torch.tensor(result.grad_norm).to(dtype), torch.tensor(ref.grad_norm).to(dtype))
        loss = torch.tensor([result.loss], dtype=torch.float64)
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # this replica's half -> the whole batch's
        assert_close((loss[0] / 2).to(dtype), torch.tensor(ref.loss).to(dtype))
    full = tplayers.gather_state_dict(model, group=mesh["tp"])
    assert all(v.dtype == torch.float32 for v in full.values())  # the masters
    for key, value in reference.state_dict().items():
        assert_close(full[key].to(value.dtype), value, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("stage, dtype", [(2, torch.bfloat16), (3, torch.bfloat16), (3, torch.float16)])
def test_16bit_under_zero_matches_mixed_precision(pool, stage, dtype):
    pool.run(half_like_mixed_precision, 4, stage, dtype)


def overflow_on_one_rank_skips_everywhere(rank, world, group, stage):
    mesh, model, _ = build(2, 2, stage, False)
    opt = tplayers.data_parallel_optimizer(model, torch.optim.AdamW, lr=1e-2)
    scaler = tplayers.DynamicLossScaler(init_scale=2.0**4)
    dp_rank = mesh["dp"].get_local_rank()

    def loss_fn(m, b):
        loss = m(b, labels=b).loss
        return loss * float("inf") if rank == 3 and step == 1 else loss  # one rank of one replica

    for step in range(2):
        before = tplayers.gather_state_dict(model, group=mesh["tp"])
        mine = batch(step, 2).chunk(2)[dp_rank]
        result = tplayers.train_step(model, opt, [mine], loss_fn, scaler=scaler, max_grad_norm=0.5)
        after = tplayers.gather_state_dict(model, group=mesh["tp"])
        assert result.skipped == (step == 1), (rank, step)
        if step == 1:
            assert all(torch.equal(after[k], v) for k, v in before.items())
    assert scaler.get_scale() == 2.0**3


@pytest.mark.parametrize("stage", [0, 3])
def test_overflow_on_one_rank_skips_on_every_rank(pool, stage):
    pool.run(overflow_on_one_rank_skips_everywhere, 4, stage)


def misuse(rank, world, group, case):
    mesh = tplayers.init_mesh(dp=2, tp=2)
    model = tiny_llama()
    if case == "overlap":  # TP over all four ranks, then DP over them too
        tplayers.parallelize(model, group=group, verify=False)
        tplayers.data_parallel(model, group=group)
    tplayers.parallelize(model, group=mesh["tp"], verify=False)
    if case == "stage":
        tplayers.data_parallel(model, group=mesh["dp"], zero_stage=4)
    if case == "twice":
        tplayers.data_parallel(model, group=mesh["dp"])
        tplayers.data_parallel(model, group=mesh["dp"], zero_stage=3)
    if case == "optimizer_first":
        opt = torch.optim.AdamW(model.parameters())
        tplayers.ZeRO3(model, group=mesh["dp"])
        model(batch(0, 1)[:1], labels=batch(0, 1)[:1]).loss.backward()
        opt.step()
    if case == "average_twice":
        tplayers.data_parallel(model, group=mesh["dp"])
        opt = tplayers.data_parallel_optimizer(model, torch.optim.SGD, lr=0.1)
        ids = batch(0, 1)
        tplayers.train_step(model, opt, [ids], lambda m, b: m(b, labels=b).loss, dp_group=mesh["dp"])
    if case == "param_dtype_stage0":
        tplayers.data_parallel(model, group=mesh["dp"], param_dtype=torch.bfloat16)
    if case == "master_weights":
        tplayers.data_parallel(model.to(torch.bfloat16), group=mesh["dp"])
        tplayers.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()))
    if case == "param_dtype_kind":
        tplayers.data_parallel(model, group=mesh["dp"], zero_stage=3, param_dtype=torch.float64)
    if case == "param_dtype_low":
        tplayers.data_parallel(model.to(torch.bfloat16), group=mesh["dp"], zero_stage=3, param_dtype=torch.bfloat16)
    if case == "param_dtype_sp":
        other = tiny_llama()
        tplayers.parallelize(other, group=mesh["tp"], sequence_parallel=True, verify=False)
        tplayers.data_parallel(other, group=mesh["dp"], zero_stage=3, param_dtype=torch.bfloat16)
    if case == "stages_as_replicas":  # PP 2 x TP 2: replicas asked for over the pipeline's ranks
        pp_mesh = tplayers.init_mesh(pp=2, tp=2)
        other = tiny_llama()
        tplayers.parallelize(other, group=pp_mesh["tp"], verify=False)
        stage = tplayers.pipeline_split(other, group=pp_mesh["pp"])[0]
        tplayers.data_parallel(stage.module, group=pp_mesh["pp"], zero_stage=3)


# every message a user sees on the data-parallel path, each naming the constraint it enforces
MISUSE = {
    "overlap": r"the data-parallel group \[0, 1, 2, 3\] overlaps the tensor-parallel group \[0, 1, 2, 3\]",
    "stage": r"zero_stage must be one of \(0, 1, 2, 3\), got 4",
    "twice": r"LlamaForCausalLM is already data-parallel \(zero_stage 0\)",
    "optimizer_first": r"AdamW holds model.embed_tokens.weight, which data_parallel replaced with its sharded form",
    "average_twice": r"passing dp_group would average them twice",
    "param_dtype_stage0": r"param_dtype needs ZeRO stage 2 or 3",
    "master_weights": r"MixedPrecisionOptimizer: the model is data-parallel",
    "param_dtype_kind": r"param_dtype must be torch.bfloat16 or torch.float16, got torch.float64",
    "param_dtype_low": r"keep the model in fp32 \(its shards are the masters\); model.embed_tokens.weight is not",
    "param_dtype_sp": r"is summed over the TP group by its own hook \(sequence parallelism\)",
    "stages_as_replicas": r"the data-parallel group \[(0, 2|1, 3)\] overlaps the pipeline group \[(0, 2|1, 3)\]",
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_is_refused_on_every_rank(pool, case):
    replies = pool.run(misuse, 4, case, return_exceptions=True)
    for reply in replies:
        assert isinstance(reply, RemoteError) and re.search(MISUSE[case], reply.message), reply


def tplayers_block_like_unsharded(rank, world, group, stage):
    """A module made of tplayers layers (no HF, no ModuleList: one FSDP unit) at TP 2 x DP 2."""
    from torch import nn

    mesh = tplayers.init_mesh(dp=2, tp=2)
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
    reference = nn.Sequential(copy.deepcopy(fc1), nn.GELU(), copy.deepcopy(fc2))
    model = nn.Sequential(
        tplayers.ColumnParallelLinear.from_linear(fc1, group=mesh["tp"]),
        nn.GELU(),
        tplayers.RowParallelLinear.from_linear(fc2, group=mesh["tp"]),
    )
    tplayers.data_parallel(model, group=mesh["dp"], zero_stage=stage)
    opt = tplayers.data_parallel_optimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-4)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    for step in range(3):
        x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(step))
        mine = x.chunk(2)[mesh["dp"].get_local_rank()]
        model(mine).square().mean().backward()
        norm = tplayers.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        reference(x).square().mean().backward()
        assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
        ref_opt.step()
        ref_opt.zero_grad()
    tp_rank = mesh["tp"].get_local_rank()
    shard = slice(tp_rank * 8, (tp_rank + 1) * 8)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    assert_close(full["0.weight"], reference[0].weight[shard].detach())
    assert_close(full["2.weight"], reference[2].weight[:, shard].detach())
    assert_close(full["2.bias"], reference[2].bias.detach())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_module_of_tplayers_layers(pool, stage):
    pool.run(tplayers_block_like_unsharded, 4, stage)


def state_dict_round_trip(rank, world, group, stage):
    """load_full_state_dict into a ZeRO model puts each replica's shard of each TP shard in place;
    gather_state_dict gives it back exactly."""
    mesh, model, reference = build(2, 2, stage, False)
    torch.manual_seed(5)
    other = tiny_llama().state_dict()  # different weights, same names
    for value in other.values():
        value.add_(0.02 * torch.randn_like(value) if value.is_floating_point() else 0)
    tplayers.load_full_state_dict(model, other, group=mesh["tp"])
    back = tplayers.gather_state_dict(model, group=mesh["tp"])
    for key, value in other.items():
        assert_close(back[key], value, exact=True, msg=lambda m, k=key: f"{k}: {m}")
    reference.load_state_dict(other)
    ids = batch(0, 1)
    assert_close(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("stage", [0, 3])
def test_full_state_dict_round_trips_under_zero(pool, stage):
    pool.run(state_dict_round_trip, 4, stage)


def read_after_evaluation(rank, world, group, path):
    """ZeRO-2 keeps the gathered parameters after a forward without backward (evaluation): the full
    state dict, a checkpoint and an HF checkpoint read then are the weights (at TP 1 the records give
    the tensors themselves, which FSDP2 frees at its next reshard: they read freed storage before)."""
    mesh = tplayers.init_mesh(dp=4, tp=1)
    model = tiny_llama()
    want = copy.deepcopy(model.state_dict())
    tplayers.parallelize(model, group=mesh["tp"], verify=False)
    tplayers.data_parallel(model, group=mesh["dp"], zero_stage=2)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.eval()(ids)
    for key, value in tplayers.gather_state_dict(model).items():
        assert torch.equal(value.clone(), want[key]), key
    model.eval()(ids)  # gathered again
    tplayers.save_checkpoint(path, model=model)
    fresh = tplayers.parallelize(tiny_llama(layers=2), group=mesh["tp"], verify=False)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    tplayers.load_checkpoint(path, model=fresh)
    for key, value in tplayers.gather_state_dict(fresh).items():
        assert torch.equal(value, want[key]), key


def test_reads_after_an_evaluation_forward_see_the_weights(pool, tmp_path):
    pool.run(read_after_evaluation, 4, str(tmp_path / "ckpt"))
