"""Expert parallelism: whole experts over `expert_group`, tokens moved by all-to-all
(`tplayers.nn.ParallelExperts`, `tplayers.functional.dispatch`), composed with data parallelism
(expert weights reduced over their own replicas), ZeRO, clipping and tensor parallelism.

The reference is the unsharded HF model run on each data-parallel rank's micro-batch (its
auxiliary loss per micro-batch, as HF computes it), gradients averaged over the replicas.
"""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tplayers.kernels.grouped_matmul_ref import grouped_matmul_ref, grouped_weight_grad_ref

import tplayers
from tests.test_families import MLA, VARIANTS, VOCAB, tiny_model
from tplayers.hf.state_dict import gather_grads
from tplayers.nn.experts import ParallelExperts
from tplayers.placement import even_sizes, get_placement
from tplayers.testing import assert_close, examples, logits_of
from tplayers.testing.meshes import expert_mesh

pytestmark = pytest.mark.multirank

AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)
# six experts of width 16, top 2 (DeepSeek-V3: two groups of three, the top group only, a shared expert)
MOE = {
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, **AUX),
    "mixtral": dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=16, **AUX),
    "olmoe": dict(num_experts=6, num_experts_per_tok=2, intermediate_size=16, **AUX),
    "deepseek_v3": dict(MLA, n_routed_experts=6, n_group=2, topk_group=1),
    # clamped, interleaved gate / up pairs with biases, a router with a bias, sliding / full layers
    "gpt_oss": dict(VARIANTS["gpt_oss"][1], num_local_experts=6, intermediate_size=16, **AUX),
    # every token fed to every expert, pre-scaled by a sigmoid top-1 score; a shared expert; chunked / NoPE layers
    "llama4_text": dict(VARIANTS["llama4_text"][1], num_local_experts=6, intermediate_size=16, **AUX),
    # w1 / v1 / w2 stacked (E F, H), a LayerNorm block, clipped fused QKV
    "dbrx": dict(VARIANTS["dbrx"][1], ffn_config=dict(moe_num_experts=6, moe_top_k=2, ffn_hidden_size=16)),
    # the router's sparse mixer picks the experts; the experts are the standard ones
    "phimoe": dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=16, **AUX),
}
SWEPT = [f for f in MOE if f != "phimoe"]  # at EP 2 and EP 4; the others in their own cases
MICRO = 2  # sequences per data-parallel rank
STEPS = 3


def batch(step, dp, masked):
    ids = torch.randint(3, VOCAB, (dp * MICRO, 8), generator=torch.Generator().manual_seed(step))
    mask = torch.ones_like(ids)
    if masked:
        mask[:, -3:] = 0  # right padding: every query still sees a key
    return ids, mask


def experts_of(model):
    return [m for m in model.modules() if isinstance(m, ParallelExperts)]


