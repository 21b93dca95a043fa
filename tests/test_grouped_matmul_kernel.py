"""The Triton grouped GEMM (kernels/grouped_matmul.py) against its pure-torch reference, in
Triton's interpreter: forward with gather / scatter / SwiGLU / routing-weight epilogues, the
weight gradient, and the experts' MLP forward and backward; hypothesis over expert counts
(empty experts, none at all), row counts across tile boundaries and dtypes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tplayers.kernels.grouped_matmul import (
    INTERPRETER_BLOCK_M,
    grouped_matmul,
    grouped_mlp,
    grouped_weight_grad,
    tile_table,
)
from tplayers.kernels.grouped_matmul_ref import grouped_matmul_ref, grouped_weight_grad_ref

from tplayers.functional.dispatch import pairs as make_pairs
from tplayers.testing import assert_close, examples, kernel_generator

pytestmark = pytest.mark.kernel

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def draw_counts(data, most=5):
    experts = data.draw(st.integers(0, most), label="experts")
    # up to two tiles per expert: tiles never span two experts, the last one short
    return torch.tensor(data.draw(st.lists(st.integers(0, 2 * INTERPRETER_BLOCK_M + 1), min_size=experts,
                                           max_size=experts), label="counts"), dtype=torch.long)  # fmt: skip


@settings(max_examples=examples(12), deadline=None)
@given(st.data())
def test_forward_matches_the_reference(data):
    counts = draw_counts(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    swiglu, scaled, scattered = (data.draw(st.booleans(), label=k) for k in ("swiglu", "scale", "scatter"))
    gen = kernel_generator(data.draw(st.integers(0, 99), label="seed"))
    rows, k, n, pairs = 9, 24, 20, int(counts.sum())
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(counts.numel(), n, k, generator=gen).to(dtype)
    kw = dict(gather=torch.randint(0, rows, (pairs,), generator=gen), swiglu=swiglu)
    if scaled:
        kw["scale"] = torch.rand(pairs, generator=gen)
    if scattered:
        kw.update(scatter=torch.randperm(pairs + 3, generator=gen)[:pairs], out_rows=pairs + 3)
    assert_close(grouped_matmul(x, w, counts, **kw), grouped_matmul_ref(x, w, counts, **kw))


@settings(max_examples=examples(8), deadline=None)
@given(st.data())
def test_weight_gradient_matches_the_reference(data):
    counts = draw_counts(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    gen = kernel_generator(data.draw(st.integers(0, 99), label="seed"))
    pairs = int(counts.sum())
    x, dy = torch.randn(7, 20, generator=gen).to(dtype), torch.randn(pairs, 18, generator=gen).to(dtype)
    gather, scale = torch.randint(0, 7, (pairs,), generator=gen), torch.rand(pairs, generator=gen)
    expected = grouped_weight_grad_ref((dy.float() * scale[:, None]).to(dtype), x, counts, gather=gather)
    got = grouped_weight_grad((dy.float() * scale[:, None]).to(dtype), x, counts, gather=gather)
    assert got.dtype == torch.float32  # accumulated and returned in fp32; compared at the inputs' precision
    assert_close(got.to(dtype), expected.to(dtype), msg=str(dtype))


@settings(max_examples=examples(8), deadline=None)
@given(st.data())
def test_experts_mlp_forward_and_backward(data):
    """grouped_mlp (Triton forward and backward) against the reference path with autograd."""
    from tplayers.functional.experts import expert_mlp

    experts = data.draw(st.integers(1, 4), label="experts")
    top = data.draw(st.integers(1, min(2, experts)), label="k")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16]), label="dtype")
    gen = kernel_generator(data.draw(st.integers(0, 99), label="seed"))
    rows, hidden, f = data.draw(st.integers(0, 20), label="rows"), 16, 16
    local = torch.stack([torch.randperm(experts + 1, generator=gen)[:top] - 1 for _ in range(rows)]) if rows else (
        torch.zeros(0, top, dtype=torch.long))  # fmt: skip
    p = make_pairs(local, experts)
    x = torch.randn(rows, hidden, generator=gen).to(dtype).requires_grad_()
    gate_up = (torch.randn(experts, 2 * f, hidden, generator=gen) / 4).to(dtype).requires_grad_()
    down = (torch.randn(experts, hidden, f, generator=gen) / 4).to(dtype).requires_grad_()
    weights = torch.rand(rows, top, generator=gen).requires_grad_()
    grad = torch.randn(rows, hidden, generator=gen).to(dtype)
    inputs = (x, gate_up, down, weights)

    out = grouped_mlp(x, p.gather, p.scatter, top, p.counts, gate_up, down, weights[p.gather, p.pick])
    got = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    import tplayers

    tplayers.set_backend("torch")
    try:
        ref = expert_mlp(x, p, top, gate_up, down, weights[p.gather, p.pick], torch.nn.SiLU())
        expected = torch.autograd.grad(ref, inputs, grad, allow_unused=True)
    finally:
        tplayers.set_backend("auto")
    assert_close(out, ref)
    for name, a, b in zip(("x", "gate_up", "down", "weights"), got, expected, strict=True):
        b = torch.zeros_like(a) if b is None else b
        # at the compute dtype: the routing weights are fp32, their gradient comes from fp16 products
        assert_close(a.to(dtype), b.to(dtype), msg=lambda m, k=name: f"d{k}: {m}")


def test_tiles_never_span_two_experts():
    counts = torch.tensor([17, 0, 3, 33])
    expert, start, end = tile_table(counts, int(counts.sum()), 16)
    offsets = [0, 17, 17, 20, 53]
    for e, s, t in zip(expert.tolist(), start.tolist(), end.tolist(), strict=True):
        if s < t:
            assert offsets[e] <= s < t <= offsets[e + 1] and t == offsets[e + 1]
    covered = sum(min(16, t - s) for s, t in zip(start.tolist(), end.tolist(), strict=True) if s < t)
    assert covered == 53


def test_negative_control_a_wrong_expert_fails():
    counts = torch.tensor([20, 5])
    x, w = torch.randn(25, 16), torch.randn(2, 16, 16)
    swapped = grouped_matmul(x, w.flip(0), counts)
    with pytest.raises(AssertionError):
        assert_close(swapped, grouped_matmul_ref(x, w, counts))


@settings(max_examples=examples(6), deadline=None)
@given(st.data())
def test_grouped_mm_path_matches_the_reference(data):
    """The torch path of the experts' MLP through torch._grouped_mm (what `auto` weighs the kernel
    against on a GPU) against the reference GEMMs, forward and every gradient, in bf16; empty
    experts included. A wrong expert's weights fail it (negative control)."""
    from tplayers.functional.experts import grouped_mm_mlp

    experts = data.draw(st.integers(1, 4), label="experts")
    top = data.draw(st.integers(1, min(2, experts)), label="k")
    gen = kernel_generator(data.draw(st.integers(0, 99), label="seed"))
    rows, hidden, f = data.draw(st.integers(1, 20), label="rows"), 16, 16
    local = torch.stack([torch.randperm(experts + 1, generator=gen)[:top] - 1 for _ in range(rows)])
    p = make_pairs(local, experts)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).requires_grad_()
    gate_up = (torch.randn(experts, 2 * f, hidden, generator=gen) / 4).to(torch.bfloat16).requires_grad_()
    down = (torch.randn(experts, hidden, f, generator=gen) / 4).to(torch.bfloat16).requires_grad_()
    scale = torch.rand(p.gather.shape[0], generator=gen).requires_grad_()
    grad = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    inputs = (x, gate_up, down, scale)

    def reference(down):
        h = grouped_matmul_ref(x, gate_up, p.counts, gather=p.gather, swiglu=True)
        cells = grouped_matmul_ref(h, down, p.counts, scale=scale, scatter=p.scatter, out_rows=rows * top)
        return cells.view(rows, top, hidden).sum(1)

    out = grouped_mm_mlp(x, p.gather, p.scatter, top, p.counts, gate_up, down, scale)
    ref = reference(down)
    assert_close(out, ref)
    for name, a, b in zip(("x", "gate_up", "down", "scale"), torch.autograd.grad(out, inputs, grad),
                          torch.autograd.grad(ref, inputs, grad), strict=True):  # fmt: skip
        assert_close(a.to(torch.bfloat16), b.to(torch.bfloat16), msg=lambda m, k=name: f"d{k}: {m}")
    if experts > 1 and (p.counts > 0).sum() > 1:
        with pytest.raises(AssertionError):
            assert_close(out, reference(down.roll(1, dims=0)))
