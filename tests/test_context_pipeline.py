"""Context parallelism through pipeline stages (`pipeline_split` of a model parallelized with
`context_group`) against the unsharded model: every loss, clipped norm and weight after AdamW
steps, with the schedules' micro-batches, tied embeddings, a sliding window, one key/value head,
interleaved stages and data parallelism over dp x cp; what is refused."""

import copy

import pytest
import torch
import transformers
from test_pipeline import assert_stage_weights_match, step_both

import tplayers
from tplayers.functional import comm
from tplayers.nn.lm_head import is_deferred
from tplayers.testing.meshes import context_mesh

pytestmark = pytest.mark.multirank

VOCAB = 53
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)  # fmt: skip
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),  # data parallelism
    # one key/value head (fewer than cp) and a window shorter than the sequence
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=1, use_sliding_window=True, sliding_window=5, max_window_layers=0),
    ),  # fmt: skip
}
SCHEDULES = {"1f1b": (tplayers.Schedule1F1B, 1), "interleaved-1f1b": (tplayers.ScheduleInterleaved1F1B, 2)}


def build(family):
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).train()


def next_token_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def pipeline_matches(rank, world, group, family, mesh, schedule_name, seq, zero=None, sp=False, logits="whole",
                     scoring="plain", steps=2):  # fmt: skip
    """pipeline_split of a CP model: `steps` AdamW steps with clipping over the stages equal the
    unsharded model's (each data-parallel replica its own batch: the reference steps on their mean).
    scoring: "plain" (a loss_fn of the logits), "fused" (`tplayers.next_token_loss(model)`: the last
    stage scores its labels without logits) or "logits" (the same with training_logits=True)."""
    dp, pp, cp, tp = mesh
    groups = context_mesh(*mesh)
    schedule_class, virtual = SCHEDULES[schedule_name]
    model = build(family)
    reference = copy.deepcopy(model)
    method = "ring" if logits == "split" else "auto"  # the ring gathers nothing: split logits send none
    tplayers.parallelize(model, group=groups["tp"], context_group=groups["cp"], context=method, sequence_parallel=sp,
                         context_logits=logits, training_logits=scoring == "logits", verify=False)  # fmt: skip
    # split logits: each CP rank scores its own tokens, the loss summed over the group
    loss_fn = next_token_loss if scoring == "plain" else tplayers.next_token_loss(model)
    deferred = []  # whether each forward of the head left its logits to the fused loss
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: deferred.append(is_deferred(out)))
    stages = tplayers.pipeline_split(model, group=groups["pp"], virtual_stages=virtual)
    if zero is not None:
        for stage in stages:
            tplayers.data_parallel(stage.module, group=groups["dp"], zero_stage=zero)
    schedule = schedule_class(stages if virtual > 1 else stages[0], 2 * pp, loss_fn)
    params = list({id(p): p for s in stages for p in s.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-4)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    replica = torch.distributed.get_rank(groups["dp"])
    for step in range(steps):
        batches = [torch.randint(0, VOCAB, (2 * pp, seq), generator=torch.Generator().manual_seed(10 * step + r))
                   for r in range(dp)]  # fmt: skip
        with comm.count_bytes() as sent:
            loss = schedule.forward_backward(batches[replica], batches[replica])
        gathered = batches[0].numel() * VOCAB * 4 * (cp - 1) / cp  # the whole rows' fp32 logits, at least
        if any(s.is_last for s in stages) and logits == "whole" and scoring != "fused":
            assert sent["all_gather"] >= gathered, sent
        if logits == "split" and zero is None:  # no logits all-gathered (FSDP's gathers aside)
            assert sent["all_gather"] == 0, sent
        if scoring == "fused" and zero is None:  # the attention's keys / values only, no logits
            assert sent["all_gather"] < gathered, sent
        if any(s.is_last for s in stages):  # the training forwards (not the shape checks on zeros)
            assert deferred and deferred[-1] == (scoring == "fused"), deferred
        ref_losses = [next_token_loss(reference(ids).logits, ids) for ids in batches]
        step_both(loss, params, opt, reference, ref_opt, ref_losses, replica, step)
    assert_stage_weights_match(model, reference, stages, groups["tp"], steps)


CASES = [
    # family, (dp, pp, cp, tp), schedule, sequence length, zero stage, sequence parallelism[, logits, scoring]
    ("llama", (1, 2, 2, 1), "1f1b", 13, None, False),
    ("qwen2", (1, 2, 2, 1), "interleaved-1f1b", 11, None, False),
    ("llama-untied", (1, 2, 2, 1), "1f1b", 12, 2, False),
    ("llama", (1, 2, 2, 2), "1f1b", 13, None, True),  # each rank holds S / (cp x tp) between stages
    ("llama-untied", (2, 2, 2, 1), "interleaved-1f1b", 9, 3, False),  # gradients over dp x cp
    ("llama", (1, 2, 2, 1), "1f1b", 13, None, False, "split", "logits"),  # each rank's logits stay its own
    # the last stage scores its tokens without logits, whole or split alike
    ("llama", (1, 2, 2, 1), "1f1b", 13, None, False, "whole", "fused"),
    ("llama-untied", (1, 2, 2, 1), "1f1b", 10, 2, False, "split", "fused"),  # ... with the loss scaled by cp
    ("llama-untied", (2, 2, 2, 1), "1f1b", 9, 3, False, "whole", "fused"),  # ZeRO-3 reshards the head
]


def _case_id(c):
    dp, pp, cp, tp = c[1]
    extra = "".join(f"-{x}" for x in c[6:])
    return f"{c[0]}-dp{dp}-pp{pp}-cp{cp}-tp{tp}{'-sp' if c[5] else ''}-{c[2]}-s{c[3]}-zero{c[4]}{extra}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_pipeline_stages_under_context_parallelism_equal_unsharded(pool, tplayers_pool, case):
    family, mesh, schedule_name, seq, zero, sp, *logits = case
    n = mesh[0] * mesh[1] * mesh[2] * mesh[3]
    workers = pool if n <= pool.world_size else tplayers_pool
    workers.run(pipeline_matches, n, family, mesh, schedule_name, seq, zero, sp, *logits, mesh=("cp", *mesh))


def refusals(rank, world, group):
    groups = context_mesh(1, 2, 2, 1)
    model = tplayers.parallelize(build("llama"), group=groups["tp"], context_group=groups["cp"], verify=False)
    stage = tplayers.pipeline_split(model, group=groups["pp"])[0]
    schedule = tplayers.Schedule1F1B(stage, 2, next_token_loss)
    if not stage.is_first:  # run alone, a later stage cannot know the sequence its share comes from
        with pytest.raises(ValueError, match="needs the shape of the micro-batch entering the first stage"):
            stage.module(torch.zeros(2, 7, 32))
    cp_rank = torch.distributed.get_rank(groups["cp"])
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(cp_rank))  # differ over cp
    with pytest.raises(ValueError, match=r"context-parallel ranks \[0, 1\] were given different inputs"):
        schedule.step(ids, target=ids)  # raised on the later stage's ranks too, before anything is sent
    split = tplayers.parallelize(build("llama"), group=groups["tp"], context_group=groups["cp"],
                                 context_logits="split", verify=False)  # fmt: skip
    stage = tplayers.pipeline_split(split, group=groups["pp"])[0]
    schedule = tplayers.Schedule1F1B(stage, 2, next_token_loss)  # a loss of whole rows on split logits
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"stage 1 \(pipeline rank 1\) cannot take what stage 0 gives it"):
        schedule.step(ids, target=ids)
    return True


def test_refused_with_a_message_on_every_rank(pool):
    assert all(pool.run(refusals, 4, mesh=("cp", 1, 2, 2, 1)))
