"""ParallelAttention against HuggingFace's own LlamaAttention (sdpa) from a tiny random config:
forward and every gradient on 1-4 local ranks, MHA / GQA / MQA including TP > kv heads and head
counts that do not divide (whole heads per rank, a rank may hold none), padding masks, sequence
parallelism; bad input rejected on every rank."""

import contextlib
import re
import time
from copy import deepcopy
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

import tplayers
from tplayers.nn.attention import ParallelAttention
from tplayers.placement import even_sizes, get_placement
from tplayers.testing import RemoteError, assert_close, assert_shard_close, examples

pytestmark = pytest.mark.multirank


@dataclass(frozen=True)
class AttnCase:
    num_heads: int
    num_kv_heads: int
    head_dim: int = 4
    hidden_per_head: int = 3  # HF's config wants hidden divisible by num_heads; head_dim is separate
    batch: int = 2
    seq_per_rank: int = 2  # the whole sequence is seq_per_rank * tp
    seq: int | None = None  # with SP, the whole length when tp does not divide it (split as torch.tensor_split)
    dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    padding: str = "none"  # "none" | "right" | "left": a (B, S) attention_mask with padded keys
    position_ids: bool = False  # explicit position_ids (left padding: counted from the first token)
    bias: bool = False  # q / k / v / o bias (Llama attention_bias)
    qkv_only_bias: bool = False  # Qwen2-style: q / k / v bias, no o bias
    wrong_shard: bool = False  # negative control: rank r gets its neighbour's q rows
    backend: str = "torch"
    seed: int = 0


