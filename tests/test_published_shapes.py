"""The published shapes of 15 popular checkpoints (vocabulary, attention heads, key/value heads,
tied embeddings as their config.json gives them; 2 layers and heads 4 wide so they fit a CPU)
through `parallelize` at TP 2, 3, 4 and 8: logits, loss, every parameter after an SGD step,
greedy `generate()` and the state-dict round trip equal the unsharded model's. None of them
divides evenly everywhere: GPT-2's 50257, SmolLM2's 9 heads, Falcon-7B's 71, Qwen2's 14 and 28,
12 heads at TP 8 (2, 2, 2, 2, 1, 1, 1, 1)."""

import copy
import functools
import sys
from pathlib import Path

import pytest
import torch

import tplayers
import tplayers.placement
from tplayers.testing import RemoteError, assert_close, logits_of

sys.path.insert(0, str(Path(__file__).parent))
from test_families import tiny_model  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.tplayers]

# name: (family, vocabulary, heads, key/value heads, tied), from each checkpoint's config.json
PUBLISHED = {
    "gpt2": ("gpt2", 50257, 12, 12, True),
    "SmolLM2-135M": ("llama", 49152, 9, 3, True),
    "falcon-7b": ("falcon", 65024, 71, 1, True),
    "Qwen2.5-0.5B": ("qwen2", 151936, 14, 2, True),
    "opt-125m": ("opt", 50272, 12, 12, True),
    "pythia-160m": ("gpt_neox", 50304, 12, 12, False),
    "Qwen2-7B": ("qwen2", 152064, 28, 4, False),
    "Llama-2-7b": ("llama", 32000, 32, 32, False),
    "Meta-Llama-3-8B": ("llama", 128256, 32, 8, False),
    "Mistral-7B-v0.1": ("mistral", 32000, 32, 8, False),
    "TinyLlama-1.1B": ("llama", 32000, 32, 4, False),
    "phi-2": ("phi", 51200, 32, 32, False),
    "gemma-2b": ("gemma", 256000, 8, 1, True),
    "Phi-3-mini-4k": ("phi3", 32064, 32, 32, False),
    "bloom-560m": ("bloom", 250880, 16, 16, True),
}
HEAD_DIM = 4
# The 2026 families: (family, vocabulary, config) with head counts, key/value heads, latent ranks, expert top-k and
# the layer pattern as each config.json gives them; heads 4 wide (MLA: [8 nope | 4 rope] for q and k, 8 for v), the
# hidden and expert widths cut, experts cut to 8 or 16 (never below the published top-k) to fit a CPU.
MLA_HEADS = dict(qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, head_dim=4, hidden_size=64,
                 moe_intermediate_size=16, intermediate_size=64, n_routed_experts=8,
                 first_k_dense_replace=1)  # fmt: skip
PUBLISHED_2026 = {
    "DeepSeek-V2-Lite": ("deepseek_v2", 102400, dict(MLA_HEADS, num_attention_heads=16, num_key_value_heads=16,
                         q_lora_rank=None, kv_lora_rank=512, num_experts_per_tok=6, n_shared_experts=2)),
    "DeepSeek-V3": ("deepseek_v3", 129280, dict(MLA_HEADS, num_attention_heads=128, num_key_value_heads=128,
                    q_lora_rank=1536, kv_lora_rank=512, num_experts_per_tok=8, n_shared_experts=1, n_group=8,
                    topk_group=4, n_routed_experts=16)),  # two experts per group: its group top-2 needs them
    "Kimi-K2": ("deepseek_v3", 163840, dict(MLA_HEADS, num_attention_heads=64, num_key_value_heads=64,
                q_lora_rank=1536, kv_lora_rank=512, num_experts_per_tok=8, n_shared_experts=1, n_group=1,
                topk_group=1)),
    "MiniCPM3-4B": ("minicpm3", 73448, dict(MLA_HEADS, num_attention_heads=40, num_key_value_heads=40,
                    q_lora_rank=768, kv_lora_rank=256, hidden_size=80,  # its config wants hidden % heads == 0
                    scale_emb=1.0, dim_model_base=80)),  # its x12 embedding and x3.2 logits scales make logits
    # of 14 here, whose fp32 rounding (1e-5, 1 ulp) passes the table's atol; they decide no split
    "gpt-oss-20b": ("gpt_oss", 201088, dict(num_attention_heads=64, num_key_value_heads=8, head_dim=HEAD_DIM,
                    hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4,
                    sliding_window=128, layer_types=["sliding_attention", "full_attention"])),
    # gpt-oss-120b: the attention, vocabulary and expert layout of 20b (64 / 8 heads, 201088 tokens, top-4),
    # 128 experts (cut to 16 here) and 36 layers
    "gpt-oss-120b": ("gpt_oss", 201088, dict(num_attention_heads=64, num_key_value_heads=8, head_dim=HEAD_DIM,
                     hidden_size=64, intermediate_size=32, num_local_experts=16, num_experts_per_tok=4,
                     sliding_window=128, layer_types=["sliding_attention", "full_attention"])),
    "Llama-4-Scout": ("llama4_text", 202048, dict(num_attention_heads=40, num_key_value_heads=8, head_dim=HEAD_DIM,
                      hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_local_experts=8,
                      num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8192,
                      no_rope_layers=[1, 0])),
    "gemma-3n-E4B": ("gemma3n_text", 262400, dict(num_attention_heads=8, num_key_value_heads=2, head_dim=HEAD_DIM,
                     hidden_size=64, intermediate_size=[64, 64], hidden_size_per_layer_input=8,
                     vocab_size_per_layer_input=262144, laurel_rank=64, altup_num_inputs=4, num_kv_shared_layers=0,
                     activation_sparsity_pattern=[0.0, 0.0], layer_types=["sliding_attention", "full_attention"])),
}  # fmt: skip


