"""`parallelize` on tiny random models of every HuggingFace causal-LM family it knows: logits,
loss, every parameter after one SGD step (through `gather_state_dict`) and greedy `generate()`
equal the unsharded model's; the families it does not know exactly are refused, naming the
module; the self-check (`verify`) catches a wrong shard. transformers 5.x (pyproject pins the
range)."""

import contextlib
import copy
import functools
import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import tplayers
from tplayers.hf import attention, families
from tplayers.plan import Layout
from tplayers.testing import (
    RemoteError,
    assert_close,
    assert_close_or_rounding,
    check_parallel,
    differing_grads,
    examples,
    grads_as_state_dict,
    hooks_holding_state,
)
from tplayers.testing import strategies as tst

pytestmark = pytest.mark.multirank

VOCAB = 96
EXACT = ["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3",
         "gpt2", "gptj", "gpt_neox", "gpt_bigcode", "gpt_bigcode-mha", "falcon", "falcon-new", "falcon-alibi", "opt",
         "bloom", "stablelm", "starcoder2", "olmo", "olmo2", "cohere", "granite", "smollm3", "glm4", "codegen",
         "mpt", "nemotron", "exaone4", "arcee", "deepseek_v3", "deepseek_v2-lite", "gpt_oss", "llama4_text", "dbrx",
         "phimoe", "bitnet", "gemma3n_text", "gemma3n_text-sparse",
         # gated attention: an output gate per head element (AFMoE, HRM) or per head (Laguna), split with the heads
         "afmoe", "laguna", "laguna-elementwise", "hrm_text",
         # an embedding scaled by a number after the lookup
         "biogpt", "xglm",
         # differential attention: query heads paired across the halves, key/value groups straddling ranks
         "diffllama",
         # a mixture of attention heads: query experts split by key/value heads (5: 3, 2 / 2, 2, 1 / 2, 1, 1, 1)
         "jetmoe",
         # a dynamic mask per key/value head from every head's values: 6 heads over 3 key/value heads straddle at
         # TP 2 and 4; a window of 4 keys of 8, so its top-k masks
         "doge",
         # RWKV (v4): time mixing by channel, channel mixing by features; weights rescaled per layer in eval mode
         "rwkv",
         # nGPT's unit-norm attention and MLP: per-channel scales split with the heads / features, L2 norms over them
         "dory",
         # per-head [q, k, v] query_key_value with q / k LayerNorms over each head's features
         "persimmon"]  # fmt: skip
