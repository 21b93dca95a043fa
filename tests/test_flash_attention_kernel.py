"""The Triton flash attention (forward and backward) in the interpreter (or on a GPU) against its
reference, and the reference against torch's SDPA: GQA / MQA, head sizes that are not powers of
two, permuted tokens, packed documents, padding, sliding windows, softcapping, queries that see
nothing, a backward given another block's merged o / lse."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tplayers.kernels.flash_attention import (
    flash_attention,
    flash_attention_backward,
    flash_attention_backward_ref,
    flash_attention_ref,
)

from tplayers.testing import assert_close, examples, kernel_generator

pytestmark = [pytest.mark.interpreter, pytest.mark.kernel]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def metadata(B, M, N, docs, masked, permute, gen):
    """q_pos / q_doc (B, M) over the last M of N keys' positions, k_pos / k_doc (B, N); documents
    cut at random; `masked` keys hidden (doc -1); the queries in a random order. Made on the CPU
    (`gen` is a CPU generator), moved by the caller."""
    cpu = dict(device="cpu")
    k_pos = torch.arange(N, dtype=torch.int32, **cpu).expand(B, N).contiguous()
    doc = torch.zeros(B, N, dtype=torch.int32, **cpu)
    for b in range(B):
        for cut in torch.randint(1, max(N, 2), (docs,), generator=gen, **cpu).tolist():
            doc[b, cut:] += 1
    k_doc = doc.clone()
    if masked:
        k_doc[torch.rand(B, N, generator=gen, **cpu) < 0.2] = -1
    q_pos, q_doc = k_pos[:, N - M :].clone(), doc[:, N - M :].clone()
    if permute:
        order = torch.randperm(M, generator=gen, **cpu)
        q_pos, q_doc = q_pos[:, order].contiguous(), q_doc[:, order].contiguous()
    return q_pos, q_doc, k_pos, k_doc


@st.composite
def attention_cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    return dict(
        B=draw(st.integers(1, 2)), H=kv_heads * draw(st.sampled_from([1, 2])), KH=kv_heads,
        N=draw(st.integers(1, 40)), D=draw(st.sampled_from([8, 16, 24])),
        dtype=draw(st.sampled_from(DTYPES)), causal=draw(st.booleans()),
        window=draw(st.sampled_from([None, 1, 5])), softcap=draw(st.sampled_from([None, 4.0])),
        docs=draw(st.integers(0, 2)), masked=draw(st.booleans()), permute=draw(st.booleans()),
        fewer_queries=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _tensors(case, gen):
    B, H, KH, N, D, dtype = (case[k] for k in ("B", "H", "KH", "N", "D", "dtype"))
    M = max(1, N // 2) if case["fewer_queries"] else N
    q = torch.randn(B, M, H, D, generator=gen).to(dtype).transpose(1, 2)  # HF's (B, H, S, D) view
    k, v = (torch.randn(B, KH, N, D, generator=gen).to(dtype) for _ in range(2))
    do = torch.randn(B, H, M, D, generator=gen).to(dtype)
    return (
        q,
        k,
        v,
        do,
        metadata(B, M, N, case["docs"], case["masked"], case["permute"], torch.Generator().manual_seed(case["seed"])),
    )


def _opts(case):
    return dict(causal=case["causal"], window=case["window"], softcap=case["softcap"])


@settings(max_examples=examples(25), deadline=None)
@given(attention_cases())
def test_kernel_matches_reference(case):
    gen = kernel_generator(case["seed"])
    q, k, v, do, meta = _tensors(case, gen)
    meta = tuple(t.to(q.device) for t in meta)
    o, lse = flash_attention(q, k, v, *meta, **_opts(case))
    o_ref, lse_ref = flash_attention_ref(q, k, v, *meta, **_opts(case))
    assert_close(o, o_ref)
    seen = torch.isfinite(lse_ref)
    assert torch.equal(seen, torch.isfinite(lse)) and (o[~seen[..., None].expand_as(o)] == 0).all()
    assert_close(lse[seen], lse_ref[seen])
    grads = flash_attention_backward(do, q, k, v, o_ref, lse_ref, *meta, **_opts(case))
    want = flash_attention_backward_ref(do, q, k, v, o_ref, lse_ref, *meta, **_opts(case))
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        # fp32 gradients of low-precision inputs: compared at the inputs' tolerance
        assert_close(got.to(q.dtype), ref.to(q.dtype), msg=lambda m, n=name: f"{n}: {m}")


def allowed_pairs(q_pos, q_doc, k_pos, k_doc, causal, window):
    """(B, M, N) bool: the reference's rule, token by token."""
    ok = q_doc[:, :, None] == k_doc[:, None, :]
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    if causal:
        ok &= diff >= 0
    if window is not None:
        ok &= diff.abs() < window
    return ok


