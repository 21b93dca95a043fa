"""LoRA (peft) on tensor-parallel models: both orders, every projection of Llama, Qwen2, GPT-2
(fused c_attn) and Phi-3 (fused qkv_proj, gate_up_proj), DeepSeek-V3's MLA, Qwen4-Exp's hyper-connection
mixers, TP 2 with and without sequence
parallelism and TP 4, equal to the unsharded peft model: logits, loss, every adapter gradient and
weight after AdamW steps, the base untouched; the adapter exported as peft writes it; ZeRO-3 over
the adapters only; checkpoints across layouts; refusals."""

import sys
from pathlib import Path

import pytest
import torch

import tplayers
from tplayers.hf import gather_grads
from tplayers.hf import lora as tp_lora
from tplayers.testing import assert_close, logits_of
from tplayers.testing.tiny import tiny_config

sys.path.insert(0, str(Path(__file__).parent))
from test_families import VOCAB, tiny_model  # noqa: E402

peft = pytest.importorskip("peft", reason="peft is a test dependency (pip install -e '.[test]')")
pytestmark = pytest.mark.multirank

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {
    "llama": "all-linear",  # peft's shorthand (order 1: on the HF model, where it finds the nn.Linears)
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # c_attn: [q; k; v] in one Conv1D
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # both fused
    # MLA: adapters on the latent (replicated) and per-head (split) projections alike
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    # hyper-connection mixers, stored split and gathered whole (GatheredWeightLinear): their adapters whole
    "qwen4_exp_text": ["input_mix_weight_down", "input_mix_weight_up", "o_proj"],
}
# families built from their own config class (tplayers.testing.tiny_config), not test_families' tiny sizes
OWN_CONFIG = {"qwen4_exp_text"}


def base_model(family):
    if family not in OWN_CONFIG:
        return tiny_model(family)
    import transformers as tf

    cfg = tiny_config(family, heads=8, vocab_size=VOCAB)  # 4 key heads in its linear attention: up to TP 4
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


def lora_config(family, **kwargs):
    """r = 8 on every linear projection (peft_model draws B too, so the adapters count from the
    first forward)."""
    kwargs = dict(r=8, lora_alpha=16, target_modules=TARGETS[family], fan_in_fan_out=family == "gpt2") | kwargs
    return peft.LoraConfig(**kwargs)


def peft_model(family, **kwargs):
    model = base_model(family)
    torch.manual_seed(1)
    out = peft.get_peft_model(model, lora_config(family, **kwargs))
    with torch.no_grad():  # B nonzero: the adapters change the output from the start
        for i, (name, p) in enumerate(out.named_parameters()):
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(i))
    return out


def sharded(family, order, group, sequence_parallel, overlap="auto", **kwargs):
    """The same peft model as `peft_model`, parallelized before (order 2) or after (order 1)."""
    options = dict(group=group, sequence_parallel=sequence_parallel, overlap=overlap)
    if order == 1:
        return tplayers.parallelize(peft_model(family, **kwargs), **options)
    model = tplayers.parallelize(base_model(family), **options)
    torch.manual_seed(1)
    named = dict(target_modules=PROJECTIONS) if TARGETS[family] == "all-linear" else {}
    out = tplayers.get_peft_model(model, lora_config(family, **named, **kwargs))
    reference = peft_model(family, **kwargs)  # the same B values, loaded through the export path
    full = {k: v for k, v in reference.state_dict().items() if "lora_" in k}
    current = tplayers.gather_state_dict(out, group=group)
    tplayers.load_full_state_dict(out, {**current, **full}, group=group)
    return out


IDS = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
STEPS = 2