# Multi-head latent attention: a query latent of 16, a key/value latent of 12, heads of [8 | 4 rope] for q and k
# and 6 for v; the rotary width is head_dim, one key/value head per query head (the latents expand to every head)
MLA = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6, head_dim=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)  # fmt: skip
LAGUNA = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
# Variants: (model type, config overrides) for a family's other layouts.
VARIANTS = {
    "gpt_bigcode-mha": ("gpt_bigcode", dict(multi_query=False)),  # per-head [q, k, v] c_attn
    "falcon-new": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),  # key/value groups
    "falcon-alibi": ("falcon", dict(alibi=True)),  # multi-query with ALiBi
    # MoE defaults of 60-256 experts of 512-1408 (9-17M parameters; up to 4 GB a rank at ZeRO-3 with
    # their transient copies, which glibc keeps as RSS in the pool's workers: 4 ranks were killed for
    # memory once): 8 experts of 16
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=32)),
    "afmoe": ("afmoe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)),
    "laguna": ("laguna", LAGUNA),
    "laguna-elementwise": ("laguna", dict(LAGUNA, gating=False)),  # one gate per head element, not per head
    # CodeGen's qkv_proj holds 4 blocks of heads: 16 heads go over 4 ranks
    "codegen": ("codegen", dict(num_attention_heads=16, hidden_size=64, rotary_dim=4, head_dim=4)),
    "deepseek_v3": ("deepseek_v3", MLA),  # MLA with a query latent, interleaved rope, a shared expert, top-k groups
    "deepseek_v2-lite": ("deepseek_v2", dict(MLA, q_lora_rank=None)),  # V2-Lite: queries without a latent
    # experts transposed with interleaved gate / up pairs and biases, attention sinks, sliding / full layers
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),  # fmt: skip
    # transposed experts fed expert by expert, a shared expert, sigmoid top-1 router, chunked and NoPE layers
    "llama4_text": (
        "llama4_text",
        dict(
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size_mlp=48,
            interleave_moe_layer_step=1,
            attention_chunk_size=4,
            no_rope_layers=[1, 0],
        ),
    ),
    # fused Wqkv with clip_qkv, experts stacked (E * F, H), the router as router.layer
    "dbrx": (
        "dbrx",
        dict(
            d_model=32,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=10000.0),
            ffn_config=dict(moe_num_experts=4, moe_top_k=2, ffn_hidden_size=24),
        ),
    ),  # fmt: skip
    "phimoe": ("phimoe", dict(num_local_experts=4, num_experts_per_tok=2)),  # the router as mlp.router
    # 6 pairs of query heads over 4 key/value heads: 3, 3 pairs at TP 2; 2, 2, 2 and 2, 2, 1, 1 straddle a group
    "diffllama": ("diffllama", dict(num_attention_heads=12, num_key_value_heads=4)),
    "doge": ("doge", dict(num_attention_heads=6, num_key_value_heads=3, attention_bias=True, keep_window_size=4)),
    # transformers' own RWKV cannot backpropagate through its cache (it updates the states in place):
    # its cached generate() is in test_newcomers' ADAPTED
    "rwkv": ("rwkv", dict(rescale_every=1, use_cache=False)),
    "doge-cdmoe": (
        "doge",
        dict(num_attention_heads=6, num_key_value_heads=3, is_moe=True, num_experts=16, num_experts_per_tok=2),
    ),  # fmt: skip
    "jetmoe": ("jetmoe", dict(num_key_value_heads=5, kv_channels=8, num_local_experts=4, num_experts_per_tok=2)),
    # per-layer inputs on the residual stream (their own vocabulary, tiny here: the default is 262144 x 2 x 256)
    "gemma4_text": ("gemma4_text", dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)),
    # AltUp, LAuReL and per-layer inputs on the residual stream
    "gemma3n_text": (
        "gemma3n_text",
        dict(
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
            laurel_rank=4,
            altup_num_inputs=2,
            num_kv_shared_layers=0,
            activation_sparsity_pattern=[0.0, 0.0],
            intermediate_size=[64, 64],
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),  # fmt: skip
}
# Gemma 3n's published activation sparsity (0.95 on its first layers): the Gaussian top-k's statistics
# over the whole intermediate width, summed over the ranks
VARIANTS["gemma3n_text-sparse"] = (
    "gemma3n_text", dict(VARIANTS["gemma3n_text"][1], activation_sparsity_pattern=[0.95, 0.0])
)  # fmt: skip
# Not known exactly: each is refused with the module that stops it (see the README's table).
REFUSED = {
    # Doge's cross-domain MoE: product-key experts beside a gated MLP, routing that mixes tokens across the batch
    "doge-cdmoe": r"router_gate\.weight .* is a parameter of DogeCDMoE",
}
SP_REFUSED = {
    "hrm_text": r"blocks are in 2 lists \(model.L_module.layers, model.H_module.layers\)",  # its H and L modules
}

# Every family at every TP size here: none refused for its shapes.
TP_REFUSED: dict = {}


def tiny_model(family, dtype=torch.float32, vocab=None, ffn=None, **config):
    """A 2-layer random model: hidden 32, 4 query heads of 8, 2 key/value heads, no dropout
    (`vocab`, `ffn`: another vocabulary size than VOCAB, another intermediate size than 64)."""
    import transformers as tf

    torch.manual_seed(0)
    family, overrides = VARIANTS.get(family, (family, {}))
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, head_dim=8, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)  # fmt: skip
    if family in ("gptj", "codegen"):
        kw["rotary_dim"] = 4
    kw.update(overrides)
    if vocab is not None:
        kw["vocab_size"] = vocab
    if ffn is not None:
        kw.update(intermediate_size=ffn, ffn_dim=ffn, n_inner=ffn)  # the families' names for it
    kw.update(config)
    if family == "falcon":
        kw.pop("head_dim")  # a read-only property there
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.AutoConfig.for_model(family, **kw)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout", "attention_dropout", "dropout"):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        if family.startswith("doge"):  # A starts at 0, making every head's mask exp(0): each head its own mask
            for layer in model.model.layers:
                layer.self_attn.A.normal_()
        if family == "rwkv":  # embeddings of 1e-4 (RWKV's init) under a LayerNorm scale every gradient's
            model.rwkv.embeddings.weight.normal_()  # fp32 rounding before it by 1e4, past the table's atol
    return model.to(dtype).eval()