@settings(max_examples=examples(60), deadline=None)
@given(attention_cases(), st.sampled_from([(16, 16), (16, 32), (32, 16)]))
def test_tile_kinds_agree_with_the_pairs(case, blocks):
    """A whole tile (run without a mask) has every pair allowed and every token real; a skipped
    tile has no pair allowed; the lists visit every tile that is not skipped, whole ones first."""
    from tplayers.kernels.flash_attention_ref import tile_kinds, tile_lists

    B, N = case["B"], case["N"]
    M = max(1, N // 2) if case["fewer_queries"] else N
    meta = metadata(B, M, N, case["docs"], case["masked"], case["permute"], torch.Generator().manual_seed(case["seed"]))
    bm, bn = blocks
    kinds = tile_kinds(*meta, bm, bn, case["causal"], case["window"])
    ok = allowed_pairs(*meta, case["causal"], case["window"])
    tiles = F.pad(ok, (0, -N % bn, 0, -M % bm)).view(B, (M + bm - 1) // bm, bm, (N + bn - 1) // bn, bn)
    any_pair, every_pair = tiles.any(-1).any(-2), tiles.all(-1).all(-2)
    assert ((kinds == 0) <= every_pair).all() and ((kinds == 2) <= ~any_pair).all()
    order, whole, meet = tile_lists(kinds)
    assert torch.equal(whole, (kinds == 0).sum(-1, dtype=torch.int32))
    for b in range(B):
        for row in range(kinds.shape[1]):
            visited = order[b, row, : meet[b, row]].long()
            assert torch.equal(visited.sort().values, (kinds[b, row] <= 1).nonzero().flatten())
            assert (kinds[b, row, visited[: whole[b, row]]] == 0).all()


@settings(max_examples=examples(40), deadline=None)
@given(attention_cases(), st.sampled_from([(16, 16), (16, 32), (32, 16), (64, 16)]))
def test_tile_schedule_is_the_torch_lists(case, blocks):
    """The one-launch schedule (tile_schedule) visits what tile_lists(tile_kinds(...)) does, in the
    same order, per query tile (forward, dQ) and per key tile (dK / dV)."""
    from tplayers.kernels.flash_attention import tile_schedule
    from tplayers.kernels.flash_attention_ref import tile_kinds, tile_lists

    B, N = case["B"], case["N"]
    M = max(1, N // 2) if case["fewer_queries"] else N
    gen = torch.Generator().manual_seed(case["seed"])
    q_pos, q_doc, k_pos, k_doc = (t.to(torch.get_default_device()) for t in metadata(
        B, M, N, case["docs"], case["masked"], case["permute"], gen))  # fmt: skip
    bm, bn = blocks
    kinds = tile_kinds(q_pos, q_doc, k_pos, k_doc, bm, bn, case["causal"], case["window"])
    for rows_are_queries, want in ((True, kinds), (False, kinds.transpose(1, 2))):
        order, whole, meet = tile_lists(want)
        if rows_are_queries:
            got = tile_schedule(q_pos, q_doc, k_pos, k_doc, bm, bn, case["causal"], case["window"])
        else:
            got = tile_schedule(k_pos, k_doc, q_pos, q_doc, bn, bm, case["causal"], case["window"], False)
        assert torch.equal(got[1], whole) and torch.equal(got[2], meet)
        for b in range(B):
            for row in range(want.shape[1]):
                n = meet[b, row]
                assert torch.equal(got[0][b, row, :n], order[b, row, :n]), (rows_are_queries, b, row)


def test_whole_tiles_of_a_long_causal_sequence():
    """Causal attention over 80 contiguous tokens (tiles of 16 in the interpreter): most tiles run
    whole, without a mask, and forward and backward still match the reference; a window of 40
    leaves whole tiles inside it too."""
    from tplayers.kernels.flash_attention_ref import tile_kinds

    gen = kernel_generator(7)
    B, H, KH, N, D = 1, 2, 1, 80, 16
    q = torch.randn(B, H, N, D, generator=gen)
    k, v = (torch.randn(B, KH, N, D, generator=gen) for _ in range(2))
    do = torch.randn(B, H, N, D, generator=gen)
    pos = torch.arange(N, dtype=torch.int32, device=q.device).expand(B, N).contiguous()
    doc = torch.zeros(B, N, dtype=torch.int32, device=q.device)
    for window in (None, 40):
        assert (tile_kinds(pos, doc, pos, doc, 16, 16, True, window) == 0).sum() >= 4
        o, lse = flash_attention(q, k, v, pos, doc, pos, doc, window=window)
        o_ref, lse_ref = flash_attention_ref(q, k, v, pos, doc, pos, doc, window=window)
        assert_close(o, o_ref)
        assert_close(lse, lse_ref)
        grads = flash_attention_backward(do, q, k, v, o_ref, lse_ref, pos, doc, pos, doc, window=window)
        want = flash_attention_backward_ref(do, q, k, v, o_ref, lse_ref, pos, doc, pos, doc, window=window)
        for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
            assert_close(got, ref, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 3])
def test_reference_matches_sdpa(dtype, window):
    """The reference (contiguous tokens, one document) is torch's causal SDPA with HF's window."""
    gen = kernel_generator(1)
    B, H, KH, S, D = 2, 4, 2, 11, 8
    q = torch.randn(B, H, S, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, KH, S, D, generator=gen).to(dtype) for _ in range(2))
    pos = torch.arange(S, dtype=torch.int32).expand(B, S).contiguous()
    doc = torch.zeros(B, S, dtype=torch.int32)
    o, _ = flash_attention_ref(q, k, v, pos, doc, pos, doc, window=window)
    i = torch.arange(S, device=q.device)
    allowed = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
    want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1),
                                          v.float().repeat_interleave(2, 1), attn_mask=allowed)  # fmt: skip
    assert_close(o, want.to(dtype))


