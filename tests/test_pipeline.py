"""Pipeline stages and schedules (`tplayers.PipelineStage`, the schedules, `pipeline_split`) on
local ranks against the unsharded model: the mean loss and every gradient, and weights after
several clipped optimizer steps; tied embeddings across the first and last stage; bad input."""

import copy
import functools
import re
import warnings

import pytest
import torch
from torch import nn

import tplayers
from tplayers.plan import Layout
from tplayers.testing import RemoteError, assert_close, check_parallel
from tplayers.testing.meshes import layout_mesh

pytestmark = pytest.mark.multirank

SCHEDULES = {
    "gpipe": (tplayers.ScheduleGPipe, 1),
    "1f1b": (tplayers.Schedule1F1B, 1),
    "interleaved-1f1b": (tplayers.ScheduleInterleaved1F1B, 2),
    "interleaved-zero-bubble": (tplayers.ScheduleInterleavedZeroBubble, 2),
}


def mlp_stack(layers=8, width=6):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def mse(out, target):
    return (out - target).square().mean()


def sequential_matches(rank, pp, group, schedule_name, n_microbatches):
    schedule_class, virtual = SCHEDULES[schedule_name]
    reference = mlp_stack()
    model = copy.deepcopy(reference)
    num_stages = pp * virtual
    per_stage = len(model) // num_stages
    stages = [
        tplayers.PipelineStage(model[i * per_stage : (i + 1) * per_stage], i, num_stages, group=group)
        for i in range(rank, num_stages, pp)
    ]
    schedule = schedule_class(stages if virtual > 1 else stages[0], n_microbatches, mse)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * n_microbatches, 6, generator=gen), torch.randn(2 * n_microbatches, 6, generator=gen)
    loss = schedule.step(x, target=y)
    ref_loss = mse(reference(x), y)
    ref_loss.backward()
    last = any(s.is_last for s in stages)
    assert (loss is not None) == last
    if last:
        assert_close(loss, ref_loss.detach())
    mine = {id(p) for s in stages for p in s.parameters()}
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if id(p) in mine:
            assert_close(p.grad, q.grad, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert p.grad is None, name


# micro-batches in {p, 2p, an odd count where the schedule allows it (not the interleaved ones)}
CASES = [(name, pp, m) for name, (_, virtual) in SCHEDULES.items()
         for pp, m in [(2, 2), (2, 4), (2, 3), (4, 4), (4, 8)] if virtual == 1 or m % pp == 0]  # fmt: skip


@pytest.mark.parametrize("schedule_name, pp, n_microbatches", CASES)
def test_schedules_give_the_unsharded_gradients(pool, schedule_name, pp, n_microbatches):
    pool.run(sequential_matches, pp, schedule_name, n_microbatches)


def tiny_llama(tied=False, layers=4):
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=tied)  # fmt: skip
    return tf.LlamaForCausalLM(cfg).eval()