def matches_unsharded(
    rank, tp, group, family, sequence_parallel, dtype, vocab=None, ffn=None, config=None, lr=0.5, length=None
):
    model = tiny_model(family, dtype, vocab, ffn, **(config or {}))
    reference, pristine = copy.deepcopy(model), copy.deepcopy(model)  # pristine: the fp64 arbiter's start
    tplayers.parallelize(model, group=group, sequence_parallel=sequence_parallel)  # verify on by default
    assert not hooks_holding_state(model), hooks_holding_state(model)  # a deep copy of the model is its own
    full = tplayers.gather_state_dict(model, group=group)  # the state dict round-trips exactly
    assert list(full) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert_close(full[key], value, exact=True, msg=lambda m, k=key: f"{family} {k}: {m}")

    # under sequence parallelism 7 tokens: the ranks' parts of the sequence differ (4 and 3 at TP 2)
    length = length or (7 if sequence_parallel else 8)
    ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    out, out_ref = model(ids, labels=ids), reference(ids, labels=ids)
    # compared at the model's precision (HF computes the loss, and some models the logits, in fp32)
    assert_close(out.logits.to(dtype), out_ref.logits.to(dtype), msg=lambda m: f"{family} logits: {m}")
    assert_close(out.loss.to(dtype), out_ref.loss.to(dtype), msg=lambda m: f"{family} loss: {m}")
    for m, loss in ((model, out.loss), (reference, out_ref.loss)):
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        loss.backward()
        opt.step()
    after, truth = tplayers.gather_state_dict(model, group=group), None
    for key, value in reference.state_dict().items():  # every parameter after the step: every gradient
        msg = lambda m, k=key: f"{family} {k} after one step: {m}"  # noqa: E731
        try:
            assert_close(after[key], value, msg=msg)
        except AssertionError:  # past the table: fp32 rounding the model amplifies, or wrong
            truth = truth or _fp64_step(pristine, ids, lr)
            assert_close_or_rounding(after[key], value, truth[key], msg=msg)
    if not sequence_parallel:  # greedy decoding with the KV cache holding local heads
        prompt = ids[:, :3]
        with torch.no_grad():
            tokens = model.generate(prompt, max_new_tokens=5, do_sample=False)
            assert torch.equal(tokens, reference.generate(prompt, max_new_tokens=5, do_sample=False)), family


def _fp64_step(model, ids, lr):
    """The state dict after matches_unsharded's step taken in fp64: the truth fp32 rounding is judged by."""
    model = model.double()
    model(ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return model.state_dict()


@pytest.mark.parametrize("family", EXACT)
@pytest.mark.parametrize("tp, sequence_parallel", [(2, True), (3, False), (4, False)], ids=["tp2-sp", "tp3", "tp4"])
def test_family_matches_unsharded(pool, family, tp, sequence_parallel):
    """4 query heads and 2 key/value heads over 2, 3 (2, 1, 1 heads) and 4 ranks."""
    refusal = SP_REFUSED.get(family) if sequence_parallel else TP_REFUSED.get((family, tp))
    if refusal:
        for reply in pool.run(matches_unsharded, tp, family, sequence_parallel, torch.float32, return_exceptions=True):
            assert isinstance(reply, RemoteError) and re.search(refusal, reply.message), reply
        return
    pool.run(matches_unsharded, tp, family, sequence_parallel, torch.float32)


# The 2026 layouts (issue 35) also at TP 4 with sequence parallelism (Gemma 3n refuses it by name)
NEW_2026 = ["deepseek_v3", "deepseek_v2-lite", "gpt_oss", "llama4_text", "dbrx", "phimoe", "bitnet"]


@pytest.mark.parametrize("family", NEW_2026)
def test_2026_layouts_at_tp4_with_sequence_parallelism(pool, family):
    pool.run(matches_unsharded, 4, family, True, torch.float32)


# Gemma 4's published layouts beside its per-layer inputs: the last layers reading an earlier layer's keys and values
# (E2B / E4B), global layers whose keys are their values too with their own head count and size, and an MoE block
# beside the dense MLP with a router that scales its input and weights (26B-A4B)
GEMMA4_LAYOUTS = {
    "per-layer-inputs": {},
    "kv-sharing": dict(num_hidden_layers=4, num_kv_shared_layers=2,
                       layer_types=["sliding_attention", "full_attention"] * 2),
    "keys-as-values-moe": dict(attention_k_eq_v=True, num_global_key_value_heads=1, global_head_dim=16,
                               enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
}  # fmt: skip


@pytest.mark.parametrize("layout", GEMMA4_LAYOUTS)
@pytest.mark.parametrize("tp, sequence_parallel", [(2, True), (3, False)], ids=["tp2-sp", "tp3"])
def test_gemma4_text_layouts(pool, layout, tp, sequence_parallel):
    """Gemma 4 text: per-layer inputs kept whole on the residual stream and, under sequence parallelism,
    cut to each rank's tokens with the hidden states; a layer sharing another's keys and values splits its
    query heads as that layer does. The step is 0.1 x the gradient, not 0.5 x: at random init its
    embedding gradient carries fp32 rounding of 1e-5 on values of 1 (the unsharded model's own fp32
    gradient is 6e-6 from its fp64 one; attention without 1/sqrt(d) over normed q / k amplifies it), and
    the weights after a 0.5 x step differ by that rounding at the edge of the tolerance table's atol.
    KV sharing runs 8 tokens: at 7 the first draw of ids puts its rounding at 9.9x the unsharded model's
    own from fp64 (past the arbiter's 4x; 8 draws: 1.5-9.9x, the same at TP 2 without sequence
    parallelism: rounding, not the split, which the other layouts run uneven)."""
    length = 8 if layout == "kv-sharing" else None
    pool.run(matches_unsharded, tp, "gemma4_text", sequence_parallel, torch.float32, None, None,
             GEMMA4_LAYOUTS[layout], 0.1, length)  # fmt: skip


def hidden_states_under_sp(rank, tp, group, family):
    import transformers as tf

    from tplayers.testing import tiny_config

    # Qwen4-Exp from its own config class shrunk (tiny_model's hyper-connection mixers hold 52M weights)
    own = family == "qwen4_exp_text"
    model = tf.AutoModelForCausalLM.from_config(tiny_config(family)) if own else tiny_model(family)
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=group, sequence_parallel=True)
    ids = torch.randint(3, 96, (2, 4 * tp), generator=torch.Generator().manual_seed(1))
    ours, theirs = (m(ids, output_hidden_states=True, use_cache=False).hidden_states for m in (model, reference))
    assert [h.shape for h in ours] == [h.shape for h in theirs], family
    for h, expected in zip(ours, theirs, strict=True):
        assert_close(h, expected, msg=lambda m: f"{family} hidden states: {m}")


@pytest.mark.parametrize("family", ["llama", "gemma3n_text", "qwen4_exp_text"])
def test_hidden_states_come_back_whole_under_sequence_parallelism(pool, family):
    """output_hidden_states=True under SP: every block's output over the whole sequence, as unsharded,
    whatever its layout: (batch, sequence, hidden), Gemma 3n's stacked AltUp states (streams, batch,
    sequence, hidden), hyper-connections' (batch, sequence, streams, hidden)."""
    pool.run(hidden_states_under_sp, 2, family)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "opt"])