@functools.lru_cache(maxsize=1)
def published_model(name):
    """The model of checkpoint `name` (built once per rank and reused for every TP size: the
    tests run the sizes of one shape in a row; callers deep-copy it)."""
    if name in PUBLISHED_2026:
        family, vocab, config = PUBLISHED_2026[name]
        return tiny_model(family, vocab=vocab, **config)
    family, vocab, heads, kv_heads, tied = PUBLISHED[name]
    config = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=HEAD_DIM * heads,
                  head_dim=HEAD_DIM, tie_word_embeddings=tied, intermediate_size=4 * HEAD_DIM * heads)  # fmt: skip
    if family == "falcon":
        config.update(multi_query=kv_heads == 1, num_kv_heads=kv_heads)
    if family in ("phi", "gpt_neox"):
        config.update(partial_rotary_factor=0.5, rotary_pct=0.5)
    model = tiny_model(family, vocab=vocab, **config)
    assert model.config.vocab_size == vocab and model.get_input_embeddings().weight.shape[0] == vocab
    head = model.get_output_embeddings()
    assert (head.weight is model.get_input_embeddings().weight) == tied, name
    return model


def matches_unsharded(rank, tp, group, name, shifted=False):
    """Every rank trains the sharded model; rank 0 also the unsharded one and compares (the
    ranks' logits are one replicated tensor; each rank's shards come back through the gather).
    `shifted`: the negative control, rank 1's query rows taken one row further on."""
    model = copy.deepcopy(published_model(name))
    reference = copy.deepcopy(model) if rank == 0 else None
    full_q = model.model.layers[0].self_attn.q_proj.weight.detach().clone() if shifted else None
    tplayers.parallelize(model, group=group, verify=False)  # compared below, forward and backward
    if shifted and rank == 1:
        q = model.model.layers[0].self_attn.q_proj.weight
        start = tplayers.placement.shard_range(full_q.shape[0] // HEAD_DIM, tp, 1, q_split(name, tp))[0] * HEAD_DIM
        with torch.no_grad():
            q.copy_(full_q[start + 1 : start + 1 + q.shape[0]])
    vocab = (PUBLISHED | PUBLISHED_2026)[name][1]
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    ids[0, :4] = torch.tensor([vocab - 1, vocab - 2, 0, 1])  # the first and the last rank's rows
    out = model(ids, labels=ids)
    logits = logits_of(model, out, ids)
    assert logits.shape[-1] == vocab  # no padded column leaks out
    out.loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    after = tplayers.gather_state_dict(model, group=group)
    mine = {n: p.detach().clone() for n, p in model.named_parameters()}
    tplayers.load_full_state_dict(model, after)  # the state dict round trip: the same shards back
    for n, p in model.named_parameters():
        assert torch.equal(p, mine[n]), f"{name} {n} round trip"
    with torch.no_grad():
        tokens = model.generate(ids[:, :3], max_new_tokens=4, do_sample=False)
    if reference is None:
        return
    out_ref = reference(ids, labels=ids)
    assert_close(logits, out_ref.logits, msg=lambda m: f"{name} logits: {m}")
    assert_close(out.loss, out_ref.loss, msg=lambda m: f"{name} loss: {m}")
    out_ref.loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert list(after) == list(reference.state_dict())
    for key, value in reference.state_dict().items():  # every parameter after the step: every gradient
        assert_close(after[key], value, msg=lambda m, k=key: f"{name} {k} after one step: {m}")
    with torch.no_grad():
        assert torch.equal(tokens, reference.generate(ids[:, :3], max_new_tokens=4, do_sample=False)), name


def q_split(name, tp):
    return tplayers.placement.even_sizes(PUBLISHED[name][2], tp)


def test_a_rank_one_row_off_fails_the_comparison(tplayers_pool):
    """SmolLM2's 9 heads over 4 ranks (3, 2, 2, 2) with rank 1's query rows one row further on:
    the comparison catches it (and the pool still serves)."""
    replies = tplayers_pool.run(matches_unsharded, 4, "SmolLM2-135M", True, return_exceptions=True)
    assert isinstance(replies[0], RemoteError) and "logits" in replies[0].message, replies[0]
    tplayers_pool.run(matches_unsharded, 4, "SmolLM2-135M")


def even_at(name, tp) -> bool:
    _, vocab, heads, kv_heads, _ = PUBLISHED[name]
    return vocab % tp == 0 and heads % tp == 0 and kv_heads % tp == 0


# TP 8 where it splits something unevenly (or shares key/value heads); where heads, key/value heads and
# vocabulary all divide by 8 (Llama-2, Llama-3, Mistral, Phi-2, Phi-3, Bloom) it is the even split TP 2 / 4
# already show for them
SIZES = [(name, tp) for name in PUBLISHED for tp in (2, 3, 4, 8) if tp < 8 or not even_at(name, 8)]


@pytest.mark.parametrize("name, tp", SIZES, ids=[f"{n}-{t}" for n, t in SIZES])
def test_published_shapes(tplayers_pool, name, tp):
    tplayers_pool.run(matches_unsharded, tp, name)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("name", list(PUBLISHED_2026))
def test_published_2026_shapes(tplayers_pool, name, tp):
    """MLA (DeepSeek-V2-Lite's 16 heads without a query latent, DeepSeek-V3's 128, Kimi-K2's 64,
    MiniCPM3's 40: 5 per rank at TP 8), gpt-oss's 64 / 8 heads with sinks and its 201088 tokens,
    Llama 4 Scout's 40 / 8, Gemma 3n E4B's 8 / 2 with AltUp over 4 streams."""
    tplayers_pool.run(matches_unsharded, tp, name)


# -- memory: what each rank holds against the planner's most loaded rank ------------------------
UNEVEN_LLAMA = dict(vocab=97, ffn=67, num_attention_heads=9, num_key_value_heads=3, head_dim=8, hidden_size=72,
                    tie_word_embeddings=False)  # fmt: skip


def held_elements(rank, tp, group):
    model = tiny_model("llama", **UNEVEN_LLAMA)
    full = {n: p.numel() for n, p in model.named_parameters()}
    tplayers.parallelize(model, group=group)
    return sum(p.numel() for p in model.parameters()), full


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_per_rank_parameters_are_the_planners_most_loaded_rank(pool, tp):
    """9 heads / 3 key/value heads, ffn 67, vocabulary 97: each rank holds at most its ceil-share
    of every split tensor plus what it replicates, and the most loaded rank holds exactly what the
    planner prices (`tplayers.plan`, implementation "tplayers")."""
    from tplayers.plan import Assumptions, Layout, ModelSpec, Precision
    from tplayers.plan.estimate import model_state_bytes_per_rank

    replies = pool.run(held_elements, tp)
    full = replies[0][1]
    spec = ModelSpec(layers=2, hidden=72, heads=9, kv_heads=3, head_dim=8, ffn_hidden=67, vocab=97, seq_len=8,
                     max_positions=64)  # fmt: skip
    precision = Precision.preset("fp32-adam")
    planned = (
        model_state_bytes_per_rank(spec, Layout(tp=tp), precision, assumptions=Assumptions(implementation="tplayers"))[
            0
        ][0]
        / precision.param_bytes
    )
    held = [n for n, _ in replies]
    assert max(held) == planned, (held, planned)
    ceil = lambda n: -(-n // tp)  # noqa: E731
    hd, heads = 8, 9
    bound = 2 * ceil(97) * 72  # embedding and LM head rows
    bound += 2 * (2 * ceil(heads) * hd * 72 + 2 * full["model.layers.0.self_attn.k_proj.weight"])  # q, o; k, v whole
    bound += 2 * (3 * ceil(67) * 72 + 2 * 72) + 72  # gate, up, down; the norms
    assert max(held) <= bound and sum(held) >= sum(full.values()), (held, bound)