def next_token_loss(logits, ids):
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def hf_split_trains_like_unsharded(rank, world, group, pp, tp, schedule_name, sequence_parallel, tied, family=None,
                                   config=None, length=8):  # fmt: skip
    """pipeline_split of a (parallelized) tiny Llama (or of `test_families.tiny_model(family,
    **config)`): 3 AdamW steps with clipping over all stages equal the unsharded model's: every
    loss, every clipped norm, every weight. `length`: the sequence's tokens."""
    from test_families import tiny_model

    schedule_class, virtual = SCHEDULES[schedule_name]
    model = tiny_llama(tied) if family is None else tiny_model(family, **config)
    reference = copy.deepcopy(model)
    pp_group = group
    if tp > 1:
        mesh = tplayers.init_mesh(pp=pp, tp=tp)
        pp_group = mesh["pp"]
        tplayers.parallelize(model, group=mesh["tp"], sequence_parallel=sequence_parallel, verify=False)
    stages = tplayers.pipeline_split(model, group=pp_group, virtual_stages=virtual)
    schedule = schedule_class(stages if virtual > 1 else stages[0], 2 * pp, next_token_loss)
    params = list({id(p): p for s in stages for p in s.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-4)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    last = any(s.is_last for s in stages)
    for step in range(3):
        ids = torch.randint(0, 96, (4 * pp, length), generator=torch.Generator().manual_seed(step))
        loss = schedule.step(ids, target=ids)
        norm = tplayers.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad()
        ref_loss = next_token_loss(reference(ids).logits, ids)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        if last:
            assert_close(loss, ref_loss.detach(), msg=lambda m, s=step: f"loss at step {s}: {m}")
        assert_close(norm, ref_norm, msg=lambda m, s=step: f"clipped norm at step {s}: {m}")
    full = tplayers.gather_state_dict(model, group=mesh["tp"]) if tp > 1 else model.state_dict()
    layers = {i for s in stages for i in s.module.layer_indices}
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    for key, value in reference.state_dict().items():
        index = re.match(r"model\.layers\.(\d+)\.", key)
        held = int(index[1]) in layers if index else (first if "embed_tokens" in key else last)
        if held or (tied and "embed_tokens" in key and last):
            assert_close(full[key], value, msg=lambda m, k=key: f"{k} after 3 steps: {m}")


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_split_pp2_matches_unsharded(pool, schedule_name, tied):
    pool.run(hf_split_trains_like_unsharded, 2, 2, 1, schedule_name, False, tied)


@pytest.mark.parametrize(
    "sequence_parallel, length", [(False, 8), (True, 8), (True, 7)], ids=["tp", "tp+sp", "tp+sp-7-tokens"]
)
def test_hf_split_pp2_tp2_matches_unsharded(pool, sequence_parallel, length):
    """7 tokens under sequence parallelism: each TP rank sends its part, 4 or 3 tokens, to the next stage."""
    pool.run(hf_split_trains_like_unsharded, 4, 2, 2, "1f1b", sequence_parallel, True, None, None, length)


def step_both(loss, params, opt, reference, ref_opt, ref_losses, replica, step):
    """After a schedule's step that returned `loss` (this replica's): clip and step the stages'
    `params` and the unsharded `reference` (on the mean of every replica's `ref_losses`); the loss
    and the clipped norm agree."""
    norm = tplayers.clip_grad_norm_(params, 0.5)
    opt.step()
    opt.zero_grad()
    (sum(ref_losses) / len(ref_losses)).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    ref_opt.step()
    ref_opt.zero_grad()
    assert_close(loss, ref_losses[replica].detach(), msg=lambda m: f"loss at step {step}: {m}")
    assert_close(norm, ref_norm, msg=lambda m: f"clipped norm at step {step}: {m}")


def assert_stage_weights_match(model, reference, stages, tp_group, steps):
    """Every weight this rank's stages hold (gathered over TP, HF's names) equals the reference's."""
    full = tplayers.gather_state_dict(model, group=tp_group)
    layers = {i for s in stages for i in s.module.layer_indices}
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    held = 0
    for key, value in reference.state_dict().items():
        index = re.match(r"model\.layers\.(\d+)\.", key)
        if int(index[1]) in layers if index else (first if "embed_tokens" in key else last):
            assert_close(full[key], value, msg=lambda m, k=key: f"{k} after {steps} steps: {m}")
            held += 1
    assert held > 0


def fused_last_stage_trains_like_unsharded(rank, world, group, mesh, schedule_name, sequence_parallel=False,
                                           training_logits=False, tied=False):  # fmt: skip
    """`tplayers.next_token_loss(model)` on the stages of a parallelized tiny Llama (mesh (dp, pp, tp);
    ZeRO-3 over dp): the last stage scores its labels with the fused LM-head loss, no logits made,
    and 2 AdamW steps with clipping equal the unsharded model's own `model(ids, labels=ids).loss`
    (each replica's on its half of the batch); with training_logits=True the head makes its logits."""
    from tplayers.nn.lm_head import is_deferred

    dp, pp, tp = mesh
    schedule_class, virtual = SCHEDULES[schedule_name]
    model = tiny_llama(tied).train()
    reference = copy.deepcopy(model)
    groups = layout_mesh(dp, pp, tp)
    tplayers.parallelize(model, group=groups["tp"], sequence_parallel=sequence_parallel,
                         training_logits=training_logits, verify=False)  # fmt: skip
    deferred = []  # whether each training forward of the head left its logits to the fused loss
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: deferred.append(is_deferred(out)))
    stages = tplayers.pipeline_split(model, group=groups["pp"], virtual_stages=virtual)
    for stage in stages if dp > 1 else ():
        tplayers.data_parallel(stage.module, group=groups["dp"], zero_stage=3)
    schedule = schedule_class(stages if virtual > 1 else stages[0], 2 * pp, tplayers.next_token_loss(model))
    params = list({id(p): p for s in stages for p in s.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-4)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    replica = groups["dp"].get_local_rank()
    last = any(s.is_last for s in stages)
    for step in range(2):
        ids = torch.randint(0, 96, (4 * pp * dp, 8), generator=torch.Generator().manual_seed(step))
        mine = ids.chunk(dp)[replica]
        loss = schedule.forward_backward(mine, mine)
        ref_losses = [reference(input_ids=part, labels=part).loss for part in ids.chunk(dp)]
        step_both(loss, params, opt, reference, ref_opt, ref_losses, replica, step)
        if last:  # the schedule's training forwards (the shape check on zeros runs in eval mode)
            assert deferred and deferred[-1] == (not training_logits), deferred
    assert_stage_weights_match(model, reference, stages, groups["tp"], 2)


FUSED_CASES = {
    "pp2-1f1b": ((1, 2, 1), "1f1b"),
    "pp2-interleaved-zero-bubble-tied": ((1, 2, 1), "interleaved-zero-bubble", False, False, True),
    "pp2-tp2-sp-gpipe": ((1, 2, 2), "gpipe", True),
    "dp2-pp2-zero3-1f1b": ((2, 2, 1), "1f1b"),  # FSDP2 reshards the head after the stage's forward
    "pp2-training-logits": ((1, 2, 1), "1f1b", False, True),  # the control: the head makes its logits
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_the_last_stage_scores_its_labels_without_logits(pool, case):
    mesh, *args = FUSED_CASES[case]
    pool.run(fused_last_stage_trains_like_unsharded, mesh[0] * mesh[1] * mesh[2], mesh, *args, mesh=mesh)


def misuse(rank, pp, group, case):
    model = mlp_stack(layers=4)
    if case == "stage_index":
        tplayers.PipelineStage(model[:2], 5, 2, group=group)
    if case == "num_stages":
        tplayers.PipelineStage(model[:2], rank, 3, group=group)
    if case == "stage_rank":
        tplayers.PipelineStage(model[:2], 1 - rank, 2, group=group)
    if case == "overlap":  # the layer is tensor-parallel over the very ranks given as stages
        tplayers.PipelineStage(tplayers.ColumnParallelLinear(6, 6, group=group), rank, 2, group=group)
    if case == "fewer_layers":
        tplayers.pipeline_split(tiny_llama(layers=1), group=group)
    if case == "layers_per_stage":
        tplayers.pipeline_split(tiny_llama(layers=3), group=group, layers_per_stage=[1, 1])
    if case == "virtual_stages":
        tplayers.pipeline_split(tiny_llama(layers=2), group=group, virtual_stages=0)
    if case == "not_stages":
        tplayers.ScheduleGPipe([model], 2, mse)
    stage = tplayers.PipelineStage(model[2 * rank : 2 * rank + 2], rank, 2, group=group)
    if case == "microbatches":
        tplayers.Schedule1F1B(stage, 1, mse)
    if case == "no_microbatches":
        tplayers.ScheduleGPipe(stage, 0, mse)
    if case == "rounds":
        stages = [tplayers.PipelineStage(model[i : i + 1], i, 4, group=group) for i in (rank, rank + 2)]
        tplayers.ScheduleInterleaved1F1B(stages, 5, mse)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    # each rank passes what it holds: the batch on the first stage's, the target on the last's
    if case == "batch":
        tplayers.ScheduleGPipe(stage, 4, mse).step(torch.randn(6, 6) if rank == 0 else None, target=y)
    if case == "target_split":
        tplayers.ScheduleGPipe(stage, 4, mse).step(x if rank == 0 else None, target=y[:6])
    if case == "no_batch":
        tplayers.ScheduleGPipe(stage, 4, mse).step(None, target=y)
    if case == "no_target":
        tplayers.ScheduleGPipe(stage, 4, mse).step(x if rank == 0 else None)


# every message a user sees on the schedule path, each naming the constraint it enforces
MISUSE = {
    "stage_index": r"stage_index 5 is outside 0..1",
    "num_stages": r"num_stages \(3\) must be a positive multiple of the pipeline ranks \(2\)",
    "stage_rank": r"stage [01] of 2 belongs on pipeline rank [01], not [01] \(stages are looped over the ranks\)",
    "overlap": r"PipelineStage: the pipeline group \[0, 1\] overlaps the tensor-parallel group \[0, 1\]",
    "fewer_layers": r"fewer decoder layers \(1\) than pipeline stages \(2\)",
    "layers_per_stage": r"layers_per_stage \[1, 1\] must be 2 positive counts adding to 3",
    "virtual_stages": r"virtual_stages must be a positive int, got 0",
    "not_stages": r"ScheduleGPipe: needs tplayers.PipelineStage objects",
    "microbatches": r"n_microbatches \(1\) must be at least 2 for 2 pipeline ranks: every rank holds one in flight",
    "no_microbatches": r"ScheduleGPipe: n_microbatches must be a positive int, got 0",
    "rounds": r"n_microbatches \(5\) must be a multiple of its rounds \(5 // 2 pipeline ranks = 2\)",
    "batch": r"ScheduleGPipe.step: x of shape \(6, 6\) does not split into 4 micro-batches",
    "target_split": r"ScheduleGPipe.step: target of shape \(6, 6\) does not split into 4 micro-batches",
    "no_batch": r"ScheduleGPipe.step: the first stage needs the batch x",
    "no_target": r"ScheduleGPipe.step: the last stage needs the target",
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_is_refused_on_every_rank_before_any_send(pool, case):
    for reply in pool.run(misuse, 2, case, return_exceptions=True):
        assert isinstance(reply, RemoteError) and re.search(MISUSE[case], reply.message), reply


def per_stage_norm(rank, pp, group):
    """Negative control: a norm over this stage's gradients only is not the model's."""
    from tplayers.placement import update_placement

    reference = mlp_stack()
    model = copy.deepcopy(reference)
    stage = tplayers.PipelineStage(model[4 * rank : 4 * rank + 4], rank, 2, group=group)
    for p in stage.parameters():
        update_placement(p, pp_group=None)  # the pipeline group dropped from the record
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    tplayers.ScheduleGPipe(stage, 2, mse).step(x, target=y)
    mse(reference(x), y).backward()
    norm = tplayers.clip_grad_norm_(stage.parameters(), 1e9)
    assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))


def test_negative_control_a_per_stage_norm_fails(pool):
    with pytest.raises(tplayers.RankError, match="Scalars are not close"):
        pool.run(per_stage_norm, 2)


def train_step_drives_a_schedule(rank, pp, group, overflow):
    """train_step with a schedule, the loss scaler and clipping over both stages equals the
    unsharded model's train_step; with an inf on one rank of one stage every rank skips."""
    reference = mlp_stack()
    model = copy.deepcopy(reference)
    stage = tplayers.PipelineStage(model[4 * rank : 4 * rank + 4], rank, 2, group=group)

    def loss_fn(out, y):
        loss = mse(out, y)
        return loss * float("inf") if overflow and step == 1 else loss  # the last stage's rank only

    schedule = tplayers.Schedule1F1B(stage, 4, loss_fn)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2, eps=1e-4)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    scaler, ref_scaler = (tplayers.DynamicLossScaler(init_scale=2.0**8, group=group) for _ in range(2))
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
        before = [p.detach().clone() for p in stage.parameters()]
        result = tplayers.train_step(schedule, opt, [(x, y)], None, scaler=scaler, max_grad_norm=0.05)
        if overflow and step == 1:
            assert result.skipped and all(torch.equal(a, b) for a, b in zip(before, stage.parameters(), strict=True))
            continue
        ref = tplayers.train_step(
            reference, ref_opt, [(x, y)], lambda m, b: mse(m(b[0]), b[1]), scaler=ref_scaler, max_grad_norm=0.05
        )
        assert not result.skipped
        assert_close(torch.tensor(result.loss), torch.tensor(ref.loss))  # on every rank
        assert_close(torch.tensor(result.grad_norm), torch.tensor(ref.grad_norm))
    if not overflow:
        mine = {id(p) for p in stage.parameters()}
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            if id(p) in mine:
                assert_close(p.detach(), q.detach())
    else:
        assert scaler.get_scale() == 2.0**7


