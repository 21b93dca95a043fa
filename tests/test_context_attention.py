"""Context-parallel attention (ring, all-gather, Ulysses) against whole-sequence attention: output
and every gradient at CP 2, 3 and 4 over head-tail and per-document layouts, with GQA (fewer key /
value heads than ranks), sliding windows, softcapping, padding and sequences no rank count divides;
the ring's bytes; the layout itself."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tplayers.kernels.flash_attention_ref import flash_attention_ref

import tplayers
from tplayers.functional import comm
from tplayers.functional.context import AttentionOptions, context_attention, merge_partials
from tplayers.functional.context_layout import balanced_layout
from tplayers.testing import RemoteError, assert_close, examples


def _local(layout, t):
    """This rank's slots of a (B, H, S, D) tensor."""
    return layout.take(t.transpose(1, 2)).transpose(1, 2).contiguous()


def _case(seed, B, H, KH, S, D, dtype, docs, padding):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, h, S, D, generator=g).to(dtype) for h in (H, KH, KH, H))
    position_ids = mask = None
    if docs:  # packed documents of unequal lengths: positions restart at each
        cuts = sorted(torch.randperm(S - 1, generator=g)[: docs - 1].add(1).tolist())
        starts = torch.zeros(S, dtype=torch.long)
        starts[cuts] = 1
        doc = starts.cumsum(0)
        first = torch.tensor([0, *cuts])
        position_ids = (torch.arange(S) - first[doc]).expand(B, S).contiguous()
    if padding:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, S - padding :] = 0  # right padding
        mask[-1, :padding] = 0  # left padding
    return q, k, v, do, position_ids, mask


def _reference(q, k, v, do, layout_whole, opts, sinks=None):
    """Whole-sequence attention on one rank (fp64), the same metadata in the row's order; with
    `sinks`, each head's sink logit in the softmax as HF's eager gpt-oss has it (a column with no
    value: the output scaled by the keys' share, sigmoid(lse - sink))."""
    pos, q_doc, k_doc = layout_whole
    leaves = [t.double().requires_grad_() for t in (q, k, v, *([sinks] if sinks is not None else []))]
    o, lse = flash_attention_ref(*leaves[:3], pos, q_doc, pos, k_doc, **opts.kwargs())
    if sinks is not None:
        o = o * torch.sigmoid(lse - leaves[3][:, None]).unsqueeze(-1)
    o.backward(do.double())
    return o, *(t.grad for t in leaves)


def context_task(rank, world, group, method, seed, B, H, KH, S, D, dtype, docs, padding, window, softcap,
                 wrong=False, backend="torch", sinks=False):  # fmt: skip
    before = tplayers.backend.get_backend()
    tplayers.set_backend(backend)  # this task's only (the pool's workers serve later tests)
    try:
        return _context_task(rank, world, group, method, seed, B, H, KH, S, D, dtype, docs, padding, window, softcap,
                             wrong, sinks)  # fmt: skip
    finally:
        tplayers.set_backend(before)


def _context_task(rank, world, group, method, seed, B, H, KH, S, D, dtype, docs, padding, window, softcap, wrong,
                  with_sinks):  # fmt: skip
    q, k, v, do, position_ids, mask = _case(seed, B, H, KH, S, D, dtype, docs, padding)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(seed + 1)).to(dtype) if with_sinks else None
    layout = balanced_layout(B, S, world, rank, position_ids=position_ids, attention_mask=mask)
    if wrong:  # negative control: every rank's queries told they sit where the next rank's do
        layout.pos = layout.pos.roll(1, dims=1)
    opts = AttentionOptions(scale=D**-0.5, window=window, softcap=softcap)
    # the reference reads the same documents and padding, over the row in its own order
    whole = balanced_layout(B, S, 1, 0, position_ids=position_ids, attention_mask=mask)
    order = whole.inverse(S)
    meta = tuple(t[:, 0].gather(1, order) for t in (whole.pos, whole.q_doc, whole.k_doc))
    ref = _reference(q, k, v, do, meta, opts, sinks)
    leaves = [_local(layout, t).requires_grad_() for t in (q, k, v)]
    mine = sinks.clone().requires_grad_() if sinks is not None else None
    with comm.count_bytes() as sent:
        out = context_attention(*leaves, layout, group, opts, method, sinks=mine)
    with comm.count_bytes() as sent_backward:
        out.backward(_local(layout, do))
    real = (layout.index[:, rank] >= 0)[:, None, :, None]
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), ref, strict=False):
        want = _local(layout, want.to(got.dtype))
        assert_close(got * real, want * real, msg=f"{method} {name}")
    if sinks is not None:  # each rank's share of the sinks' gradient: its queries (ring) or heads (Ulysses)
        dsinks = mine.grad.clone()
        torch.distributed.all_reduce(dsinks, group=group)
        assert_close(dsinks, ref[4].to(dsinks.dtype), msg=f"{method} dsinks")
    return sent.by_axis()["cp"], sent_backward.by_axis()["cp"], layout.local_len


METHOD_CASES = [
    # method, cp, (B, H, KH, S, D), docs, padding, window, softcap
    ("ring", 2, (2, 4, 2, 12, 8), 0, 0, None, None),
    ("ring", 3, (1, 4, 1, 13, 8), 3, 0, None, None),  # uneven: 13 tokens, 3 documents, 1 kv head
    ("ring", 4, (2, 2, 1, 17, 4), 0, 3, 5, None),  # padding both ways, a window
    ("allgather", 2, (1, 4, 2, 10, 8), 2, 0, None, 7.0),  # softcap
    ("allgather", 3, (2, 3, 1, 11, 4), 0, 2, 4, None),
    ("ulysses", 2, (2, 4, 2, 12, 8), 3, 0, 6, None),
    ("ulysses", 4, (1, 8, 4, 9, 4), 0, 2, None, 5.0),
]