def test_family_tp2_plain(pool, family):
    pool.run(matches_unsharded, 2, family, False, torch.float32)


# GPT-2's 50257 in small: 97 splits [49, 48] at TP 2 and [25, 25, 25, 22] at TP 4, as torch.chunk
# does; an intermediate size of 67: [34, 33] and [17, 17, 17, 16] (SiLU MLPs in whole gate / up pairs)
UNEVEN = [(f, 2, True) for f in ("llama", "gpt2", "opt", "gpt_neox", "gemma", "phi3")]
UNEVEN += [(f, 4, False) for f in ("llama", "gpt2", "opt", "gpt_neox", "gemma", "phi3")]


@pytest.mark.parametrize("family, tp, sequence_parallel", UNEVEN, ids=[f"{f}-tp{t}{'-sp' * s}" for f, t, s in UNEVEN])
def test_widths_that_do_not_divide(pool, family, tp, sequence_parallel):
    """Logits, loss, every parameter after a step, generate() and the state-dict round trip."""
    pool.run(matches_unsharded, tp, family, sequence_parallel, torch.float32, 97, 67)


# Published head counts in small (head width 8): SmolLM2-135M 9 heads / 3 key/value, Qwen2.5-0.5B
# 14 / 2, Qwen2-7B 28 / 4
HEADS = {"smollm2": ("llama", 9, 3), "qwen2.5-0.5b": ("qwen2", 14, 2), "qwen2-7b": ("qwen2", 28, 4)}
HEAD_CASES = [("smollm2", 2, True), ("smollm2", 4, False), ("qwen2.5-0.5b", 4, True), ("qwen2.5-0.5b", 3, False),
              ("qwen2-7b", 3, False)]  # fmt: skip


def heads_config(shape):
    family, heads, kv_heads = HEADS[shape]
    return family, dict(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, hidden_size=8 * heads)


@pytest.mark.parametrize(
    "shape, tp, sequence_parallel", HEAD_CASES, ids=[f"{m}-tp{t}{'-sp' * s}" for m, t, s in HEAD_CASES]
)
def test_heads_that_do_not_divide(pool, shape, tp, sequence_parallel):
    """Whole heads per rank as evenly as they go (9 over 2: 5, 4; 9 over 4: 3, 2, 2, 2; 14 over 4:
    4, 4, 3, 3; 28 over 3: 10, 9, 9), each rank's key/value heads those its queries read, also where they
    straddle two groups: logits, loss, every parameter after a step, generate(), the state dict."""
    family, config = heads_config(shape)
    pool.run(matches_unsharded, tp, family, sequence_parallel, torch.float32, None, None, config)