@pytest.mark.parametrize("overflow", [False, True], ids=["steps", "overflow-skips-everywhere"])
def test_train_step_drives_a_schedule(pool, overflow):
    pool.run(train_step_drives_a_schedule, 2, overflow)


def pipeline_with_data_parallel(rank, world, group, stage_zero, stage_first=False):
    """PP 2 x DP 2 (4 ranks): each replica's pipeline trains on its half of the batch, the stage
    modules data-parallel over the replicas (ZeRO `stage_zero`); equal to the unsharded model."""
    mesh = tplayers.init_mesh(dp=2, pp=2)
    reference = mlp_stack()
    model = copy.deepcopy(reference)
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    module = model[4 * pp_rank : 4 * pp_rank + 4]
    if stage_first:  # either order: the placement record keeps the pipeline group through FSDP2's DTensors
        stage = tplayers.PipelineStage(module, pp_rank, 2, group=mesh["pp"])
        tplayers.data_parallel(module, group=mesh["dp"], zero_stage=stage_zero)
    else:
        tplayers.data_parallel(module, group=mesh["dp"], zero_stage=stage_zero)
        stage = tplayers.PipelineStage(module, pp_rank, 2, group=mesh["pp"])
    schedule = tplayers.Schedule1F1B(stage, 2, mse)
    opt = tplayers.data_parallel_optimizer(module, torch.optim.AdamW, lr=1e-2, eps=1e-4)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
        mine = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        result = tplayers.train_step(schedule, opt, [mine], None, max_grad_norm=0.05)
        ref = tplayers.train_step(reference, ref_opt, [(x, y)], lambda m, b: mse(m(b[0]), b[1]), max_grad_norm=0.05)
        assert_close(
            torch.tensor(result.grad_norm), torch.tensor(ref.grad_norm), msg=lambda m, s=step: f"norm {s}: {m}"
        )
    for (name, p), q in zip(
        module.named_parameters(), reference[4 * pp_rank : 4 * pp_rank + 4].parameters(), strict=True
    ):
        assert_close(
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach(),
            q.detach(),
            msg=lambda m, n=name: f"{n}: {m}",
        )