def train_against_unsharded(rank, world, group, family, order, sequence_parallel, overlap="auto"):
    """2 AdamW steps side by side (the second with the state the first left); every comparison raises
    here, on the rank that sees it."""
    reference = peft_model(family)
    model = sharded(family, order, group, sequence_parallel, overlap)
    base_before = {k: v.clone() for k, v in tplayers.gather_state_dict(model, group=group).items() if "lora_" not in k}
    full = tplayers.gather_state_dict(model, group=group)
    assert list(full) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert_close(full[key], value, exact=True, msg=lambda m, k=key: f"{k}: {m}")
    # Adam divides by the gradient's own size: near eps = 1e-8 a gradient within rounding moves a
    # weight by up to lr; eps = 1e-6 keeps the step inside the tolerance table's bounds
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
            for m in (model, reference)]  # fmt: skip
    for step in range(STEPS):
        out, out_ref = model(input_ids=IDS, labels=IDS), reference(input_ids=IDS, labels=IDS)
        got = logits_of(model, out, input_ids=IDS)
        assert_close(got, out_ref.logits, msg=lambda m, s=step: f"{family} logits, step {s}: {m}")
        assert_close(out.loss, out_ref.loss, msg=lambda m: f"{family} loss: {m}")
        out.loss.backward()
        out_ref.loss.backward()
        grads = gather_grads(model, group=group)
        expected = {k: p.grad for k, p in reference.named_parameters() if p.grad is not None}
        assert set(grads) == set(expected), set(grads) ^ set(expected)  # the adapters', nothing of the base
        for key, value in expected.items():
            assert_close(grads[key], value, msg=lambda m, k=key: f"{k} grad: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = tplayers.gather_state_dict(model, group=group)
    for key, value in reference.state_dict().items():
        assert_close(full[key], value, msg=lambda m, k=key: f"{k} after {STEPS} steps: {m}")
        if key in base_before:
            assert torch.equal(full[key], base_before[key]), key  # the base, bit for bit
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    return True


LAYOUTS = [(2, False), (2, True), (4, False)]


@pytest.mark.parametrize("family", sorted(TARGETS))
@pytest.mark.parametrize(("tp", "sequence_parallel"), LAYOUTS, ids=["tp2", "tp2-sp", "tp4"])
def test_lora_then_parallelize_matches_unsharded_peft(pool, family, tp, sequence_parallel):
    assert all(pool.run(train_against_unsharded, tp, family, 1, sequence_parallel))


@pytest.mark.parametrize("family", sorted(TARGETS))
@pytest.mark.parametrize(("tp", "sequence_parallel"), LAYOUTS[1:], ids=["tp2-sp", "tp4"])
def test_parallelize_then_lora_matches_unsharded_peft(pool, family, tp, sequence_parallel):
    """Order 2 (tplayers.get_peft_model): peft's custom-module registration; Llama's and Qwen2's
    fused ParallelMLP become separate gate / up layers for the adapters."""
    assert all(pool.run(train_against_unsharded, tp, family, 2, sequence_parallel))


@pytest.mark.parametrize("overlap", [True, False], ids=["ring", "plain"])
def test_both_overlap_paths(pool, overlap):
    """The factors take their base's overlap mode: the ring and the plain collectives alike."""
    assert all(pool.run(train_against_unsharded, 2, "llama", 1, True, overlap))


# -- the negative control -------------------------------------------------------------------------
def wrong_rows(rank, world, group):
    """lora_B of every column base holding the next rank's rows of B: the logits must differ."""
    reference = peft_model("llama")
    original = tp_lora._map

    def next_rank(base, dim):
        rows = original(base, dim)
        return (rows + base.out_features // world) % base.out_features if dim == 0 else rows

    tp_lora._map = next_rank
    try:
        model = tplayers.parallelize(peft_model("llama"), group=group, verify=False)
    finally:
        tp_lora._map = original
    with pytest.raises(AssertionError):
        assert_close(model(input_ids=IDS).logits, reference(input_ids=IDS).logits)
    return True


def test_lora_b_holding_the_wrong_rows_fails_the_comparison(pool):
    assert all(pool.run(wrong_rows, 2))


# -- export ---------------------------------------------------------------------------------------
def export(rank, world, group, path):
    """The adapter as peft writes it, then the merged model as transformers writes it."""
    model = tplayers.parallelize(peft_model("llama"), group=group)
    logits = model(input_ids=IDS).logits.detach()
    tplayers.save_pretrained(model, path / "adapter", group=group)
    merged = model.merge_and_unload()
    merged_logits = merged(input_ids=IDS).logits.detach()
    tplayers.save_pretrained(merged, path / "merged", group=group)
    return logits, merged_logits


def test_the_exported_adapter_and_merged_model_load_unsharded(pool, tmp_path):
    """peft.PeftModel.from_pretrained on the unsharded base gives the parallel model's logits;
    the merged export loads in transformers with the same logits."""
    import transformers

    logits, merged_logits = pool.run(export, 2, tmp_path)[0]
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter")
    assert_close(loaded(input_ids=IDS).logits, logits)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert_close(merged(input_ids=IDS).logits, merged_logits)
    assert_close(merged_logits, logits)


# -- the training stack ---------------------------------------------------------------------------
def zero3_state(rank, world, group):
    """TP 2 x DP 2 ZeRO-3 with LoRA, one AdamW step: the optimizer holds state for the adapters'
    shards only, 2 fp32 moments each."""
    mesh = tplayers.init_mesh(dp=2, tp=2)
    model = tplayers.parallelize(peft_model("llama"), group=mesh["tp"])
    tplayers.data_parallel(model, group=mesh["dp"], zero_stage=3)
    opt = tplayers.data_parallel_optimizer(model, torch.optim.AdamW, lr=1e-3)
    tplayers.train_step(model, opt, [IDS], lambda m, ids: m(input_ids=ids, labels=ids).loss)

    def local(t):  # FSDP2's parameters and their optimizer state are DTensors over the replicas
        return t.to_local() if hasattr(t, "to_local") else t

    held = [p for p in opt.state if opt.state[p]]
    state = sum(local(t).numel() * t.element_size() for p in held for t in opt.state[p].values() if t.dim() > 0)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    entries = sum(local(p).numel() for p in adapters)
    frozen = {id(p) for n, p in model.named_parameters() if "lora_" not in n}
    return state, 2 * 4 * entries, any(id(p) in frozen for p in held), len(held) == len(adapters)


def test_zero3_keeps_optimizer_state_for_the_adapters_only(pool):
    for state, expected, any_frozen, all_adapters in pool.run(zero3_state, 4):
        assert state == expected and not any_frozen and all_adapters, (state, expected)


def several_adapters(rank, world, group, sequence_parallel):
    """Two adapters (rsLoRA r 8 with dropout 0.1; r 4), a third added after parallelize,
    set_adapter, training with dropout on, and a global clip over the adapters only: every output
    and gradient equal to the unsharded peft model's (the dropout masks are the unsharded ones:
    each rank draws the whole mask from the shared seed and keeps its part)."""
    models = []
    for sharded_ in (False, True):
        model = peft_model("llama", use_rslora=True, lora_dropout=0.1)
        torch.manual_seed(2)
        model.add_adapter("small", lora_config("llama", r=4))
        if sharded_:
            tplayers.parallelize(model, group=group, sequence_parallel=sequence_parallel)
        torch.manual_seed(3)
        model.add_adapter("late", lora_config("llama", r=2, lora_dropout=0.2))
        models.append(model)
    reference, model = models
    for adapter in ("default", "small", "late"):
        for m in models:
            m.set_adapter(adapter)
            m.eval()
        assert_close(model(input_ids=IDS).logits, reference(input_ids=IDS).logits, msg=lambda m, a=adapter: f"{a}: {m}")
    losses = []
    for m in models:
        m.set_adapter("default")
        m.train()
        torch.manual_seed(4)  # the same dropout masks
        loss = m(input_ids=IDS, labels=IDS).loss
        loss.backward()
        losses.append(loss)
    assert_close(losses[0], losses[1])
    norms = [
        float(tplayers.clip_grad_norm_(model.parameters(), 1.0)),
        float(torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.grad is not None], 1.0)),
    ]
    grads, expected = gather_grads(model, group=group), {k: p.grad for k, p in reference.named_parameters()
                                                          if p.grad is not None}  # fmt: skip
    assert set(grads) == set(expected)
    for key, value in expected.items():
        assert_close(grads[key], value, msg=lambda m, k=key: f"{k} (clipped): {m}")
    return norms


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_several_adapters_dropout_set_adapter_and_clipping(pool, sequence_parallel):
    for parallel, unsharded in pool.run(several_adapters, 2, sequence_parallel):
        assert parallel == pytest.approx(unsharded, rel=1e-5)