def test_fewer_heads_than_ranks_are_refused_naming_the_way_out(pool):
    family, config = heads_config("smollm2")  # 9 heads over 4 ranks split 3, 2, 2, 2: fine; 2 over 3 is not
    config.update(num_attention_heads=2, num_key_value_heads=1, hidden_size=16)
    for reply in pool.run(matches_unsharded, 3, family, False, torch.float32, None, None, config,
                          return_exceptions=True):  # fmt: skip
        assert isinstance(reply, RemoteError), reply
        assert re.search(r"2 attention heads over 3 ranks leave 1 ranks without a head.*use at most 2 ranks",
                         reply.message), reply  # fmt: skip


def experts_sharded(rank, tp, group, family):
    model = tiny_model(family)
    full = {n: p.numel() for n, p in model.named_parameters() if "experts" in n}
    tplayers.parallelize(model, group=group)
    local = {n: p.numel() for n, p in model.named_parameters() if "experts" in n}
    assert full and local.keys() == full.keys()
    assert all(local[n] * tp == full[n] for n in full), (local, full)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_experts_hold_one_nth_per_rank(pool, family):
    pool.run(experts_sharded, 2, family)


@pytest.mark.parametrize("family", ["gemma", "gpt_neox", "mixtral"])
def test_bf16_matches_unsharded(pool, family):
    """bf16 weights: logits, loss and every parameter after one step within the bf16 tolerance."""
    pool.run(matches_unsharded, 2, family, True, torch.bfloat16)


def refused(rank, tp, group, family):
    tplayers.parallelize(tiny_model(family), group=group)


@pytest.mark.parametrize("family", list(REFUSED))
def test_unknown_layouts_are_refused_on_every_rank(pool, family):
    for reply in pool.run(refused, 2, family, return_exceptions=True):
        assert isinstance(reply, RemoteError) and re.search(REFUSED[family], reply.message), reply


@pytest.mark.parametrize("family", ["gemma", "opt", "gptj"])
def test_four_heads_over_three_ranks(pool, family):
    """4 heads over 3 ranks: 2, 1, 1 (torch.chunk's 2, 2 and none would leave a rank no head)."""
    pool.run(matches_unsharded, 3, family, False, torch.float32)


# -- negative controls ------------------------------------------------------------------------
@contextlib.contextmanager
def kv_swapped(under=""):
    """The attention adapter puts k's rows where v's go, in attention modules under `under`: a wrong
    shard that the self-check and the comparison helpers must catch."""
    original = attention.qkvo_attention

    def wrong(sp, name, attn):
        if name.startswith(under):
            attn.k_proj, attn.v_proj = attn.v_proj, attn.k_proj
        original(sp, name, attn)

    adapters = tuple(
        families.Adapter(a.name, a.matches, wrong) if a.apply is original else a for a in families.ADAPTERS
    )
    families.ADAPTERS, saved = adapters, families.ADAPTERS
    try:
        yield
    finally:
        families.ADAPTERS = saved


def swapped_kv_adapter(rank, tp, group, verify):
    """An adapter that puts k's rows where v's go: verify must catch it (and without verify, the
    comparison helper must)."""
    with kv_swapped():
        model = tiny_model("llama")
        reference = copy.deepcopy(model)
        tplayers.parallelize(model, group=group, verify=verify)
        ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
        with pytest.raises(AssertionError):
            assert_close(model(ids).logits, reference(ids).logits)


def test_negative_control_verify_catches_a_wrong_shard(pool):
    for reply in pool.run(swapped_kv_adapter, 2, None, return_exceptions=True):
        assert isinstance(reply, RemoteError) and reply.type_name == "VerifyError", reply
        assert "logits differ from the unsharded model's" in reply.message


def test_negative_control_wrong_shard_fails_the_comparison(pool):
    pool.run(swapped_kv_adapter, 2, False)


class DoubledEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2


class NoisyLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) + 1


def subclass_refused(rank, tp, group, which):
    model = tiny_model("llama")
    if which == "embedding":
        old = model.model.embed_tokens
        model.model.embed_tokens = DoubledEmbedding(old.num_embeddings, old.embedding_dim)
    else:
        old = model.model.layers[0].mlp.up_proj
        model.model.layers[0].mlp.up_proj = NoisyLinear(old.in_features, old.out_features, bias=False)
    tplayers.parallelize(model, group=group)