@pytest.mark.parametrize("stage_zero", [2, 3])
@pytest.mark.parametrize("stage_first", [False, True], ids=["dp-then-stage", "stage-then-dp"])
def test_pipeline_with_data_parallel_replicas(pool, stage_zero, stage_first):
    pool.run(pipeline_with_data_parallel, 4, stage_zero, stage_first)


def test_pipeline_refuses_ddp_replicas(pool):
    """ZeRO 0-1 (DDP) cannot follow 1F1B's interleaved forwards (its gradients came out 0.1 % off):
    refused on every rank, naming what works."""
    for reply in pool.run(pipeline_with_data_parallel, 4, 0, return_exceptions=True):
        assert isinstance(reply, RemoteError) and "use tplayers.data_parallel(..., zero_stage=2" in reply.message


def disagreeing_stages(rank, pp, group, case):
    model = mlp_stack(layers=4)
    if case == "shape":
        model[2][0] = nn.Linear(5, 6)
    if case == "dtype":
        model[2:].to(torch.float64)
    stage = tplayers.PipelineStage(model[2 * rank : 2 * rank + 2], rank, 2, group=group)
    target = torch.randn(4, 3 if case == "target" else 6)
    tplayers.Schedule1F1B(stage, 2, mse).step(torch.randn(4, 6), target=target)