def matches_unsharded(rank, world, _, family, dp, ep, tp, sp, stage, masked):
    g = expert_mesh(dp, ep, 1, tp)
    model = tiny_model(family, **MOE[family])
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=g["tp"], expert_group=g["ep"], sequence_parallel=sp)
    layers = experts_of(model)
    assert layers, family
    n_experts, r = layers[0].num_experts, torch.distributed.get_rank(g["ep"])
    for m in layers:  # whole experts, as evenly as they go
        assert m.local_experts == even_sizes(n_experts, ep)[r]  # the weights: (E_r, ...) or DBRX's (E_r f, H)
        assert all(p.shape[0] in (m.local_experts, m.local_experts * m.local_ffn) for p in m.parameters())
    tplayers.data_parallel(model, group=g["dp"], zero_stage=stage)
    opt = tplayers.data_parallel_optimizer(model, torch.optim.AdamW, lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    me = torch.distributed.get_rank(g["dp"])
    for step in range(STEPS):
        ids, mask = batch(step, dp, masked)
        mine = slice(me * MICRO, (me + 1) * MICRO)
        out = model(ids[mine], attention_mask=mask[mine], labels=ids[mine])
        for r in range(dp):
            part = slice(r * MICRO, (r + 1) * MICRO)
            expected = reference(ids[part], attention_mask=mask[part], labels=ids[part])
            (expected.loss / dp).backward()
            if r == me:
                want = expected.logits
                assert_close(out.loss, expected.loss, msg=lambda m, s=step: f"{family} step {s} loss: {m}")
        out.loss.backward()
        got = logits_of(model, out, ids[mine], attention_mask=mask[mine])  # after backward: ZeRO's units
        assert_close(got, want, msg=lambda m, s=step: f"{family} step {s} logits: {m}")
        if step == 0:  # every gradient: router, experts, shared experts, attention
            grads = gather_grads(model)
            for name, p in reference.named_parameters():
                assert_close(grads[name], p.grad, msg=lambda m, k=name: f"{family} grad {k}: {m}")
        norm = tplayers.clip_grad_norm_(model.parameters(), 0.05)
        assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    full = tplayers.gather_state_dict(model)
    for key, value in reference.state_dict().items():
        assert_close(full[key], value, msg=lambda m, k=key: f"{family} {k} after {STEPS} AdamW steps: {m}")
    return True


# (family, dp, ep, tp, sequence parallel, ZeRO stage, padding mask)
CASES = [
    *[(f, 2, 2, 1, False, 3, False) for f in SWEPT],  # EP 2: three experts each
    *[(f, 4, 4, 1, False, 3, f == "qwen3_moe") for f in SWEPT],  # EP 4: 6 experts as 2, 2, 1, 1
    ("qwen3_moe", 4, 2, 1, False, 0, True),  # EP 2 folded over 4 replicas: experts averaged over 2, DDP
    ("mixtral", 4, 2, 1, False, 1, False),  # ZeRO-1: the optimizer's state over the experts' 2 replicas
    ("mixtral", 2, 2, 2, True, 2, True),  # EP 2 x TP 2 with SP: tokens dispatched without a gather
    ("deepseek_v3", 2, 2, 2, False, 3, True),  # EP 2 x TP 2, shared expert column / row parallel
    ("llama4_text", 2, 2, 2, True, 3, True),  # Llama 4's pre-scaled experts, EP 2 x TP 2 with SP
    ("phimoe", 2, 2, 1, False, 2, False),
]


IDS = [f"{c[0]}-dp{c[1]}-ep{c[2]}-tp{c[3]}{'-sp' if c[4] else ''}-zero{c[5]}" for c in CASES]


@pytest.mark.parametrize("family, dp, ep, tp, sp, stage, masked", CASES, ids=IDS)
def test_expert_parallel_matches_unsharded(tplayers_pool, family, dp, ep, tp, sp, stage, masked):
    tplayers_pool.run(matches_unsharded, dp * tp, family, dp, ep, tp, sp, stage, masked, mesh=("ep", dp, ep, 1, tp))


def routed_away(rank, world, _):
    """Every token routed to experts 0-3 (ranks 0 and 1 of 6 experts over EP 4): ranks 2 and 3
    receive nothing, still join every all-to-all, and get zero gradients."""
    g = expert_mesh(4, 4, 1, 1)
    model = tiny_model("qwen3_moe", **MOE["qwen3_moe"])
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=g["tp"], expert_group=g["ep"])
    for m in (model, reference):
        for block in m.model.layers:
            block.mlp.experts.register_forward_pre_hook(lambda mod, args: (args[0], args[1] % 4, args[2]))
    ids, _ = batch(0, 4, False)
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    with tplayers.count_bytes():
        model(ids[mine], labels=ids[mine]).loss.backward()
    reference(ids[mine], labels=ids[mine]).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "experts" in n}
    assert all(g is not None for g in grads.values()), "an expert without tokens has grad None"
    if rank >= 2:
        assert all(g.abs().sum() == 0 for g in grads.values())
    for name, p in model.named_parameters():  # this rank's own micro-batch: dense gradients are its own
        if "experts" not in name:
            assert_close(p.grad, dict(reference.named_parameters())[name].grad)
    return rank


