"""`parallelize` on tiny random models of every HuggingFace causal-LM family it knows: logits,
loss, every parameter after one SGD step (through `gather_state_dict`) and greedy `generate()`
equal the unsharded model's; the families it does not know exactly are refused, naming the
module; the self-check (`verify`) catches a wrong shard. transformers 5.x (pyproject pins the
range)."""

import copy
import re
import warnings

import pytest
import torch
from torch import nn

import tplayers
from tplayers.hf import families
from tplayers.testing import RemoteError, assert_close

pytestmark = pytest.mark.multirank

VOCAB = 96
EXACT = ["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "gpt2",
         "gptj", "opt", "stablelm", "starcoder2", "olmo", "cohere", "granite", "smollm3", "phi3", "glm4"]  # fmt: skip
# Not yet known exactly: each is refused with the module that stops it (see the README's table).
REFUSED = {
    "gpt_neox": r"could not place \[.*query_key_value",
    "gpt_bigcode": r"could not place \[.*c_attn",
    "falcon": r"FalconLinear overrides Linear.forward",
    "bloom": r"could not place \[.*query_key_value",
    "olmo2": r"q_norm.weight \(32,\) spans all heads",
    "codegen": r"could not place \[.*qkv_proj",
    "mpt": r"could not place \[.*Wqkv",
}
SP_REFUSED = {
    "qwen2_moe": r"mlp \(Qwen2MoeSparseMoeBlock\) feeds its shared expert flattened tokens",
    "opt": r"fc1 / fc2 sit in the decoder layer itself \(OPTDecoderLayer\)",
}

# The fused qkv_proj is split by key/value heads: 2 of them do not go over 4 ranks.
TP4_REFUSED = {"phi3": r"key/value heads \(fused qkv_proj\) \(2\) is not divisible by the tensor-parallel size \(4\)"}


def tiny_model(family, dtype=torch.float32):
    """A 2-layer random model: hidden 32, 4 query heads of 8, 2 key/value heads, no dropout."""
    import transformers as tf

    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, head_dim=8, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)  # fmt: skip
    if family == "falcon":
        kw.pop("head_dim")  # a read-only property there
    if family in ("gptj", "codegen"):
        kw["rotary_dim"] = 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.AutoConfig.for_model(family, **kw)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout", "attention_dropout", "dropout"):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    return tf.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def matches_unsharded(rank, tp, group, family, sequence_parallel, dtype):
    model = tiny_model(family, dtype)
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=group, sequence_parallel=sequence_parallel)  # verify on by default
    full = tplayers.gather_state_dict(model, group=group)  # the state dict round-trips exactly
    assert list(full) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert_close(full[key], value, exact=True, msg=lambda m, k=key: f"{family} {k}: {m}")

    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    out, out_ref = model(ids, labels=ids), reference(ids, labels=ids)
    assert_close(out.logits, out_ref.logits, msg=lambda m: f"{family} logits: {m}")
    assert_close(out.loss, out_ref.loss, msg=lambda m: f"{family} loss: {m}")
    for m, loss in ((model, out.loss), (reference, out_ref.loss)):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        loss.backward()
        opt.step()
    after = tplayers.gather_state_dict(model, group=group)
    for key, value in reference.state_dict().items():  # every parameter after the step: every gradient
        assert_close(after[key], value, msg=lambda m, k=key: f"{family} {k} after one step: {m}")
    if not sequence_parallel:  # greedy decoding with the KV cache holding local heads
        prompt = ids[:, :3]
        with torch.no_grad():
            tokens = model.generate(prompt, max_new_tokens=5, do_sample=False)
            assert torch.equal(tokens, reference.generate(prompt, max_new_tokens=5, do_sample=False)), family


@pytest.mark.parametrize("family", EXACT)
@pytest.mark.parametrize("tp, sequence_parallel", [(2, True), (4, False)], ids=["tp2-sp", "tp4"])
def test_family_matches_unsharded(pool, family, tp, sequence_parallel):
    refusal = SP_REFUSED.get(family) if sequence_parallel else TP4_REFUSED.get(family) if tp == 4 else None
    if refusal:
        for reply in pool.run(matches_unsharded, tp, family, sequence_parallel, torch.float32, return_exceptions=True):
            assert isinstance(reply, RemoteError) and re.search(refusal, reply.message), reply
        return
    pool.run(matches_unsharded, tp, family, sequence_parallel, torch.float32)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "opt"])
def test_family_tp2_plain(pool, family):
    pool.run(matches_unsharded, 2, family, False, torch.float32)


def gemma_logits_in_bf16(rank, tp, group, family):
    model = tiny_model(family, torch.bfloat16)
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=group)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    assert_close(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("family", ["gemma", "llama", "phi"])
def test_bf16_logits(pool, family):
    pool.run(gemma_logits_in_bf16, 2, family)


def refused(rank, tp, group, family):
    tplayers.parallelize(tiny_model(family), group=group)


@pytest.mark.parametrize("family", list(REFUSED))
def test_unknown_layouts_are_refused_on_every_rank(pool, family):
    for reply in pool.run(refused, 2, family, return_exceptions=True):
        assert isinstance(reply, RemoteError) and re.search(REFUSED[family], reply.message), reply


def heads_not_divisible(rank, tp, group, family):
    tplayers.parallelize(tiny_model(family), group=group)


@pytest.mark.parametrize("family", ["gemma", "opt", "gptj"])
def test_heads_not_divisible_named_on_every_rank(pool, family):
    for reply in pool.run(heads_not_divisible, 3, family, return_exceptions=True):
        assert isinstance(reply, RemoteError), reply
        assert re.search(r"attention heads \(4\) is not divisible by the tensor-parallel size \(3\)", reply.message)


# -- negative controls ------------------------------------------------------------------------
def swapped_kv_adapter(rank, tp, group, verify):
    """An adapter that puts k's rows where v's go: verify must catch it (and without verify, the
    comparison helper must)."""
    original = families.qkvo_attention

    def wrong(sp, name, attn):
        attn.k_proj, attn.v_proj = attn.v_proj, attn.k_proj
        original(sp, name, attn)

    adapters = tuple(
        families.Adapter(a.name, a.matches, wrong) if a.apply is original else a for a in families.ADAPTERS
    )
    families.ADAPTERS, saved = adapters, families.ADAPTERS
    try:
        model = tiny_model("llama")
        reference = copy.deepcopy(model)
        tplayers.parallelize(model, group=group, verify=verify)
        ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
        with pytest.raises(AssertionError):
            assert_close(model(ids).logits, reference(ids).logits)
    finally:
        families.ADAPTERS = saved


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


def test_verify_modes(pool):
    pool.run(verify_modes, 2)