DISAGREEMENTS = {
    "shape": r"stage 1 \(pipeline rank 1\) cannot take what stage 0 gives it, \(2, 6\) torch.float32: .*5",
    "dtype": r"stage 1 \(pipeline rank 1\) cannot take what stage 0 gives it, \(2, 6\) torch.float32: .*Double",
    "target": r"stage 1 \(pipeline rank 1\) .*size of tensor a \(6\) must match the size of tensor b \(3\)",
}


@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_stages_that_disagree_fail_on_every_rank_before_any_send(pool, case):
    for reply in pool.run(disagreeing_stages, 2, case, return_exceptions=True):
        assert isinstance(reply, RemoteError) and re.search(DISAGREEMENTS[case], reply.message), reply


def new_shapes_each_step(rank, pp, group):
    """The micro-batch shape changes between steps (a last, smaller batch): the stages are
    rebuilt and every step's gradients are still the unsharded model's."""
    reference = mlp_stack(layers=4)
    model = copy.deepcopy(reference)
    stage = tplayers.PipelineStage(model[2 * rank : 2 * rank + 2], rank, 2, group=group)
    schedule = tplayers.Schedule1F1B(stage, 2, mse)
    for rows in (4, 6, 4):
        x, y = torch.randn(rows, 6), torch.randn(rows, 6)  # the same on every rank (the pool seeds them)
        loss = schedule.step(x, target=y)
        ref_loss = mse(reference(x), y)
        ref_loss.backward()
        if rank == 1:
            assert_close(loss, ref_loss.detach())
        for p, q in zip(stage.parameters(), list(reference.parameters())[4 * rank : 4 * rank + 4], strict=True):
            assert_close(p.grad, q.grad)
            p.grad, q.grad = None, None