def test_a_rank_that_receives_no_tokens(tplayers_pool):
    assert tplayers_pool.run(routed_away, 4, mesh=("ep", 4, 4, 1, 1), timeout_s=120) == [0, 1, 2, 3]


def dispatch_bytes(rank, world, _, ep):
    """One step's "ep" bytes equal the formula from the reference routing, each token sent once
    per destination rank other than its own: forward tokens (H fp32), local expert indices (k
    int32) and weights (k fp32) out, results (H) back; backward the same rows the other way
    (results' gradients out, tokens' and weights' gradients back); 8 bytes per rank pair of counts."""
    g = expert_mesh(ep, ep, 1, 1)
    model = tiny_model("qwen3_moe", **MOE["qwen3_moe"])
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=g["tp"], expert_group=g["ep"], verify=False)
    ids, _ = batch(0, ep, False)
    picks = []
    for block in reference.model.layers:
        block.mlp.experts.register_forward_hook(lambda mod, args, out: picks.append(args[1]))
    owner = torch.repeat_interleave(torch.arange(ep), torch.tensor(even_sizes(6, ep)))
    with torch.no_grad():
        sent = {r: 0 for r in range(ep)}
        received = {r: 0 for r in range(ep)}
        for r in range(ep):  # every rank's micro-batch: who sends what to whom
            picks.clear()
            reference(ids[r * MICRO : (r + 1) * MICRO])
            for layer in picks:
                for dest in range(ep):
                    rows = int((owner[layer] == dest).any(1).sum()) if dest != r else 0
                    sent[r] += rows
                    received[dest] += rows
    hidden, k, layers = 32, 2, len(reference.model.layers)
    formula = sent[rank] * (8 * hidden + 8 * k) + received[rank] * (8 * hidden + 4 * k) + layers * 8 * (ep - 1)
    with tplayers.count_bytes() as counted:
        model(ids[rank * MICRO : (rank + 1) * MICRO], labels=ids[rank * MICRO : (rank + 1) * MICRO]).loss.backward()
    return counted.by_axis()["ep"], formula


def test_dispatch_bytes_follow_the_routing(tplayers_pool):
    for counted, formula in tplayers_pool.run(dispatch_bytes, 4, 4, mesh=("ep", 4, 4, 1, 1)):
        assert counted == formula


def refusals(rank, world, _):
    g = expert_mesh(2, 2, 1, 2)
    model = tiny_model("gpt_oss", **MOE["gpt_oss"])
    with pytest.raises(ValueError, match=r"mlp.experts \(GptOssExperts\) cannot be placed whole.*not split over TP"):
        tplayers.parallelize(model, group=g["tp"], expert_group=g["ep"])
    model = tiny_model("mixtral", **MOE["mixtral"])
    experts = model.model.layers[1].mlp.experts

    class Rescaled(type(experts)):  # a forward tplayers does not know: refused, not computed as the standard one
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

    experts.__class__ = Rescaled
    with pytest.raises(ValueError, match=r"layers.1.mlp.experts \(Rescaled\) cannot be placed whole.*not transformers"):
        tplayers.parallelize(model, group=g["tp"], expert_group=g["ep"])
    return True


def test_refusals_name_the_module(tplayers_pool):
    assert all(tplayers_pool.run(refusals, 4, mesh=("ep", 2, 2, 1, 2)))


def test_init_mesh_refuses_ep_that_does_not_divide_dp():
    with pytest.raises(ValueError, match="ep must be a positive int dividing dp"):
        tplayers.init_mesh(dp=4, ep=3)