def test_backward_of_one_block_given_the_merged_softmax():
    """Two key blocks attended apart, merged; each block's backward with the merged o / lse sums to
    the whole attention's gradient (what a context-parallel ring relies on)."""
    gen = kernel_generator(5)
    B, H, KH, N, D = 1, 2, 1, 24, 16
    q = torch.randn(B, H, N, D, generator=gen)
    k, v = (torch.randn(B, KH, N, D, generator=gen) for _ in range(2))
    do = torch.randn(B, H, N, D, generator=gen)
    pos = torch.arange(N, dtype=torch.int32, device=q.device).expand(B, N).contiguous()
    doc = torch.zeros(B, N, dtype=torch.int32, device=q.device)
    o, lse = flash_attention(q, k, v, pos, doc, pos, doc)
    halves = (slice(0, 10), slice(10, N))
    total = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    for h in halves:
        dq, dk, dv = flash_attention_backward(do, q, k[:, :, h], v[:, :, h], o, lse, pos, doc, pos[:, h], doc[:, h])
        total[0] += dq
        total[1][:, :, h] += dk
        total[2][:, :, h] += dv
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attention_ref(*leaves, pos, doc, pos, doc)[0].backward(do)
    for got, leaf in zip(total, leaves, strict=True):
        assert_close(got, leaf.grad)


def test_bad_arguments_are_refused():
    q = torch.randn(1, 3, 4, 8)
    k = torch.randn(1, 2, 4, 8)
    meta = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="KH must divide H"):
        flash_attention_ref(q, k, k, meta, meta, meta, meta)
    with pytest.raises(ValueError, match="int32"):
        flash_attention_ref(q, q, q, meta.long(), meta, meta, meta)