def hf_attention(case):
    config = LlamaConfig(
        hidden_size=case.hidden_per_head * case.num_heads, num_attention_heads=case.num_heads,
        num_key_value_heads=case.num_kv_heads, head_dim=case.head_dim,
        attention_bias=case.bias or case.qkv_only_bias, intermediate_size=8, num_hidden_layers=1,
        vocab_size=16, rope_theta=500.0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    attn = LlamaAttention(config, layer_idx=0)
    if case.qkv_only_bias:
        attn.o_proj.bias = None
    return config, attn.to(case.dtype)


def padding_mask(case, S, generator):
    mask = torch.ones(case.batch, S, dtype=torch.long)
    for b in range(case.batch):
        pad = int(torch.randint(0, S, (1,), generator=generator))  # at least one real token per row
        if case.padding == "right" and pad:
            mask[b, S - pad :] = 0
        elif case.padding == "left":
            mask[b, :pad] = 0
    return mask


def run_attention(rank, tp, group, case: AttnCase):
    """One rank's check against the unsharded HF module; returns the replicated grads (identical on every rank)."""
    tplayers.set_backend(case.backend)
    torch.manual_seed(case.seed)
    S = case.seq or case.seq_per_rank * tp
    sizes = [len(part) for part in torch.arange(S).tensor_split(tp)]  # each rank's part under SP
    config, ref = hf_attention(case)
    g = torch.Generator().manual_seed(case.seed)
    H = case.hidden_per_head * case.num_heads
    x = torch.randn(case.batch, S, H, generator=g).to(case.dtype)
    dy = torch.randn(case.batch, S, H, generator=g).to(case.dtype)
    mask = None if case.padding == "none" else padding_mask(case, S, g)
    pos = None
    if case.position_ids:
        pos = (mask.cumsum(-1) - 1).clamp(min=0) if mask is not None else torch.arange(3, S + 3)[None]
    ref_pos = torch.arange(S)[None] if pos is None else pos

    x_ref = x.clone().requires_grad_(True)
    cos_sin = LlamaRotaryEmbedding(config)(x_ref, ref_pos)
    ref_mask = create_causal_mask(config, x_ref, mask, None, position_ids=ref_pos)
    y_ref = ref(x_ref, position_embeddings=cos_sin, attention_mask=ref_mask)[0]
    y_ref.backward(dy)

    source = ref
    if case.wrong_shard:
        source = hf_attention(case)[1]
        source.load_state_dict(ref.state_dict())
        with torch.no_grad():
            source.q_proj.weight.copy_(ref.q_proj.weight.roll(case.num_heads // tp * case.head_dim, 0))
    layer = ParallelAttention.from_hf_llama(source, group=group, sequence_parallel=case.sequence_parallel)
    sp = case.sequence_parallel
    x_local = (x.split(sizes, 1)[rank] if sp else x).clone().requires_grad_(True)
    with tplayers.functional.sequence_split(S, group) if sp else contextlib.nullcontext():
        y = layer(x_local, attention_mask=mask, position_ids=pos)
    y.backward(dy.split(sizes, 1)[rank] if sp else dy)

    kw = dict(rank=rank, num_shards=tp)
    seq_dim = 1 if sp else None
    # A padded query row (no key left) is zero in both; its values are compared too.
    assert_shard_close(y.detach(), y_ref.detach(), dim=seq_dim, **kw, sizes=sizes, msg=lambda m: f"output: {m}")
    assert_shard_close(x_local.grad, x_ref.grad, dim=seq_dim, **kw, sizes=sizes, msg=lambda m: f"input grad: {m}")
    replicated = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        for pname in ("weight", "bias"):
            param, ref_param = getattr(getattr(layer, name), pname), getattr(getattr(ref, name), pname)
            assert (param is None) == (ref_param is None), f"{name}.{pname} presence"
            if param is None:
                continue
            placement = get_placement(param)
            assert placement is not None and placement.group is group, f"{name}.{pname} placement"
            dim = placement.placement.dim if placement.is_sharded else None
            # q / o: whole heads, as evenly as they go (12 over 8: 2, 2, 2, 2, 1, 1, 1, 1)
            unit = getattr(getattr(layer, name), "split_unit", 1)
            split = dict(unit=unit, sizes=even_sizes(case.num_heads, tp) if name in ("q_proj", "o_proj") else None)
            # The parameter itself is this rank's slice of the HF one (bit for bit) ...
            if not case.wrong_shard:
                assert_shard_close(param.detach(), ref_param.detach(), dim=dim, **kw, exact=True, **split)
            # ... and its grad this rank's slice of the unsharded grad (whole when replicated).
            assert_shard_close(
                param.grad, ref_param.grad, dim=dim, **kw, **split,
                msg=lambda m, n=f"{name}.{pname}": f"{n} grad: {m}",
            )  # fmt: skip
            if dim is None:
                replicated[f"{name}.{pname}"] = param.grad
    return replicated


def check_attention(pool, tp, case):
    replies = pool.run(run_attention, tp, case)
    for grads in replies[1:]:  # a replicated parameter's grad is the same on every rank, bit for bit
        assert grads.keys() == replies[0].keys()
        for name, grad in grads.items():
            assert torch.equal(grad, replies[0][name]), name


@st.composite
def attention_cases(draw):
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    kv = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))  # any head counts: uneven splits, ranks with none
    group_size = draw(st.sampled_from([1, 2, 3, 4]))
    sp = draw(st.booleans())
    padding = draw(st.sampled_from(["none", "right", "left"]))
    bias = draw(st.sampled_from(["none", "all", "qkv"]))
    case = AttnCase(
        num_heads=kv * group_size,
        num_kv_heads=kv,
        head_dim=draw(st.sampled_from([2, 4, 6])),
        hidden_per_head=draw(st.integers(1, 4)),
        batch=draw(st.integers(1, 2)),
        seq_per_rank=draw(st.integers(1, 3)),
        dtype=draw(st.sampled_from([torch.float32] * 5 + [torch.bfloat16])),
        sequence_parallel=sp,
        padding=padding,
        position_ids=draw(st.booleans()),
        bias=bias == "all",
        qkv_only_bias=bias == "qkv",
        seed=draw(st.integers(0, 2**16)),
    )
    return tp, case


@settings(max_examples=examples(30))
@given(attention_cases())
def test_attention_matches_hf_llama(pool, tp_case):
    check_attention(pool, *tp_case)


# Every head layout explicitly: MHA, GQA with kv split, TP > kv heads (GQA and MQA), tp = 3; then
# heads that do not divide, split whole as evenly as they go: 9 / 3 over 2 (5 and 4, the queries
# of kv head 1 on both ranks), 14 / 2 over 4 (4, 4, 3, 3), 6 / 2 over 3 (kv groups straddle ranks),
# 4 / 2 over 3 (2, 1, 1), 12 / 4 over 3, 2 / 2 over 3 (1, 1 and a rank with none).
LAYOUTS = [
    (1, 4, 2), (2, 4, 4), (2, 8, 2), (4, 8, 4), (4, 8, 2), (4, 8, 1), (4, 4, 1), (2, 2, 1), (3, 6, 3), (3, 6, 1),
    (2, 9, 3), (4, 14, 2), (3, 6, 2), (3, 4, 2), (3, 12, 4), (3, 2, 2),
]  # fmt: skip


@pytest.mark.parametrize("tp,num_heads,num_kv_heads", LAYOUTS)
@pytest.mark.parametrize("sequence_parallel", [False, True, "uneven"], ids=["plain", "sp", "sp-2tp+1-tokens"])
def test_head_layouts(pool, tp, num_heads, num_kv_heads, sequence_parallel):
    case = AttnCase(
        num_heads=num_heads, num_kv_heads=num_kv_heads, sequence_parallel=bool(sequence_parallel),
        padding="left", position_ids=True, bias=True, seed=tp * 100 + num_heads * 10 + num_kv_heads,
        seq=2 * tp + 1 if sequence_parallel == "uneven" else None,
    )  # fmt: skip
    check_attention(pool, tp, case)


def test_bf16(pool):
    check_attention(pool, 4, AttnCase(num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, padding="right"))


@pytest.mark.interpreter
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_triton_backend(pool, sequence_parallel):
    case = AttnCase(num_heads=4, num_kv_heads=1, sequence_parallel=sequence_parallel, padding="left", backend="triton")
    check_attention(pool, 2, case)


def kv_layout(rank, tp, group):
    layer = ParallelAttention(16, 8, 2, group=group)
    copy = deepcopy(layer)  # placements survive a copy, and the copy computes the same thing
    for (name, p), q in zip(layer.named_parameters(), copy.parameters(), strict=True):
        assert get_placement(q) == get_placement(p) and torch.equal(p, q), name
    x = torch.randn(1, 3, 16)
    assert_close(copy(x), layer(x), exact=True)
    return layer.kv_replicated, layer.kv_head_start, tuple(layer.k_proj.weight.shape), layer.q_proj.weight.shape[0]


def test_kv_heads_replicated_when_tp_exceeds_them(pool):
    # 8 q heads, 2 kv heads, TP=4: rank r holds q heads [2r, 2r+1] and reads kv head r // 2.
    assert pool.run(kv_layout, 4) == [(True, r // 2, (4, 16), 4) for r in range(4)]
    assert pool.run(kv_layout, 2) == [(False, 0, (2, 16), 8)] * 2


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["kv_split", "kv_replicated"])
def test_negative_control_wrong_shard_fails(pool, sequence_parallel, num_kv_heads):
    case = AttnCase(num_heads=8, num_kv_heads=num_kv_heads, sequence_parallel=sequence_parallel, wrong_shard=True)
    with pytest.raises(tplayers.RankError, match="Tensor-likes are not"):
        check_attention(pool, 4, case)
    check_attention(pool, 4, replace(case, wrong_shard=False))  # and the pool still works


def build_bad(rank, tp, group, case):
    if case == "gqa_ratio":
        ParallelAttention(12, 6, 4, group=group)
    layer = ParallelAttention(12, 6, 3, group=group, sequence_parallel=case == "sp_mask")
    x = torch.randn(2, 4, 12)
    if case == "mask":
        return layer(x, attention_mask=torch.ones(2, 5))
    if case == "sp_mask":  # the mask covers the whole sequence: 3 ranks * 4 = 12
        return layer(x, attention_mask=torch.ones(2, 4))
    if case == "position_ids":
        return layer(x, position_ids=torch.arange(5)[None])
    if case == "dtype":
        return layer(x.half())
    layer(torch.randn(2, 4, 10))


BAD = {
    "gqa_ratio": r"num_heads \(6\) is not divisible by num_kv_heads \(4\)",
    "mask": r"attention_mask must be \(batch, seq\) = \(2, 4\), got \(2, 5\)",
    "sp_mask": r"attention_mask must be \(batch, seq\) = \(2, 12\), got \(2, 4\)",
    "position_ids": r"position_ids must be \(2 or 1, 4\), got \(1, 5\)",
    "dtype": "input dtype torch.float16 does not match the weight dtype torch.float32",
    "hidden": r"input must be \(batch, seq, 12\), got \(2, 4, 10\)",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_on_every_rank(pool, case):
    start = time.monotonic()
    replies = pool.run(build_bad, 3, case, return_exceptions=True)
    assert time.monotonic() - start < 30  # nobody waited for a collective timeout
    assert len(replies) == 3
    for reply in replies:
        expected = "TypeError" if case == "dtype" else "ValueError"
        assert isinstance(reply, RemoteError) and reply.type_name == expected, reply
        assert re.search(BAD[case], reply.message), reply.message


def test_rope_matches_hf():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from tplayers.nn.attention import apply_rope, rope_cos_sin, rope_inv_freq

    config = LlamaConfig(hidden_size=16, num_attention_heads=2, head_dim=8, rope_theta=123.0)
    pos = torch.tensor([[0, 3, 7, 1000]])
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    cos, sin = LlamaRotaryEmbedding(config)(q, pos)
    mine = rope_cos_sin(pos, rope_inv_freq(8, 123.0), q.dtype)
    assert_close(mine[0], cos, exact=True)
    assert_close(mine[1], sin, exact=True)
    hq, hk = apply_rotary_pos_emb(q, k, cos, sin)
    assert_close(apply_rope(q, *mine), hq, exact=True)
    assert_close(apply_rope(k, *mine), hk, exact=True)