# ------------------------------------------------------------------------- the grouped GEMM's reference
def naive(x, w, counts, gather, scale, swiglu):
    """Pair by pair, in fp64: the reference's reference."""
    expert = torch.repeat_interleave(torch.arange(len(counts)), counts)
    rows = []
    for p in range(int(counts.sum())):
        y = w[expert[p]].double() @ x[gather[p]].double()
        if swiglu:
            gate, up = y.chunk(2)
            y = torch.nn.functional.silu(gate) * up
        rows.append(y * scale[p].double())
    return torch.stack(rows) if rows else torch.zeros(0, w.shape[1] // (2 if swiglu else 1), dtype=torch.float64)


@settings(max_examples=examples(20), deadline=None)
@given(st.data())
def test_grouped_matmul_ref_matches_pair_by_pair(data):
    experts = data.draw(st.integers(0, 5), label="experts")
    counts = torch.tensor(data.draw(st.lists(st.integers(0, 4), min_size=experts, max_size=experts)), dtype=torch.long)
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    swiglu = data.draw(st.booleans())
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    rows, k, n = 5, 8, 6
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(experts, n, k, generator=gen).to(dtype)
    pairs = int(counts.sum())
    gather = torch.randint(0, rows, (pairs,), generator=gen)
    scale = torch.rand(pairs, generator=gen)
    out = grouped_matmul_ref(x, w, counts, gather=gather, scale=scale, swiglu=swiglu)
    assert_close(out, naive(x, w, counts, gather, scale, swiglu).to(dtype))
    scatter = torch.randperm(pairs + 2, generator=gen)[:pairs]
    spread = grouped_matmul_ref(x, w, counts, gather=gather, scale=scale, swiglu=swiglu, scatter=scatter,
                                out_rows=pairs + 2)  # fmt: skip
    untouched = torch.ones(pairs + 2, dtype=torch.bool).index_fill_(0, scatter, False)
    assert torch.equal(spread[scatter], out) and not spread[untouched].any()  # (a sum's order differs: exact only)
    dy = torch.randn(pairs, n, generator=gen)
    expected = torch.zeros(experts, n, k, dtype=torch.float64)
    for p, e in enumerate(torch.repeat_interleave(torch.arange(experts), counts).tolist()):
        expected[e] += dy[p].double()[:, None] * x[gather[p]].double()[None, :]
    assert_close(grouped_weight_grad_ref(dy, x.float(), counts, gather=gather), expected.float())


def test_negative_control_a_misrouted_pair_fails():
    counts, gather = torch.tensor([2, 1]), torch.tensor([0, 1, 2])
    x, w, scale = torch.randn(3, 4), torch.randn(2, 3, 4), torch.ones(3)
    wrong = grouped_matmul_ref(x, w, torch.tensor([1, 2]), gather=gather, scale=scale)
    with pytest.raises(AssertionError):
        assert_close(wrong, naive(x, w, counts, gather, scale, False).float())


def test_empty_experts_get_zero_gradients_not_none():
    w = torch.randn(3, 4, 2, requires_grad=True)
    x = torch.randn(2, 2, requires_grad=True)
    out = grouped_matmul_ref(x, w, torch.tensor([0, 2, 0]), gather=torch.tensor([1, 0]), scale=torch.ones(2))
    out.sum().backward()
    assert w.grad is not None and w.grad[0].abs().sum() == 0 and w.grad[2].abs().sum() == 0
    none = torch.zeros(0, 4, 2, requires_grad=True)
    grouped_matmul_ref(x[:0], none, torch.zeros(0, dtype=torch.long)).sum().backward()
    assert none.grad is not None


def test_placement_records_the_expert_group(tplayers_pool):
    assert all(tplayers_pool.run(_records, 2, mesh=("ep", 2, 2, 1, 1)))


def _records(rank, world, _):
    g = expert_mesh(2, 2, 1, 1)
    model = tiny_model("mixtral", **MOE["mixtral"])
    tplayers.parallelize(model, group=g["tp"], expert_group=g["ep"], verify=False)
    record = get_placement(model.model.layers[0].mlp.experts.gate_up_proj)
    assert record.ep_group is g["ep"] and g["ep"] in record.reduce_groups()
    assert get_placement(model.model.layers[0].mlp.gate.weight).ep_group is None
    # the record survives tensors put in the slot: a dtype cast, an assign load, a deep copy
    model.to(torch.float64)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    for m in (model, copy.deepcopy(model)):
        assert get_placement(m.model.layers[1].mlp.experts.down_proj).ep_group is g["ep"]
    # DBRX's layer, its weights in a child (`mlp.w1`, ...): the same through .to, an assign load, a deep copy
    dbrx = tiny_model("dbrx", **MOE["dbrx"])
    tplayers.parallelize(dbrx, group=g["tp"], expert_group=g["ep"], verify=False)
    dbrx.to(torch.float64)
    dbrx.load_state_dict({k: v.clone() for k, v in dbrx.state_dict().items()}, assign=True)
    for m in (dbrx, copy.deepcopy(dbrx)):
        record = get_placement(m.transformer.blocks[1].ffn.experts.mlp.w2)
        assert record.ep_group is g["ep"] and record.group is g["tp"]
    return True


# ------------------------------------------------------------------------------------- checkpoints
NO_AUX = dict(MOE["qwen3_moe"], output_router_logits=False)  # the loss then splits over micro-batches exactly


def _checkpoint_run(dp, ep, tp, stage, seed, family="qwen3_moe"):
    """(model, optimizer, this rank's micro-batch index, dp) at a layout; ep = 0: no expert group."""
    torch.manual_seed(seed)
    model = tiny_model(family, **dict(MOE[family], output_router_logits=False))
    if dp * tp > 1:
        g = expert_mesh(dp, max(ep, 1), 1, tp)
        tplayers.parallelize(model, group=g["tp"], expert_group=g["ep"] if ep else None, verify=False)
        if dp > 1:
            tplayers.data_parallel(model, group=g["dp"], zero_stage=stage)
        me = torch.distributed.get_rank(g["dp"])
    else:
        me = 0
    if seed:  # another model's weights: everything must come from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = tplayers.data_parallel_optimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-4)
    return model, opt, me, dp


def _copied(model):
    """gather_state_dict, copied: it returns a replicated parameter itself, which a step changes."""
    return {k: v.detach().clone() for k, v in tplayers.gather_state_dict(model).items()}


def _step(model, opt, me, dp, step):
    ids, _ = batch(10 + step, 4, False)
    part = ids.chunk(dp)[me]
    model(part, labels=part).loss.backward()
    opt.step()
    opt.zero_grad()


def save_at_ep4(rank, world, group, path):
    model, opt, me, dp = _checkpoint_run(4, 4, 1, 3, 0)
    _step(model, opt, me, dp, 0)
    tplayers.save_checkpoint(path, model=model, optimizer=opt, group=group)
    full = _copied(model)
    _step(model, opt, me, dp, 1)
    return full, _copied(model)


def load_and_step(rank, world, group, path, dp, ep, tp, stage):
    model, opt, me, dp = _checkpoint_run(dp, ep, tp, stage, 7)
    tplayers.load_checkpoint(path, model=model, optimizer=opt, group=group)
    loaded = _copied(model)
    _step(model, opt, me, dp, 1)
    return loaded, _copied(model)


# (dp, ep, tp, ZeRO stage): EP 2 with ZeRO-3, TP 2 (the experts split by features), unsharded
LOAD_AT = {"ep2-zero3": (2, 2, 1, 3), "tp2": (1, 0, 2, 0), "unsharded": (1, 0, 1, 0)}


def test_a_checkpoint_saved_at_ep4_loads_at_ep2_tp2_and_unsharded(tplayers_pool, tmp_path):
    """Saved at EP 4 with ZeRO-3 (6 experts as 2, 2, 1, 1, each rank's AdamW state): every other
    layout loads the same weights bitwise, and one more step (its state loaded too) lands where
    the EP 4 run's did."""
    path = str(tmp_path / "ep4")
    saved, stepped = tplayers_pool.run(save_at_ep4, 4, path, mesh=("ep", 4, 4, 1, 1))[0]
    for name, (dp, ep, tp, stage) in LOAD_AT.items():
        mesh = ("ep", dp, max(ep, 1), 1, tp)
        loaded, after = tplayers_pool.run(load_and_step, dp * tp, path, dp, ep, tp, stage, mesh=mesh)[0]
        assert list(loaded) == list(saved), name
        for key, value in saved.items():
            assert_close(loaded[key], value, exact=True, msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
            assert_close(after[key], stepped[key], msg=lambda m, k=key, n=name: f"{n} {k} after a step: {m}")


# ---------------------------------------------------------------------------------------- pipelines
def _next_token_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def pipelined(rank, world, _):
    """PP 2 x (DP 2 folded into EP 2), ZeRO-3 per stage, GPipe over 2 micro-batches: every
    gradient of each stage (this rank's experts' rows) equal to the unsharded model's."""
    from torch.distributed.tensor import DTensor

    g = expert_mesh(2, 2, 2, 1)
    model = tiny_model("qwen3_moe", **NO_AUX)
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=g["tp"], expert_group=g["ep"], verify=False)
    (stage,) = tplayers.pipeline_split(model, group=g["pp"])
    tplayers.data_parallel(stage.module, group=g["dp"], zero_stage=3)
    ids, _ = batch(0, 2, False)
    me = torch.distributed.get_rank(g["dp"])
    loss = tplayers.ScheduleGPipe(stage, 2, _next_token_loss).step(
        ids[me * 2 : me * 2 + 2], target=ids[me * 2 : me * 2 + 2]
    )
    for half in ids.chunk(4):  # 2 replicas x 2 micro-batches
        (_next_token_loss(reference(half).logits, half) / 4).backward()
    expected = dict(reference.named_parameters())
    modules = dict(stage.module.named_modules())
    for name, p in stage.module.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = expected[stage.module.hf_name(name)].grad
        owner = modules[name.rpartition(".")[0]]
        if isinstance(owner, ParallelExperts):
            want = want[owner.first_expert : owner.first_expert + owner.local_experts]
        assert_close(grad, want, msg=lambda m, k=name: f"{k}: {m}")
    return loss is not None


def test_pipeline_stages_with_expert_parallelism(tplayers_pool):
    assert tplayers_pool.run(pipelined, 4, mesh=("ep", 2, 2, 2, 1)) == [False, True, False, True]


# ------------------------------------------------------------------------------------ HF checkpoints
def from_hf_checkpoint(rank, world, group, source, dp, ep, tp):
    """A model built on meta, parallelized with whole experts over EP (and TP), filled from a HF
    directory that stores each expert's projections one by one: each rank reads only its experts'
    rows; the weights then equal the unsharded model's."""
    import transformers as tf

    from tests.test_checkpoint import counting_reads

    g = expert_mesh(dp, ep, 1, tp)
    with counting_reads() as read:
        with tplayers.parameters_on_meta():
            model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(source))
        tplayers.parallelize(model, group=g["tp"], expert_group=g["ep"], verify=False)
        tplayers.load_pretrained(model, source, group=group)
    held = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return read[0], held, tplayers.gather_state_dict(model)


