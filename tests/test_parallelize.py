"""`parallelize` on tiny HuggingFace causal LMs (random configs, no network) against the same
model unsharded: logits, loss, every parameter gradient, greedy generate, state-dict round trip."""

import copy

import pytest
import torch
from torch import nn

import tplayers
from tplayers.hf import gather_grads
from tplayers.testing import RemoteError, assert_close

pytestmark = pytest.mark.multirank

VOCAB = 96


def tiny_model(family):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=64
    )
    if family == "llama":  # GQA: 4 query heads, 2 key/value heads (replicated at TP=4)
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2))
    if family == "qwen2":  # q/k/v biases, MQA
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=1))
    if family == "qwen3":  # per-head q_norm / k_norm inside the attention
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    if family == "llama_tied":
        cfg = tf.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
        return tf.LlamaForCausalLM(cfg)
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**common, num_attention_heads=4, num_key_value_heads=4))
    if family == "two_heads":
        return tf.MistralForCausalLM(tf.MistralConfig(**common, num_attention_heads=2, num_key_value_heads=1))
    if family == "gpt2":  # Conv1D, fused c_attn, tied embeddings
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
        return tf.GPT2LMHeadModel(cfg)
    raise ValueError(family)


def check_family(rank, tp, group, family, sequence_parallel):
    model = tiny_model(family).eval()
    reference = copy.deepcopy(model)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    tplayers.parallelize(model, group=group, sequence_parallel=sequence_parallel)
    assert all(tplayers.get_placement(p) is not None for p in model.parameters())  # one record for all

    full = tplayers.gather_state_dict(model, group=group)  # round trip, exactly
    assert list(full) == list(original)
    for key, value in full.items():
        assert_close(value, original[key], exact=True, msg=lambda m, k=key: f"{k}: {m}")
    # loading a full state dict puts every shard in place: it gathers back to the same, exactly
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in original.items()}
    tplayers.load_full_state_dict(model, changed)
    for key, value in tplayers.gather_state_dict(model, group=group).items():
        assert_close(value, changed[key], exact=True, msg=lambda m, k=key: f"{k}: {m}")
    tplayers.load_full_state_dict(model, original)
    if family == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied stays tied
    else:  # SiLU-gated MLPs run as one gate|up GEMM plus the SwiGLU kernel
        assert isinstance(model.model.layers[0].mlp, tplayers.ParallelMLP)

    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    out, out_ref = model(ids, labels=ids), reference(ids, labels=ids)
    assert out.logits.shape[-1] == VOCAB  # full-vocabulary logits
    assert_close(out.logits, out_ref.logits)
    assert_close(out.loss, out_ref.loss)
    out.loss.backward()
    out_ref.loss.backward()
    grads = gather_grads(model, group=group)
    for name, p in reference.named_parameters():
        assert_close(grads[name], p.grad, msg=lambda m, k=name: f"grad of {k}: {m}")
    if not sequence_parallel:  # greedy decoding with the KV cache holding local heads
        prompt = ids[:, :3]
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
        assert torch.equal(generated, reference.generate(prompt, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gpt2"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_hf_model_matches_unsharded(pool, family, tp, sequence_parallel):
    pool.run(check_family, tp, family, sequence_parallel)


class Custom(nn.Module):
    """A model parallelize cannot recognise: it needs a plan."""

    def __init__(self, vocab=12):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, ids):
        return self.down(torch.relu(self.up(self.emb(ids))))


def plan_for_custom_model(rank, tp, group, vocab=12):
    torch.manual_seed(0)
    model = Custom(vocab)
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=group, plan={"emb": "vocab", "up": "colwise", "down": "rowwise"})
    full = tplayers.gather_state_dict(model)
    assert all(torch.equal(full[k], v) for k, v in reference.state_dict().items())
    ids = torch.tensor([[1, 5, vocab - 1, 0]])
    y, y_ref = model(ids), reference(ids)
    assert_close(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    grads = gather_grads(model, group=group)
    for name, p in reference.named_parameters():
        assert_close(grads[name], p.grad)


def test_plan_for_an_unrecognised_model(pool):
    pool.run(plan_for_custom_model, 2)


class TwoBlocks(nn.Module):
    """Two blocks of Custom's up / down: a plan written as patterns over both."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Custom() for _ in range(2))

    def forward(self, ids):
        return self.blocks[1].down(torch.relu(self.blocks[1].up(self.blocks[0](ids))))


def plan_by_patterns(rank, tp, group):
    torch.manual_seed(0)
    model = TwoBlocks()
    reference = copy.deepcopy(model)
    plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise", "blocks.0.emb": "vocab", "*.emb": "replicate"}
    tplayers.parallelize(model, group=group, plan=plan)  # blocks.0.emb: its own entry wins over the pattern
    assert type(model.blocks[0].emb).__name__ == "VocabParallelEmbedding" and type(model.blocks[1].emb) is nn.Embedding
    assert all(type(b.up).__name__ == "ColumnParallelLinear" for b in model.blocks)
    ids = torch.tensor([[1, 5, 11, 0]])
    assert_close(model(ids), reference(ids))


def test_plan_entries_may_be_patterns(pool):
    pool.run(plan_by_patterns, 2)


def test_plan_with_splits_that_do_not_divide(pool):
    """A vocabulary of 10 and a width of 16 on 3 ranks: [4, 4, 2] and [6, 6, 4] rows."""
    pool.run(plan_for_custom_model, 3, 10)


def bad_input(rank, tp, group, case):
    if case == "unrecognised":
        tplayers.parallelize(Custom(), group=group)
    elif case == "heads":
        tplayers.parallelize(tiny_model("two_heads"), group=group)  # 2 heads on 3 ranks: one would hold none
    elif case == "bad_plan":
        tplayers.parallelize(Custom(), group=group, plan={"up": "diagonal"})
    elif case == "plan_typo":
        tplayers.parallelize(Custom(), group=group, plan={"emb": "vocab", "upp": "colwise", "down": "rowwise"})
    elif case == "plan_conflict":
        tplayers.parallelize(TwoBlocks(), group=group, plan={"*.up": "colwise", "blocks.0.*": "replicate"})
    elif case == "plan_inside":
        tplayers.parallelize(tiny_model("llama"), group=group, plan={"*.self_attn.q_proj": "replicate"})
    elif case == "too_long":
        model = tplayers.parallelize(tiny_model("gpt2"), group=group)
        model(torch.zeros(1, 65, dtype=torch.long))
    elif case == "sp_sequence":
        model = tplayers.parallelize(tiny_model("llama"), group=group, sequence_parallel=True)
        model(torch.zeros(1, 1, dtype=torch.long))  # 3 tokens split 2, 1; one leaves a rank none


CASES = {
    "unrecognised": r"could not place \['up', 'down'\]",
    "heads": r"2 attention heads over 3 ranks leave 1 ranks without a head.*use at most 2 ranks",
    "bad_plan": r"plan values must be one of",
    "plan_typo": r"plan entries \['upp'\] name no module of Custom",
    "plan_conflict": r"plan patterns \['\*\.up', 'blocks\.0\.\*'\] give blocks\.0\.up different kinds",
    "plan_inside": r"plan entries \['\*\.self_attn\.q_proj'\] name modules inside \['model\.layers\.0\.self_attn'",
    "too_long": r"input of 65 positions is longer than the model's 64",
    "sp_sequence": r"residual stream \(\d+, 1, \d+\) has no sequence \(dimension 1\) of at least 2 tokens, one for "
    r"each rank",
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_on_every_rank(pool, case):
    import re

    replies = pool.run(bad_input, 3 if case == "heads" else 2, case, return_exceptions=True)
    for reply in replies:
        assert isinstance(reply, RemoteError) and re.search(CASES[case], reply.message), reply


def llama_bytes(rank, tp, group, sequence_parallel):
    model = tplayers.parallelize(tiny_model("llama"), group=group, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with tplayers.count_bytes() as sent:
        model(ids, labels=ids).loss.backward()
    return sent.total()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_communication_is_the_megatron_minimum(pool, sequence_parallel):
    """One collective per (block input, block output) each way, as Megatron-LM's layers need; the
    loss gathers per-row statistics, not logits."""
    tp, layers, hidden, tokens = 2, 2, 32, 2 * 8
    act = tokens * hidden * 4  # one (B, S, H) fp32 activation
    ring, all_reduce = (tp - 1) / tp, 2 * (tp - 1) / tp
    # the fused loss: 4 fp32 statistics per row from every rank, never the (tokens, VOCAB) logits
    loss_stats = ring * tp * tokens * 4 * 4
    edges = all_reduce * act * 2  # the embedding's partial sums (fwd), the LM head's input grad (bwd)
    if sequence_parallel:  # per block: attention and MLP each gather in, reduce-scatter out, both ways
        per_block = 8 * ring * act + 2 * all_reduce * hidden * 4  # + the two norm weights' grads
        edges += 2 * ring * act  # entering the first block (bwd) and leaving the last (fwd)
    else:  # per block: attention and MLP each one all-reduce forward, one backward
        per_block = 4 * all_reduce * act
    expected = layers * per_block + edges + loss_stats
    assert pool.run(llama_bytes, tp, sequence_parallel) == [pytest.approx(expected, rel=1e-6)] * tp


def tied_checkpoint_and_vocab_parallel_loss(rank, tp, group):
    model = tiny_model("llama_tied")
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=group, vocab_parallel_logits=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    checkpoint = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}  # as HF saves it
    tplayers.load_full_state_dict(model, checkpoint)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="vocab_parallel_cross_entropy"):
        model(ids, labels=ids)
    loss = tplayers.vocab_parallel_cross_entropy(model(ids).logits[:, :-1], ids[:, 1:], group=group)
    assert_close(loss, reference(ids, labels=ids).loss)


def test_tied_checkpoint_without_head_and_vocab_parallel_loss(pool):
    pool.run(tied_checkpoint_and_vocab_parallel_loss, 2)