def resume_elsewhere(rank, world, group, path, save_tp):
    """Save adapter + AdamW state at TP `save_tp`, load at the other TP size (2 <-> 4), one more
    step on each side of the comparison: equal to the unsharded model trained throughout."""
    reference = peft_model("qwen2")
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    mesh_save = torch.distributed.new_group(list(range(save_tp)))
    if rank < save_tp:
        model = tplayers.parallelize(peft_model("qwen2"), group=mesh_save)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
        tplayers.train_step(model, opt, [IDS], lambda m, ids: m(input_ids=ids, labels=ids).loss)
        tplayers.save_checkpoint(path, model=model, optimizer=opt, group=mesh_save)
    torch.distributed.barrier()
    for _ in range(2):
        reference(input_ids=IDS, labels=IDS).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = tplayers.parallelize(peft_model("qwen2", init_lora_weights=False), group=group)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    tplayers.load_checkpoint(path, model=model, optimizer=opt, group=group)
    tplayers.train_step(model, opt, [IDS], lambda m, ids: m(input_ids=ids, labels=ids).loss)
    full = tplayers.gather_state_dict(model, group=group)
    for key, value in reference.state_dict().items():
        assert_close(full[key], value, msg=lambda m, k=key: f"{k}: {m}")
    return True


def test_adapter_and_optimizer_checkpoint_resume_at_another_layout(pool, tmp_path):
    assert all(pool.run(resume_elsewhere, 4, tmp_path / "ckpt", 2))