@pytest.mark.parametrize("dp, ep, tp", [(2, 2, 1), (4, 4, 1), (2, 2, 2)], ids=["ep2", "ep4", "ep2-tp2"])
def test_hf_checkpoint_of_per_expert_tensors_loads_only_this_ranks_experts(tplayers_pool, tmp_path, dp, ep, tp):
    reference = tiny_model("qwen3_moe", **MOE["qwen3_moe"])
    reference.save_pretrained(tmp_path / "source")  # transformers writes experts.{e}.gate_proj.weight, ...
    mesh = ("ep", dp, ep, 1, tp)
    for read, held, full in tplayers_pool.run(from_hf_checkpoint, dp * tp, tmp_path / "source", dp, ep, tp, mesh=mesh):
        assert read == held  # exactly the slices this rank holds
        for key, value in reference.state_dict().items():
            assert_close(full[key], value, exact=True, msg=lambda m, k=key: f"{k}: {m}")


def overflow_in_one_ranks_experts(rank, world, _):
    """An inf in rank 1's experts' gradient only: the loss scaler (its extra group only the TP
    group) reads the expert group off the records, so both ranks skip the step."""
    g = expert_mesh(2, 2, 1, 1)
    model = tiny_model("qwen3_moe", **NO_AUX)
    tplayers.parallelize(model, group=g["tp"], expert_group=g["ep"], verify=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = tplayers.DynamicLossScaler(init_scale=4.0, group=g["tp"])
    ids, _ = batch(0, 2, False)
    part = ids[rank * 2 : rank * 2 + 2]
    scaler.scale(model(part, labels=part).loss).backward()
    if rank == 1:
        model.model.layers[0].mlp.experts.down_proj.grad[0, 0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    return all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)), scaler.get_scale()