@pytest.mark.parametrize(
    "which, message",
    [
        ("embedding", r"model.embed_tokens is a DoubledEmbedding whose forward tplayers does not know"),
        ("linear", r"NoisyLinear overrides Linear.forward"),
    ],
)
def test_subclass_with_its_own_forward_is_refused(pool, which, message):
    for reply in pool.run(subclass_refused, 2, which, return_exceptions=True):
        assert isinstance(reply, RemoteError) and re.search(message, reply.message), reply


def verify_modes(rank, tp, group):
    model = tiny_model("llama").to("meta")
    tplayers.parallelize(model, group=group)  # default: no check on meta weights
    with pytest.raises(ValueError, match="meta device"):
        tplayers.parallelize(tiny_model("llama").to("meta"), group=group, verify=True)
    model = tiny_model("gpt2")
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    tplayers.parallelize(model, group=group, verify=ids)  # a user's own input
    model = tiny_model("gpt2", max_position_embeddings=4)  # the probe batch: 4 tokens per rank
    model.config.n_positions = 64  # the config promises more positions than the table holds
    with pytest.raises(ValueError, match=r"unsharded GPT2LMHeadModel \(gpt2\) fails a forward on the probe batch.*"
                       r"pass verify=<ids it takes> or verify=False"):  # fmt: skip
        tplayers.parallelize(model, group=group)


def test_verify_modes(pool):
    pool.run(verify_modes, 2)


class UnknownMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(32, 32)

    def forward(self, x):
        return self.w1(x).relu()


def unknown_module_with_hf_plan(rank, tp, group):
    model = tiny_model("llama")
    model.model.layers[0].mlp = UnknownMLP()
    model.config.base_model_tp_plan = {"layers.*.mlp.w1": "colwise"}
    tplayers.parallelize(model, group=group)


def test_refusal_quotes_hf_tp_plan_as_a_hint(pool):
    for reply in pool.run(unknown_module_with_hf_plan, 2, return_exceptions=True):
        assert isinstance(reply, RemoteError), reply
        assert re.search(r"could not place \['model.layers.0.mlp.w1'\].*HF's base_model_tp_plan, a hint", reply.message)
        assert "{'model.layers.0.mlp.w1': 'colwise'}" in reply.message


# ---- every family composed with ZeRO-3 and SP, through tplayers.testing.check_parallel -------------


def uneven_gpt2():
    """GPT-2 (Conv1D, tied head) with a vocabulary of 97 and an MLP of 67: no even split at TP 2."""
    return tiny_model("gpt2", vocab=97, ffn=67)


FAMILY_IDS = torch.randint(3, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))


def family_parallelize(model, mesh, layout):
    tplayers.parallelize(model, group=mesh["tp"], sequence_parallel=layout.sequence_parallel, verify=False)
    return tplayers.data_parallel(model, group=mesh["dp"], zero_stage=layout.zero_stage)


@pytest.mark.tplayers
def test_uneven_splits_with_zero3_through_check_parallel():
    check_parallel(uneven_gpt2, family_parallelize, FAMILY_IDS, layouts=[Layout(tp=2, dp=2, zero_stage=3,
                   sequence_parallel=True), Layout(tp=4)], steps=2)  # fmt: skip


@pytest.mark.tplayers
@pytest.mark.parametrize("family", EXACT)
def test_family_tp2_sp_zero3_through_check_parallel(family):
    """Parameters after parallelize, logits, loss, every gradient and parameter after two SGD
    steps, at TP 2 + SP x DP 2 with ZeRO-3, against the unsharded model."""
    sequence_parallel = family not in SP_REFUSED  # refused up front there: ZeRO-3 over TP 2 alone
    check_parallel(functools.partial(tiny_model, family), family_parallelize, FAMILY_IDS, steps=2,
                   layouts=[Layout(tp=2, dp=2, zero_stage=3, sequence_parallel=sequence_parallel)])  # fmt: skip


# ---- hypothesis: any heads, key/value heads, vocabulary and MLP width, through check_parallel -------


def parallelize_any(model, mesh, layout):
    """TP (+ SP), then pipeline stages or ZeRO over the replicas, as the layout asks."""
    tplayers.parallelize(model, group=mesh["tp"], sequence_parallel=layout.sequence_parallel, verify=False)
    if layout.pp == 1:
        return tplayers.data_parallel(model, group=mesh["dp"], zero_stage=layout.zero_stage)
    stages = tplayers.pipeline_split(model, group=mesh["pp"])
    for stage in stages if layout.dp > 1 else ():
        tplayers.data_parallel(stage.module, group=mesh["dp"], zero_stage=layout.zero_stage)
    return stages