# -- refusals -------------------------------------------------------------------------------------
def refused(rank, world, group, kwargs):
    model = tiny_model("llama")
    tplayers.parallelize(peft.get_peft_model(model, peft.LoraConfig(r=4, **kwargs)), group=group)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [(dict(target_modules=["embed_tokens", "q_proj"]), "embed_tokens: peft's Embedding is not supported"),
     (dict(target_modules=["q_proj"], use_dora=True), "q_proj: peft's LoRA variant DoraLinearVariant")],
)  # fmt: skip
def test_what_tplayers_cannot_shard_is_refused_on_every_rank(pool, kwargs, message):
    for reply in pool.run(refused, 2, kwargs, return_exceptions=True):
        assert message in str(reply), reply


def refused_after(rank, world, group):
    model = tplayers.parallelize(tiny_model("llama"), group=group)
    tplayers.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="pissa"))


def test_an_initialization_reading_the_whole_weight_is_refused_after_parallelize(pool):
    for reply in pool.run(refused_after, 2, return_exceptions=True):
        assert "init_lora_weights='pissa' reads the whole base weight" in str(reply), reply


# -- check_parallel -------------------------------------------------------------------------------
def llama_with_adapters():
    return peft_model("llama")


def parallelize_with_adapters(model, mesh, layout):
    tplayers.parallelize(model, group=mesh["tp"], sequence_parallel=layout.sequence_parallel, verify=False)
    return tplayers.data_parallel(model, group=mesh["dp"], zero_stage=layout.zero_stage)


@pytest.mark.tplayers
def test_check_parallel_takes_a_peft_model():
    """Logits, loss, every gradient and parameter (the frozen base's included) after two SGD steps
    at TP 2 + SP x DP 2 with ZeRO-3 and at TP 4 x DP 2 ZeRO-1, against the unsharded peft model."""
    from tplayers.plan import Layout

    tplayers.testing.check_parallel(
        llama_with_adapters, parallelize_with_adapters, IDS, steps=2,
        layouts=[Layout(tp=2, dp=2, zero_stage=3, sequence_parallel=True), Layout(tp=4, dp=2, zero_stage=1)],
    )  # fmt: skip


def refused_names(rank, world, group, targets):
    model = tplayers.parallelize(tiny_model("llama"), group=group)
    tplayers.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))


@pytest.mark.parametrize(
    ("targets", "message"),
    [(["in_proj"], "mlp.in_proj is tplayers' fused MLP layer; target the model's own projections"),
     ("all-linear", "target_modules='all-linear' looks for nn.Linear modules, which parallelize replaced")],
)  # fmt: skip
def test_order_two_refuses_names_it_cannot_honour(pool, targets, message):
    for reply in pool.run(refused_names, 2, targets, return_exceptions=True):
        assert message in str(reply), reply