def test_the_loss_scaler_sees_an_overflow_in_another_ranks_experts(tplayers_pool):
    assert tplayers_pool.run(overflow_in_one_ranks_experts, 2, mesh=("ep", 2, 2, 1, 1)) == [(True, 2.0)] * 2


def _mesh_groups(rank, world):
    mesh = tplayers.init_mesh(dp=4, tp=1, ep=2)
    ranks = {name: torch.distributed.get_process_group_ranks(mesh[name].get_group()) for name in
             ("dp", "ep", "edp", "tp")}  # fmt: skip
    from tplayers.distributed import expert_data_group

    edp = expert_data_group(mesh["dp"].get_group(), mesh["ep"].get_group())
    return ranks, torch.distributed.get_process_group_ranks(edp)


def test_init_mesh_folds_ep_over_the_replicas():
    """dp 4 with ep 2: the expert groups are consecutive replicas, each expert's replicas the ranks
    at the same place in the other expert group; data_parallel finds them from dp and ep (with TP,
    the same per TP rank: the pools' meshes lay them out alike, test_expert_parallel_matches_unsharded)."""
    results = tplayers.launch(_mesh_groups, 4)
    ranks, edp = results[0]
    assert ranks == {"dp": [0, 1, 2, 3], "ep": [0, 1], "edp": [0, 2], "tp": [0]} and edp == [0, 2]
    assert results[3][0] == {"dp": [0, 1, 2, 3], "ep": [2, 3], "edp": [1, 3], "tp": [3]}