@pytest.mark.multirank
@pytest.mark.parametrize("case", METHOD_CASES, ids=[f"{c[0]}-cp{c[1]}" for c in METHOD_CASES])
def test_context_attention_equals_whole_sequence(pool, case):
    method, cp, shape, docs, padding, window, softcap = case
    pool.run(context_task, cp, method, 0, *shape, torch.float32, docs, padding, window, softcap)


SINK_CASES = [  # attention sinks (gpt-oss): the sink logit in every query's softmax
    ("ring", 3, (1, 4, 2, 13, 8), 2, 0, 4, None),  # documents and a window: some queries see few keys
    ("allgather", 2, (2, 4, 1, 10, 4), 0, 3, None, None),  # padding: a query that sees no key gets 0
    ("ulysses", 2, (1, 4, 2, 12, 8), 0, 0, 5, None),  # each rank's share of the heads' sinks
]


@pytest.mark.multirank
@pytest.mark.parametrize("case", SINK_CASES, ids=[f"{c[0]}-cp{c[1]}" for c in SINK_CASES])
def test_context_attention_with_sinks_equals_whole_sequence(pool, case):
    method, cp, shape, docs, padding, window, softcap = case
    pool.run(context_task, cp, method, 2, *shape, torch.float32, docs, padding, window, softcap, False, "torch",
             True)  # fmt: skip


@pytest.mark.multirank
@settings(max_examples=examples(4), deadline=None)
@given(
    method=st.sampled_from(["ring", "allgather", "ulysses"]), cp=st.sampled_from([2, 3, 4]),
    S=st.integers(4, 20), kv_heads=st.sampled_from([1, 2, 4]), docs=st.integers(0, 3),
    window=st.sampled_from([None, 3]), dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 99),
)  # fmt: skip
def test_context_attention_property(pool, method, cp, S, kv_heads, docs, window, dtype, seed):
    heads = 4 if method != "ulysses" else 4 * cp
    kv = kv_heads if method != "ulysses" else cp
    pool.run(context_task, cp, method, seed, 1, heads, kv, S, 4, dtype, min(docs, S - 1), 0, window, None)


@pytest.mark.multirank
@pytest.mark.interpreter
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_attention_through_the_triton_kernel(pool, method):
    """The Triton flash-attention kernel (in the interpreter here) under each hop: fp16, GQA,
    documents, padding and a window, at CP 2."""
    pool.run(context_task, 2, method, 4, 1, 4, 2, 19, 8, torch.float16, 2, 2, 6, None, False, "triton")


@pytest.mark.multirank
def test_ring_bytes_are_kv_blocks_only(pool):
    """(cp - 1) hops of this rank's K / V, never expanded to the query heads, plus cp hops of their
    fp32 gradients in backward."""
    B, H, KH, S, D, cp = 1, 8, 1, 16, 8, 4
    results = pool.run(context_task, cp, "ring", 1, B, H, KH, S, D, torch.float32, 0, 0, None, None)
    for sent, sent_backward, local_len in results:
        block = 2 * B * KH * local_len * D * 4  # fp32 K and V
        assert sent == (cp - 1) * block and sent_backward == (cp - 1) * block + cp * block, (sent, block)


@pytest.mark.multirank
def test_a_wrong_layout_fails_the_comparison(pool):
    replies = pool.run(context_task, 2, "ring", 0, 1, 2, 1, 12, 4, torch.float32, 0, 0, None, None, True,
                       return_exceptions=True)  # fmt: skip
    assert all(isinstance(r, RemoteError) and "ring out" in r.message for r in replies), replies


def test_layout_head_tail_and_documents():
    layout = balanced_layout(1, 8, 2, 0)
    assert layout.index[0].tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    # two documents of 5 and 3: each split head-tail on its own; ranks padded to one length
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    layout = balanced_layout(1, 8, 2, 1, position_ids=pos, multiple=3)
    assert layout.index[0].tolist() == [[0, 1, 4, 5, -1, -1], [2, 3, 6, 7, -1, -1]]
    assert layout.q_doc[0].tolist() == [[0, 0, 0, 1, -2, -2], [0, 0, 1, 1, -2, -2]]
    assert layout.k_doc[0, 1].tolist() == [0, 0, 1, 1, -1, -1]
    inv = layout.inverse(8)
    assert layout.index.flatten(1).gather(1, inv).tolist() == [list(range(8))]


def test_merge_partials_is_the_softmax_over_both():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 10, generator=g)
    s[2] = float("-inf")  # a row that sees nothing anywhere
    v = torch.randn(10, 4, generator=g)

    def part(cols):
        sub = s[:, cols]
        lse = torch.logsumexp(sub, -1)
        p = torch.exp(sub - torch.where(torch.isinf(lse), 0, lse)[:, None])
        return p @ v[cols], lse

    o, lse = merge_partials(*part(slice(0, 4)), *part(slice(4, 10)))
    want, want_lse = part(slice(0, 10))
    torch.testing.assert_close(o, want)
    torch.testing.assert_close(lse, want_lse)
    assert o[2].abs().sum() == 0