@pytest.mark.tplayers
@settings(max_examples=examples(4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_uneven_llamas_through_check_parallel(data):
    """Heads (kv groups x group size, head width 4), vocabulary and MLP width drawn without regard
    to the TP size, over drawn layouts (TP 1-8, SP, ZeRO, pipeline stages); at least a head per
    rank (fewer are refused, tested above)."""
    layout = data.draw(tst.layouts(max_world=8, tp=(1, 2, 3, 4, 5, 6, 7, 8), pp=(1, 2), dp=(1, 2), zero_stages=(0, 3),
                                   sequence_parallel=(False, True), seq_len=8, layers=2), label="layout")  # fmt: skip
    kv = data.draw(st.integers(1, 3), label="kv_heads")
    group = data.draw(st.integers(-(-layout.tp // kv), -(-layout.tp // kv) + 2), label="group")
    heads = kv * group
    vocab = data.draw(st.integers(8, 101), label="vocab")
    ffn = data.draw(st.integers(1, 40), label="ffn")  # under tp: ranks with none of it
    build = functools.partial(tiny_model, "llama", vocab=vocab, ffn=ffn, num_attention_heads=heads,
                              num_key_value_heads=kv, head_dim=4, hidden_size=4 * heads)  # fmt: skip
    ids = torch.randint(3, min(vocab, VOCAB), (4, 8), generator=torch.Generator().manual_seed(vocab))
    # TP 1 reduces nothing, but its gate|up is one fused GEMM where HF runs two: CPU BLAS may sum
    # in another order (1e-13 apart), so it is held to the tolerance table, not bit for bit
    exact = None if layout.tp > 1 else False
    check_parallel(build, parallelize_any, ids, layouts=[layout], steps=2, exact=exact)


def llama_with_one_mlp_column():
    return tiny_model("llama", ffn=1)


@pytest.mark.tplayers
def test_a_rank_holding_none_of_a_split_under_zero3():
    """An MLP of 1 over 2 ranks: rank 1 holds none of it, and FSDP2 has nothing to shard there
    (found by the drawn test above: FSDP2 cannot reduce-scatter an empty tensor)."""
    check_parallel(llama_with_one_mlp_column, parallelize_any, FAMILY_IDS,
                   layouts=[Layout(tp=2, dp=2, zero_stage=3)], steps=2)  # fmt: skip


def assign_loaded_grads(rank, tp, group, family, sequence_parallel, how):
    """Every gradient against the unsharded model's after the user reloads the parallelized
    model's own state dict with load_state_dict(assign=True) (new tensors in every slot), or
    deep-copies it (copy.deepcopy keeps a tensor's attributes but not its hooks), and trains one
    step: the second step's gradients see any hook still reading the original's weights."""
    from tplayers.hf import gather_grads

    reference = tiny_model(family)
    model = tplayers.parallelize(copy.deepcopy(reference), group=group, sequence_parallel=sequence_parallel)
    truth = copy.deepcopy(reference).double()  # Gemma 4's second step amplifies fp32 rounding: fp64 arbitrates
    for module in truth.modules():  # HF's grouped-GEMM experts have no fp64: its eager loop has
        if hasattr(getattr(module, "config", None), "_experts_implementation"):
            module.config._experts_implementation = "eager"
    if how == "assign":  # on all: an assign load unties tied weights in HF's own model too
        for m in (model, reference, truth):
            m.load_state_dict(m.state_dict(), assign=True)
    else:
        model = copy.deepcopy(model)
    for step in range(2):
        ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3 + step))
        for m in (model, reference, truth):
            m.zero_grad()
            m(ids, labels=ids).loss.backward()
        grads = gather_grads(model, group=group)
        for (name, p), exact in zip(reference.named_parameters(), truth.parameters(), strict=True):
            msg = f"{family} {name} after {how}, step {step}"
            assert_close_or_rounding(grads[name], p.grad, exact.grad, msg=msg)
        for m in (model, reference, truth):
            torch.optim.SGD(m.parameters(), lr=0.5).step()


@pytest.mark.parametrize("how", ["assign", "deepcopy"])
@pytest.mark.parametrize(
    "family", ["qwen3", "deepseek_v3", "jetmoe", "doge", "rwkv", "dory", "persimmon", "gemma4_text"]
)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_gradients_summed_over_the_group_survive_an_assign_load_or_a_deepcopy(pool, family, sequence_parallel, how):
    """Per-head q / k norms (Qwen3, Persimmon), MLA's latent projections, JetMoE's routers, Doge's
    summed dt_proj, RWKV's mixing vectors, Dory's L2 norms, Gemma 4's q / k / v norms and per-layer
    inputs: each rank computes part of their gradient, summed by a hook; a tensor assigned into their
    slot, or a deep copy of the model, gets that hook back (before, each rank silently kept its own
    part: 0.08 off on DeepSeek-V3's kv_a_proj_with_mqa), and only once. JetMoE's deep copy once
    subtracted the original's expert bias after a step (its hook held the module)."""
    pool.run(assign_loaded_grads, 2, family, sequence_parallel, how)


def test_negative_control_a_hook_holding_a_module_is_found():
    """hooks_holding_state finds a closure over a module (what a deep copy leaves on the original)
    and passes hooks that read the module they are called with."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].register_forward_hook(lambda mod, args, out: out - mod.bias)
    assert hooks_holding_state(model) == []
    bias = model[0].bias
    model[0].register_forward_hook(lambda mod, args, out: out - bias)
    assert len(hooks_holding_state(model)) == 1 and "Parameter" in hooks_holding_state(model)[0]


def rank_by_rank_grads(rank, tp, group):
    """differing_grads (each rank's gradients against its load-path slices of the reference's) finds
    none on an exact model, names a gradient one rank holds wrong on that rank only, and leaves the
    model's parameters as they were."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=group)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    reference(ids, labels=ids).loss.backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    full = grads_as_state_dict(reference)
    assert differing_grads(model, full) == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    name, p = next((n, p) for n, p in model.named_parameters() if "k_proj" in n)
    if rank == 1:
        p.grad[0, 0] += 1e-3
    assert differing_grads(model, full) == ([name] if rank == 1 else [])


def test_negative_control_a_wrong_gradient_on_one_rank_is_found_rank_by_rank(pool):
    pool.run(rank_by_rank_grads, 2)


def normed_embedding(rank, tp, group, sequence_parallel):
    """Inkling's normed embedding (its RMSNorm after the lookup) on a Llama: vocabulary-parallel with
    the norm whole after it; loss, every gradient and the state dict equal the unsharded model's."""
    from transformers.models.inkling.modeling_inkling import InklingNormedEmbedding

    from tplayers.hf import gather_grads

    reference = tiny_model("llama")
    old = reference.model.embed_tokens
    reference.model.embed_tokens = InklingNormedEmbedding(old.num_embeddings, old.embedding_dim, old.padding_idx, 1e-6)
    with torch.no_grad():
        reference.model.embed_tokens.weight.copy_(old.weight)
        reference.model.embed_tokens.embed_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(4))
    model = tplayers.parallelize(copy.deepcopy(reference), group=group, sequence_parallel=sequence_parallel)
    assert isinstance(model.model.embed_tokens, families.NormedVocabParallelEmbedding)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    loss = model(ids, labels=ids).loss
    loss.backward()
    expected = reference(ids, labels=ids).loss
    expected.backward()
    assert_close(loss, expected)
    grads = gather_grads(model, group=group)
    for name, p in reference.named_parameters():
        assert_close(grads[name], p.grad, msg=lambda m, name=name: f"{name}: {m}")
    full = tplayers.gather_state_dict(model, group=group)
    for key, value in reference.state_dict().items():
        assert_close(full[key], value, exact=True, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_normed_embeddings_are_vocabulary_parallel(pool, sequence_parallel):
    pool.run(normed_embedding, 2, sequence_parallel)


def scaled_logits_head(rank, tp, group, sequence_parallel):
    """A Llama whose LM head is Dory's (each logit scaled by a learned per-entry factor, in fp32): the
    vocabulary split unevenly (97 entries), the scale with it; logits, loss, every gradient (the
    scale's included) and the state dict equal the unsharded model's."""
    from transformers.models.dory.configuration_dory import DoryConfig
    from transformers.models.dory.modeling_dory import DoryLMHead

    model = tiny_model("llama", vocab=97)
    torch.manual_seed(3)
    head = DoryLMHead(DoryConfig(hidden_size=32, vocab_size=97, initializer_range=0.02))
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.logit_scale.uniform_(0.01, 0.03)
    model.lm_head = head
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=group, sequence_parallel=sequence_parallel)
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    out, expected = model(ids, labels=ids), reference(ids, labels=ids)
    assert_close(out.logits, expected.logits)
    assert_close(out.loss, expected.loss)
    out.loss.backward()
    expected.loss.backward()
    grads = tplayers.hf.gather_grads(model, group=group)
    for name, p in reference.named_parameters():
        assert_close(grads[name], p.grad, msg=lambda m, name=name: f"{name}: {m}")
    full = tplayers.gather_state_dict(model, group=group)
    assert list(full) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert_close(full[key], value, exact=True, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize(("tp", "sequence_parallel"), [(2, True), (3, False)], ids=["tp2-sp", "tp3"])
def test_a_head_scaling_its_logits_per_entry_is_split_with_the_vocabulary(pool, tp, sequence_parallel):
    pool.run(scaled_logits_head, tp, sequence_parallel)