def llama4_saved(rank, world, group, path, dp, ep, tp, stage):
    model, opt, me, dp = _checkpoint_run(dp, ep, tp, stage, 0, family="llama4_text")
    _step(model, opt, me, dp, 0)
    tplayers.save_checkpoint(path, model=model, optimizer=opt, group=group)
    return _copied(model)


def llama4_loaded(rank, world, group, path, dp, ep, tp, stage):
    model, opt, me, dp = _checkpoint_run(dp, ep, tp, stage, 7, family="llama4_text")
    tplayers.load_checkpoint(path, model=model, optimizer=opt, group=group)
    return _copied(model)


def test_llama4_experts_checkpoint_in_their_own_layout(tplayers_pool, tmp_path):
    """Llama 4's transposed experts (E, H, 2F) / (E, F, H) at EP 2 x TP 2 with ZeRO-3: gathered under
    HF's names and shapes, saved, and loaded unsharded and at EP 4, bitwise."""
    path = str(tmp_path / "llama4")
    saved = tplayers_pool.run(llama4_saved, 4, path, 2, 2, 2, 3, mesh=("ep", 2, 2, 1, 2))[0]
    reference = tiny_model("llama4_text", **MOE["llama4_text"]).state_dict()
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in reference.items()}
    for dp, ep, tp, stage in ((1, 0, 1, 0), (4, 4, 1, 0)):
        loaded = tplayers_pool.run(llama4_loaded, dp * tp, path, dp, ep, tp, stage, mesh=("ep", dp, max(ep, 1), 1, tp))
        for key, value in saved.items():
            assert_close(
                loaded[0][key], value, exact=True, msg=lambda m, k=key, at=(dp, ep): f"{k} at dp, ep {at}: {m}"
            )