def scaled_and_clipped(rank, world, group):
    """train_step with a DynamicLossScaler and a global clip on the adapters of a TP 2 + SP
    model, two steps: the same weights as the unsharded peft model clipped alike (a power-of-two
    scale unscales exactly); a third step whose gradient is inf on rank 1 only is skipped on
    every rank, the adapters untouched."""
    reference = peft_model("llama")
    model = tplayers.parallelize(peft_model("llama"), group=group, sequence_parallel=True)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5)
    scaler = tplayers.DynamicLossScaler(init_scale=2.0**10, group=group)
    for _ in range(2):
        tplayers.train_step(model, opt, [IDS], lambda m, ids: m(input_ids=ids, labels=ids).loss, scaler=scaler,
                            max_grad_norm=0.1)  # fmt: skip
        reference(input_ids=IDS, labels=IDS).loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.grad is not None], 0.1)
        ref_opt.step()
        ref_opt.zero_grad()
    full = tplayers.gather_state_dict(model, group=group)
    for key, value in reference.state_dict().items():
        assert_close(full[key], value, msg=lambda m, k=key: f"{k}: {m}")

    def poison(m, ids):
        loss = m(input_ids=ids, labels=ids).loss
        return loss * float("inf") if rank == 1 else loss

    result = tplayers.train_step(model, opt, [IDS], poison, scaler=scaler, max_grad_norm=0.1)
    after = tplayers.gather_state_dict(model, group=group)
    assert all(torch.equal(after[k], full[k]) for k in full) and scaler.last_step_skipped, result
    return True


def test_loss_scaler_and_clipping_over_the_adapters(pool):
    assert all(pool.run(scaled_and_clipped, 2))


def deep_copy_exports_its_own(rank, world, group):
    """A deep copy of a parallelized peft model, trained a step, exports its own weights and
    gradients, and the original keeps its own (a copy's export records are rebuilt over it)."""
    import copy

    model = sharded("qwen2", 1, group, False)
    before = tplayers.gather_state_dict(model, group=group)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in twin.parameters() if p.requires_grad], lr=0.5)
    twin(input_ids=IDS, labels=IDS).loss.backward()
    grads = gather_grads(twin, group=group)
    assert grads and all("lora_" in k for k in grads), sorted(grads)[:3]
    opt.step()
    after = tplayers.gather_state_dict(twin, group=group)
    moved = [k for k in after if "lora_" in k and not torch.equal(after[k], before[k])]
    assert moved, "the copy's export does not show its own step"
    original = tplayers.gather_state_dict(model, group=group)
    assert all(torch.equal(original[k], before[k]) for k in before), "the original changed"


def test_a_deep_copy_of_a_peft_model_exports_its_own_weights(pool):
    pool.run(deep_copy_exports_its_own, 4)  # 2 key/value heads over 4 ranks: lora_B holds shared heads too


# ---- peft's modules_to_save (an LM head or embeddings trained whole, as for added tokens) ----------------------
def saved_modules(rank, world, group, modules):
    """One training step of a peft model with `modules_to_save`, parallelized after peft made the copies:
    the loss, every gradient and the exported state dict (the copies in it) against the unsharded model."""
    from tplayers.hf import gather_grads

    reference, model = (peft_model("llama", modules_to_save=modules) for _ in range(2))
    tplayers.parallelize(model, group=group)
    got, want = model(input_ids=IDS, labels=IDS).loss, reference(input_ids=IDS, labels=IDS).loss
    assert_close(got, want)
    got.backward()
    want.backward()
    grads = gather_grads(model, group=group)
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(expected) and any("modules_to_save" in n for n in expected)
    for name, grad in expected.items():
        assert_close(grads[name], grad, msg=name)
    full = tplayers.gather_state_dict(model, group=group)
    assert list(full) == list(reference.state_dict())
    for name, value in reference.state_dict().items():
        assert torch.equal(full[name], value), name
    with pytest.raises(ValueError, match="modules_to_save=.* would copy modules tplayers already sharded"):
        tplayers.get_peft_model(tplayers.parallelize(base_model("llama"), group=group),
                                lora_config("llama", target_modules=PROJECTIONS, modules_to_save=modules))  # fmt: skip


@pytest.mark.parametrize("modules", [["lm_head"], ["embed_tokens"], ["lm_head", "embed_tokens"]])
def test_modules_to_save_are_kept_whole_and_exported(pool, modules):
    """peft's copies kept whole on every rank, exactly as peft computes them (before: the LM head's were
    refused, "could not place"); added after parallelize, refused by name (the copies of sharded modules
    were trained, but no export knew them: a checkpoint lost them)."""
    pool.run(saved_modules, 2, modules)
