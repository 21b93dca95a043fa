"""Context parallelism on HF models against the unsharded model: logits, loss and every gradient
(through one SGD step) at CP 2 and 4 and CP 2 x TP 2 + SP, for Llama, Qwen2 with one key/value
head, Mistral and Gemma 2 with sliding windows (Gemma 2 with its softcaps too), gpt-oss with its
attention sinks, packed documents
of unequal lengths (each equal to running it alone) and padding; gradients reduced by the
parameters' own hooks and by `data_parallel` over dp x cp; refusals."""

import copy

import pytest
import torch
import torch.distributed as dist
import transformers

import tplayers
from tplayers.functional import comm
from tplayers.testing import assert_close, logits_of
from tplayers.testing.meshes import context_mesh

pytestmark = pytest.mark.multirank

VOCAB = 61
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1)),  # 1 kv head < cp
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=20.0),
    ),  # fmt: skip
    # attention sinks, sliding / full layers, experts: test_families' gpt-oss
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", "gpt_oss"),
}


def build(family, dtype=torch.float32):
    config_cls, model_cls, extra = FAMILIES[family]
    if isinstance(extra, str):
        from test_families import VARIANTS

        extra = VARIANTS[extra][1]
    config = getattr(transformers, config_cls)(**{**BASE, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).to(dtype).train()


def inputs(batch, seq, docs, padding, seed=3):
    """ids and labels (B, S), with packed documents (position_ids restarting, each document's first
    label -100 as HF's DataCollatorWithFlattening writes it) or a padding mask (right and left)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels, kwargs = ids.clone(), {}
    if docs:
        cuts = sorted(torch.randperm(seq - 2, generator=g)[: docs - 1].add(1).tolist())
        starts = torch.tensor([0, *cuts])
        doc = torch.zeros(seq, dtype=torch.long).index_fill_(0, torch.tensor(cuts, dtype=torch.long), 1).cumsum(0)
        kwargs["position_ids"] = (torch.arange(seq) - starts[doc]).expand(batch, seq).contiguous()
        kwargs["use_cache"] = False  # HF reads packed documents only without a cache
        labels[:, starts] = -100
    if padding:
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, seq - padding :] = 0
        mask[-1, :padding] = 0
        kwargs["attention_mask"] = mask
        labels[mask == 0] = -100
        # the last left-padding query sees no key: its output is undefined (HF's eager averages the
        # hidden keys, sdpa and flash attention give 0, as tplayers does), so nothing is scored on it
        labels[-1, padding] = -100
    return ids, labels, kwargs


def train_once(model, ids, labels, kwargs):
    out = model(ids, labels=labels, **kwargs)
    out.loss.backward()
    return out


def context_matches(rank, world, group, family, mesh, method="auto", sp=False, batch=2, seq=13, docs=0, padding=0,
                    dtype=torch.float32, zero=None, verify=False):  # fmt: skip
    dp, pp, cp, tp = mesh
    groups = context_mesh(*mesh)
    model = build(family, dtype)
    reference = copy.deepcopy(model)
    replica = dist.get_rank(groups["dp"])
    ids, labels, kwargs = inputs(batch, seq, docs, padding, seed=3 + replica)  # each replica its own batch
    tplayers.parallelize(model, group=groups["tp"], context_group=groups["cp"], context=method, sequence_parallel=sp,
                         verify=verify)  # fmt: skip
    if zero is not None:
        tplayers.data_parallel(model, group=groups["dp"], zero_stage=zero)
    with comm.count_bytes() as sent:
        out = train_once(model, ids, labels, kwargs)
    want = train_once(reference, ids, labels, kwargs)
    for other in range(dp):  # the replicas' batches: the gradient is their mean
        if other != replica:
            train_once(reference, *inputs(batch, seq, docs, padding, seed=3 + other))
    for p in reference.parameters():
        p.grad /= dp
    # the reference packs as it should: each document's logits are its own alone (gpt-oss's masks do not
    # read packed documents in transformers 5.24: it attends across them, and so does its CP run)
    if docs and tplayers.hf.context.reads_packed_documents(reference):
        starts = (kwargs["position_ids"][0] == 0).nonzero().flatten().tolist() + [seq]
        with torch.no_grad():
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                alone = reference(ids[:, a:b], use_cache=False).logits
                assert_close(want.logits[:, a:b], alone, msg=lambda m: f"{family} document alone: {m}")
    seen = torch.ones(batch, seq, dtype=torch.bool)
    if padding:  # a query that sees no key (left padding) has no defined output: HF gives it nan or 0
        seen = kwargs["attention_mask"].cumsum(1) > 0
    got = logits_of(model, out, ids, **kwargs)
    assert_close(got[seen], want.logits[seen], msg=lambda m: f"{family} logits: {m}")
    assert_close(out.loss, want.loss, msg=lambda m: f"{family} loss: {m}")
    grads = tplayers.hf.state_dict.gather_grads(model, group=groups["tp"])
    for name, p in reference.named_parameters():
        assert_close(grads[name], p.grad, msg=lambda m, n=name: f"{family} {n}.grad: {m}")
    return sent.by_axis()["cp"]


CASES = [
    # family, (dp, pp, cp, tp), method, sp, docs, padding
    ("llama", (1, 1, 2, 1), "ring", False, 0, 0),
    ("llama", (1, 1, 4, 1), "allgather", False, 0, 0),
    ("llama", (1, 1, 2, 2), "ring", True, 0, 0),
    ("qwen2", (1, 1, 4, 1), "ring", False, 0, 0),
    ("qwen2", (1, 1, 2, 1), "auto", False, 3, 0),
    ("mistral", (1, 1, 2, 1), "ring", False, 0, 3),
    ("mistral", (1, 1, 2, 1), "ulysses", False, 3, 0),
    ("gemma2", (1, 1, 2, 1), "allgather", False, 0, 0),
    ("gemma2", (1, 1, 2, 2), "ring", True, 2, 0),
    ("gpt_oss", (1, 1, 2, 2), "ring", True, 0, 0),  # the sinks cut per head over TP
    ("gpt_oss", (1, 1, 2, 1), "ulysses", False, 2, 0),  # each rank's heads' sinks; documents not read
]


def _case_id(c):
    return (
        f"{c[0]}-cp{c[1][2]}-tp{c[1][3]}-{c[2]}{'-sp' if c[3] else ''}{'-docs' if c[4] else ''}{'-pad' if c[5] else ''}"
    )


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_context_parallel_equals_unsharded(pool, case):
    family, mesh, method, sp, docs, padding = case
    n = mesh[0] * mesh[1] * mesh[2] * mesh[3]
    pool.run(context_matches, n, family, mesh, method, sp, 2, 13, docs, padding, mesh=("cp", *mesh))


WRAPPED = [((1, 1, 2, 1), 0), ((2, 1, 2, 1), 0), ((1, 1, 2, 2), 3), ((2, 1, 2, 1), 2)]


@pytest.mark.parametrize("case", WRAPPED, ids=[f"dp{m[0]}-cp{m[2]}-tp{m[3]}-zero{z}" for m, z in WRAPPED])
def test_data_parallel_reduces_over_dp_and_cp(pool, case):
    """data_parallel over mesh['dp'] reduces over dp x cp (also at dp = 1), at ZeRO 0, 2 and 3:
    the replicas' mean of the unsharded gradients."""
    mesh, zero = case
    n = mesh[0] * mesh[1] * mesh[2] * mesh[3]
    pool.run(context_matches, n, "llama", mesh, "ring", mesh[3] > 1, 2, 12, 0, 0, torch.float32, zero,
             mesh=("cp", *mesh))  # fmt: skip


def test_self_check_runs_through_context_parallelism(pool):
    """parallelize's own check (on by default) passes through the split: CP 2 x TP 2 + SP."""
    pool.run(context_matches, 4, "qwen2", (1, 1, 2, 2), "allgather", True, 2, 12, 0, 0, torch.float32, None, None,
             mesh=("cp", 1, 1, 2, 2))  # fmt: skip


def _saved_bytes(fn, model):
    """Bytes of the distinct activations autograd saves for backward while `fn` runs (the weights
    it saves are not activations: they are the same at any sequence length)."""
    seen, weights = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def memory_per_rank(rank, world, group, seq):
    """Activation bytes saved for backward on each rank at CP = world, against the unsharded model's
    (sdpa, which saves no S x S matrix either), and the ring's bytes per layer."""
    groups = context_mesh(1, 1, world, 1)
    config = transformers.LlamaConfig(**{**BASE, "max_position_embeddings": seq})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    whole, _ = _saved_bytes(lambda: reference(ids, labels=ids).loss, reference)
    tplayers.parallelize(model, group=groups["tp"], context_group=groups["cp"], context="ring", verify=False)
    with comm.count_bytes() as sent:
        mine, _ = _saved_bytes(lambda: model(ids, labels=ids).loss, model)
    layers, kv = config.num_hidden_layers, config.num_key_value_heads * config.head_dim
    ring = 2 * (seq // world) * kv * 4  # one hop's K and V, fp32
    return whole, mine, ring, sent.by_axis()["cp"], layers


@pytest.mark.parametrize("seq", [512, 4096])
def test_activation_memory_shrinks_by_cp(pool, seq):
    for cp in (2, 4):
        for whole, mine, ring, sent, layers in pool.run(memory_per_rank, cp, seq, mesh=("cp", 1, 1, cp, 1)):
            assert mine <= 1.1 * whole / cp + ring, (cp, seq, whole, mine)
            # the forward's K / V hops, cp - 1 per layer, and the loss's all-reduce: the training loss is
            # fused (tplayers.hf.fused_loss), so no logits are computed, nor all-gathered
            loss = round(2 * (cp - 1) / cp * 4)
            assert sent == layers * (cp - 1) * ring + loss, (sent, layers, ring)


def bf16_error(rank, world, group):
    """The bf16 model at CP 2 x TP 2 is no further from the fp64 model than the unsharded bf16 one."""
    groups = context_mesh(1, 1, 2, 2)
    model = build("llama", torch.bfloat16)
    exact, reference = build("llama", torch.float64), copy.deepcopy(model)
    ids, labels, kwargs = inputs(2, 16, 0, 0)
    tplayers.parallelize(model, group=groups["tp"], context_group=groups["cp"], sequence_parallel=True, verify=False)
    outs = [m(ids, labels=labels) for m in (model, reference, exact)]
    for o in outs:
        o.loss.backward()
    errors = {}
    for name, pick in (("logits", lambda o, m: logits_of(m, o, ids, **kwargs)), ("loss", lambda o, m: o.loss)):
        got, want, truth = (pick(o, m).double() for o, m in zip(outs, (model, reference, exact), strict=True))
        errors[name] = ((got - truth).square().mean().sqrt().item(), (want - truth).square().mean().sqrt().item())
    grads = tplayers.hf.state_dict.gather_grads(model, group=groups["tp"])
    for (name, p), (_, e) in zip(reference.named_parameters(), exact.named_parameters(), strict=True):
        truth = e.grad
        errors[name] = ((grads[name].double() - truth).square().mean().sqrt().item(),
                        (p.grad.double() - truth).square().mean().sqrt().item())  # fmt: skip
    return errors


def test_bf16_no_further_from_fp64_than_unsharded(pool):
    errors = pool.run(bf16_error, 4, mesh=("cp", 1, 1, 2, 2))[0]
    worse = {k: v for k, v in errors.items() if v[0] > 1.25 * v[1] + 1e-6}
    assert not worse, worse


def checkpoint_round_trip(rank, world, group, path):
    """Saved at CP 2 x TP 2, loaded without context parallelism at TP 2: CP holds no weight shard."""
    groups = context_mesh(1, 1, 2, 2)
    model = build("llama")
    tplayers.parallelize(model, group=groups["tp"], context_group=groups["cp"], verify=False)
    train_once(model, *inputs(2, 12, 0, 0))
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    tplayers.save_checkpoint(path, model=model)
    saved = tplayers.gather_state_dict(model, group=groups["tp"])
    fresh = tplayers.parallelize(build("llama"), group=groups["tp"], verify=False)
    tplayers.load_checkpoint(path, model=fresh)
    loaded = tplayers.gather_state_dict(fresh, group=groups["tp"])
    assert list(saved) == list(loaded)
    for key, value in saved.items():
        assert torch.equal(value, loaded[key]), key


def test_checkpoint_from_context_parallel_loads_without_it(pool, tmp_path):
    pool.run(checkpoint_round_trip, 4, str(tmp_path / "ckpt"), mesh=("cp", 1, 1, 2, 2))


def refusals(rank, world, group):
    groups = context_mesh(1, 1, 2, 1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(rank))  # differ per rank
    model = tplayers.parallelize(build("llama"), group=groups["tp"], context_group=groups["cp"], verify=False)
    with pytest.raises(ValueError, match="context-parallel ranks .* were given different inputs"):
        model(ids)
    for name in ("past_key_values", "cache"):  # transformers 5.24 names it cache
        with pytest.raises(ValueError, match="KV cache"):
            model(ids[:1], **{name: transformers.DynamicCache(config=model.config)})
    with pytest.raises(ValueError, match="token_type_ids .* is per token"):
        model(ids, token_type_ids=torch.zeros_like(ids))
    for method, match in (("ulysses", "must divide by cp x tp"), ("spiral", "context must")):
        with pytest.raises(ValueError, match=match):
            config = transformers.LlamaConfig(**{**BASE, "num_key_value_heads": 1})
            tplayers.parallelize(transformers.LlamaForCausalLM(config), group=groups["tp"],
                                 context_group=groups["cp"], context=method, verify=False)  # fmt: skip
    hybrid = transformers.Qwen3NextConfig(**{**BASE, "layer_types": ["linear_attention", "full_attention"]},
                                          num_experts=0)  # fmt: skip
    with pytest.raises(ValueError, match="linear-attention"):
        tplayers.parallelize(transformers.Qwen3NextForCausalLM(hybrid), group=groups["tp"],
                             context_group=groups["cp"], verify=False)  # fmt: skip
    return True


def test_refused_with_a_message_on_every_rank(pool):
    assert all(pool.run(refusals, 2, mesh=("cp", 1, 1, 2, 1)))


def tiny_llama():
    return build("llama")


def context_parallel(model, mesh, layout, wrong=False):
    """check_parallel's parallelize: the layout's mesh has a "cp" dim where layout.cp > 1."""
    context = {"context_group": mesh["cp"]} if layout.cp > 1 else {}
    tplayers.parallelize(model, group=mesh["tp"], sequence_parallel=layout.sequence_parallel, verify=False, **context)
    if wrong and layout.cp > 1 and mesh["cp"].get_local_rank() == 1:  # negative control: one CP rank's weight off
        with torch.no_grad():
            model.model.norm.weight.add_(1e-3)
    parts = tplayers.pipeline_split(model, group=mesh["pp"]) if layout.pp > 1 else [model]
    if layout.dp > 1 or layout.cp > 1 and layout.zero_stage:
        for part in parts:
            tplayers.data_parallel(getattr(part, "module", part), group=mesh["dp"], zero_stage=layout.zero_stage)
    return parts if layout.pp > 1 else model


def context_parallel_wrong(model, mesh, layout):
    return context_parallel(model, mesh, layout, wrong=True)


def token_batch(step):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(step))


def test_check_parallel_takes_context_parallel_layouts(pool):
    from tplayers.plan import Layout
    from tplayers.testing import check_parallel

    layouts = [Layout(cp=2), Layout(tp=2, cp=2, sequence_parallel=True), Layout(dp=2, cp=2, zero_stage=2),
               Layout(pp=2, cp=2)]  # fmt: skip
    check_parallel(tiny_llama, context_parallel, token_batch, layouts=layouts, steps=2, pool=pool)
    with pytest.raises(AssertionError, match="check_parallel"):
        check_parallel(tiny_llama, context_parallel_wrong, token_batch, layouts=[Layout(cp=2)], pool=pool)


def split_logits(rank, world, group):
    """context_logits="split": each rank's logits of its own tokens, in local_tokens' order."""
    groups = context_mesh(1, 1, 2, 1)
    model, reference = build("qwen2"), build("qwen2")
    ids, labels, kwargs = inputs(2, 13, 3, 0)
    tplayers.parallelize(model, group=groups["tp"], context_group=groups["cp"], context_logits="split",
                         training_logits=True)  # fmt: skip
    with comm.count_bytes() as sent:
        out = model(ids, labels=labels, **kwargs)
    want = reference(ids, labels=labels, **kwargs)
    tokens = tplayers.hf.context.local_tokens(model)
    real = tokens >= 0
    assert out.logits.shape[:2] == tokens.shape
    assert_close(out.logits[real], want.logits[torch.arange(2)[:, None].expand_as(tokens)[real], tokens[real]])
    assert_close(out.loss, want.loss)
    config = model.config
    ring = 2 * tokens.numel() * config.num_key_value_heads * config.head_dim * 4  # one hop's K / V, fp32
    return sent.by_axis()["cp"], config.num_hidden_layers * ring + 4  # the hops and the loss: no logits


def test_split_logits_stay_local(pool):
    for sent, hops_and_loss in pool.run(split_logits, 2, mesh=("cp", 1, 1, 2, 1)):
        assert sent == hops_and_loss


def lora_under_context(rank, world, group):
    """peft's LoRA, then parallelize with a context group: the adapters' gradients (and the frozen
    base's none) equal the unsharded peft model's; a frozen weight trained later still gets its
    sum over CP."""
    import peft

    groups = context_mesh(1, 1, 2, 1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    model = peft.get_peft_model(build("llama"), config)
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=groups["tp"], context_group=groups["cp"], verify=False)
    ids, labels, kwargs = inputs(2, 12, 0, 0)
    out, want = train_once(model, ids, labels, kwargs), train_once(reference, ids, labels, kwargs)
    assert_close(out.loss, want.loss)
    mine = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        if p.grad is not None:
            assert_close(mine[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
    norm = next(n for n in mine if n.endswith("model.norm.weight"))  # frozen at the first forward
    for m in (model, reference):
        dict(m.named_parameters())[norm].requires_grad_(True)
    train_once(model, ids, labels, kwargs), train_once(reference, ids, labels, kwargs)
    assert_close(mine[norm].grad, dict(reference.named_parameters())[norm].grad)


def test_lora_adapters_under_context_parallelism(pool):
    pool.run(lora_under_context, 2, mesh=("cp", 1, 1, 2, 1))


def driven_like_users(rank, world, group):
    """`.to()`, `load_state_dict(assign=True)` and a deep copy of a CP model: the copy trains like
    the unsharded model (its new parameters get their CP sums too)."""
    groups = context_mesh(1, 1, 2, 1)
    model, reference = build("llama"), build("llama")
    tplayers.parallelize(model, group=groups["tp"], context_group=groups["cp"], verify=False)
    model = model.to(torch.float32)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    clone = copy.deepcopy(model)
    ids, labels, kwargs = inputs(2, 12, 0, 0)
    out, want = train_once(clone, ids, labels, kwargs), train_once(reference, ids, labels, kwargs)
    assert_close(out.loss, want.loss)
    grads = tplayers.hf.state_dict.gather_grads(clone, group=groups["tp"])
    for name, p in reference.named_parameters():
        assert_close(grads[name], p.grad, msg=lambda m, n=name: f"{n}: {m}")


def test_to_assign_load_and_deep_copy(pool):
    pool.run(driven_like_users, 2, mesh=("cp", 1, 1, 2, 1))