def test_a_new_micro_batch_shape_rebuilds_the_stages(pool):
    pool.run(new_shapes_each_step, 2)


class DiesOnSecondForward(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.linear, self.how, self.calls = nn.Linear(6, 6), how, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:  # the zero-run check, then the first micro-batch, then this one
            if self.how == "exits":
                import os

                os._exit(3)
            raise RuntimeError("planted failure in stage 1's second micro-batch")
        return self.linear(x)


def dies_mid_schedule(rank, pp, group, how):
    module = nn.Linear(6, 6) if rank == 0 else DiesOnSecondForward(how)
    schedule = tplayers.ScheduleGPipe(tplayers.PipelineStage(module, rank, 2, group=group), 4, mse)
    schedule.step(torch.randn(8, 6), target=torch.randn(8, 6))


@pytest.mark.parametrize("how", ["raises", "exits"])
def test_a_rank_that_dies_mid_schedule_fails_the_others_fast(pool, how):
    import time

    start = time.monotonic()
    with pytest.raises(tplayers.RankError) as err:
        pool.run(dies_mid_schedule, 2, how)
    assert time.monotonic() - start < 20
    expected = "planted failure in stage 1's second micro-batch" if how == "raises" else r"rank 1 died \(exit code 3\)"
    assert re.search(expected, str(err.value)), err.value


def in_flight_as_planned(rank, pp, group, schedule_name, n_microbatches):
    from tplayers.plan import microbatches_in_flight

    schedule_class, virtual = SCHEDULES[schedule_name]
    model = mlp_stack()
    num_stages = pp * virtual
    per = len(model) // num_stages
    stages = [
        tplayers.PipelineStage(model[i * per : (i + 1) * per], i, num_stages, group=group)
        for i in range(rank, num_stages, pp)
    ]
    schedule = schedule_class(stages if virtual > 1 else stages[0], n_microbatches, mse)
    x, y = torch.randn(2 * n_microbatches, 6), torch.randn(2 * n_microbatches, 6)
    with tplayers.pipeline.trace(schedule) as t:
        schedule.step(x, target=y)
    plan_name = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved-1f1b": "interleaved"}[schedule_name]
    assert t.peak_in_flight == microbatches_in_flight(plan_name, rank, pp, n_microbatches, virtual)
    assert t.calls["forward_one_chunk"] == n_microbatches * virtual
    assert 0 < t.compute_seconds < t.step_seconds and 0 < t.bubble < 1


@pytest.mark.parametrize(
    "schedule_name, pp, n_microbatches",
    [("gpipe", 2, 3), ("1f1b", 2, 4), ("1f1b", 4, 8), ("gpipe", 4, 2), ("interleaved-1f1b", 2, 4)],
)
def test_trace_counts_the_activations_in_flight_the_planner_predicts(pool, schedule_name, pp, n_microbatches):
    pool.run(in_flight_as_planned, pp, schedule_name, n_microbatches)


def split_or_refuse(rank, pp, group, family):
    from test_families import tiny_model

    try:
        tplayers.pipeline_split(tiny_model(family), group=group)
    except ValueError as e:
        return str(e)
    return "split"


# Having the decoder's parts is not enough: the stages chained on a probe must give the logits.
SPLIT_FAMILIES = {
    "llama": "split", "qwen2": "split", "qwen3": "split", "olmo": "split", "olmo2": "split", "smollm3": "split",
    "granite": "split",  # its multipliers default to 1 (the probe would catch any other)
    "mixtral": "split", "glm4": "split",
    "gemma": "split",  # its embedding module scales by sqrt(hidden) itself
    "cohere": r"stages do not compute what its forward does \(largest difference",  # logits x logit_scale
    "gemma2": r"uses sliding-window attention",
    "gpt2": r"not a decoder layout tplayers knows \(missing \['embed_tokens'",
    "deepseek_v3": "split",  # MLA and its MoE (shared expert, group-limited routing) across stages
    "gpt_oss": r"uses sliding-window attention", "llama4_text": r"uses sliding-window attention",  # chunked too
}  # fmt: skip


@pytest.mark.parametrize("family", list(SPLIT_FAMILIES))
def test_pipeline_split_checks_it_computes_the_model(pool, family):
    for reply in pool.run(split_or_refuse, 2, family):
        assert re.search(SPLIT_FAMILIES[family], reply), reply


def others_layers_are_freed(rank, pp, group):
    """Once the user drops the model, only this rank's stages keep weights alive: the layers of
    the other stages are garbage (pipeline parallelism divides the weights' memory)."""
    import gc
    import weakref

    model = tiny_llama()
    refs = [weakref.ref(p) for layer in model.model.layers for p in layer.parameters()]
    per_layer = len(refs) // len(model.model.layers)
    stages = tplayers.pipeline_split(model, group=group)
    del model
    gc.collect()
    alive = [i // per_layer for i, ref in enumerate(refs) if ref() is not None]
    held = sorted({i for s in stages for i in s.module.layer_indices})
    assert sorted(set(alive)) == held and len(alive) == per_layer * len(held), (alive, held)


def test_the_layers_of_other_stages_are_freed_with_the_model(pool):
    pool.run(others_layers_are_freed, 2)


# ---- the families that split, composed with TP and ZeRO, through tplayers.testing.check_parallel -----


def family_model(family):
    from test_families import tiny_model

    return tiny_model(family)


def split_after_tp(model, mesh, layout):
    tplayers.parallelize(model, group=mesh["tp"], sequence_parallel=layout.sequence_parallel, verify=False)
    stages = tplayers.pipeline_split(model, group=mesh["pp"])
    for stage in stages if layout.dp > 1 else ():
        tplayers.data_parallel(stage.module, group=mesh["dp"], zero_stage=layout.zero_stage)
    return stages


SPLIT_IDS = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(2))


TIED = {"gemma", "smollm3"}  # tie_word_embeddings by default


@pytest.mark.tplayers
@pytest.mark.parametrize("family", [f for f, said in SPLIT_FAMILIES.items() if said == "split"])
def test_family_pp2_tp2_through_check_parallel(family):
    """Parameters after the split, the mean loss over GPipe's micro-batches, every gradient and
    parameter after two SGD steps, at PP 2 x TP 2 + SP and PP 2 x TP 2 x DP 2 ZeRO-2. Replicas of
    stages with tied embeddings are refused (this check found them silently wrong)."""
    layouts = [Layout(tp=2, pp=2, sequence_parallel=True), Layout(tp=2, pp=2, dp=2, zero_stage=2)]
    build = functools.partial(family_model, family)
    if family not in TIED:
        return check_parallel(build, split_after_tp, SPLIT_IDS, layouts=layouts, steps=2)
    check_parallel(build, split_after_tp, SPLIT_IDS, layouts=layouts[:1], steps=2)
    with pytest.raises(tplayers.distributed.RankError, match="shares parameters with another stage"):
        check_parallel(build, split_after_tp, SPLIT_IDS, layouts=layouts[1:])


def uneven_llama():
    """A vocabulary of 97 and an intermediate size of 67: no split of them is even at TP 2."""
    from test_families import tiny_model

    return tiny_model("llama", vocab=97, ffn=67)


@pytest.mark.tplayers
def test_uneven_splits_in_pipeline_stages_through_check_parallel():
    layouts = [Layout(tp=2, pp=2, sequence_parallel=True), Layout(tp=2, pp=2, dp=2, zero_stage=2)]
    check_parallel(uneven_llama, split_after_tp, SPLIT_IDS, layouts=layouts, steps=2)
