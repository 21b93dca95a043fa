"""Benchmark: every Triton kernel in kernels/ against torch's own op, on one CUDA GPU.

Pairs, each checked (the Triton result against torch's, with tplayers.tolerances' table for the
dtype of torch's output) and then timed with triton.testing.do_bench (median):
    matmul              matmul(a, w, epilogue) against F.linear with the epilogue in torch ops:
                        plain, bias + gelu_tanh, bias + silu + residual, and the fused SwiGLU
                        output (F.linear, then silu(y[:, 0::2]) * y[:, 1::2]); bf16 and fp16
    swiglu              swiglu(gate, up) on the halves of one [gate | up] buffer against
                        F.silu(gate) * up; swiglu_backward on ParallelMLP's interleaved columns
                        against what autograd runs (dh * silu(g), aten.silu_backward(dh * u, g))
    grad_stats          unscale_and_stats_ over the gradients of a ~100M-parameter decoder
                        against torch's unscale op and its multi-tensor vector norms (p = 1, 2,
                        inf: torch._foreach_norm) with the isfinite check, i.e.
                        unscale_and_stats_ref; fp32 and fp16 (torch's unscale op has no CUDA
                        bf16 kernel); checked with inv_scale 2**-16, timed with 1.0 so that
                        repeated calls leave the gradients as they were
    vocab_ce            vocab_ce_stats + the loss from its columns against F.cross_entropy
                        (reduction="none", label smoothing 0.1: every column is used)
    grouped_matmul      the experts' gate|up GEMM with the SwiGLU epilogue, rows read through
                        the pairs' gather index, against torch's grouped GEMM
                        (torch._grouped_mm on the gathered rows, then silu(gate) * up) and
                        against a loop of F.linear per expert; the down GEMM with the routing
                        weight scale, written through the scatter index, likewise; and the
                        experts' MLP forward + backward (grouped_mlp) against the loop under
                        autograd, both judged by their distance from an fp64 run (the
                        gradients sum thousands of rows). Shapes of Qwen3-30B-A3B and DeepSeek-V3 experts at EP 8 and
                        of Mixtral's at EP 1, random balanced routing, top 2 of the rank's experts
torch runs each op in the inputs' dtype, as eager code does.

On a GPU it first runs the suite's kernel tests there (`pytest -m kernel tests/` with
TPLAYERS_TEST_DEVICE=cuda: every kernel against its reference over the tests' hypothesis shapes,
dtypes and layouts, compiled instead of interpreted; `--no-tests` skips them) and writes their
summary to <out>/kernel_tests.txt.

    python bench/kernels.py [--quick] [--no-tests] [--only matmul flash_attention ...] [--out bench/out/kernels]
    (or: tplayers bench --kernels)

Each row also says which path backend="auto" takes there (tplayers.backend: measured on
first use, the kernel only where faster than torch's op) and that path's time over torch's.
Writes <out>/kernels.csv and <out>/kernels.png (triton / torch time per pair) and prints a
table. Ratios below 1 favour Triton. TFLOP/s counts 2 M N K per GEMM; GB/s counts the least
traffic of the op (each input read once, each output written once), the same bytes for both
providers. Without a CUDA GPU it says so and runs the same cases on tiny shapes in Triton's
interpreter (a check of the kernels and of this script; the times mean nothing). Exits 1 if a
pair disagrees beyond the tolerance.
"""

import argparse
import importlib.util
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def _import_from_checkout():
    """Make tplayers importable from this checkout when it is not installed (`python
    bench/kernels.py`, or PYTHONPATH=.): the repo root on sys.path, and tplayers.kernels, which
    setuptools maps from the top-level kernels/ (package-dir), loaded from there under its
    installed name. Not as `kernels`: this script's own folder comes first on sys.path."""
    if importlib.util.find_spec("tplayers") is None:
        sys.path.insert(0, str(ROOT))
    if importlib.util.find_spec("tplayers.kernels") is not None:
        return
    spec = importlib.util.spec_from_file_location(
        "tplayers.kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["tplayers.kernels"] = module
    spec.loader.exec_module(module)


_import_from_checkout()

from amp import Decoder, version  # noqa: E402  (bench/amp.py: the gradient list of a decoder, versions)
from linear import figure, save_figure, write_csv  # noqa: E402  (bench/linear.py: CSV, figures)
from tplayers.kernels.grad_stats_ref import unscale_and_stats_ref  # noqa: E402
from tplayers.kernels.vocab_ce_ref import MAX, SUM, SUMEXP, TARGET  # noqa: E402

from tplayers.tolerances import tolerance  # noqa: E402


@dataclass(frozen=True)
class Shapes:
    gemms: tuple  # (M, N, K): a (M, K) @ w (N, K)^T
    swiglu: tuple  # (M, N): tokens, FFN columns per rank
    grads: Decoder  # whose parameters' gradients grad_stats reads
    vocab: tuple  # (R, V): rows (tokens), vocabulary
    grouped: tuple  # (P, E, H, F): (token, expert) pairs, experts, hidden, expert width
    warmup_ms: int  # do_bench's warmup and rep, per provider of each pair
    rep_ms: int
    attention: tuple = ((1, 2, 1, 48, 16),)  # (B, H, KH, S, D): causal attention, GQA


SHAPES = Shapes(
    # square GEMMs, and a Llama-7B MLP up-projection at TP 2 (ffn 11008 / 2: N is no power of 2)
    gemms=((4096, 4096, 4096), (8192, 8192, 8192), (8192, 5504, 4096)),
    swiglu=((8192, 14336), (16384, 5504)),
    grads=Decoder("100m", hidden=768, layers=8, ffn=2048, kv_hidden=768, vocab=32000),  # 105.8M elements
    vocab=((8192, 32000), (4096, 128256)),  # Llama 2 and Llama 3 vocabularies
    # Qwen3-30B-A3B (128 experts of 768) and DeepSeek-V3 (256 of 2048) at EP 8; Mixtral (8 of 14336)
    grouped=((16384, 16, 2048, 768), (16384, 32, 7168, 2048), (8192, 8, 4096, 14336)),
    warmup_ms=10,
    rep_ms=50,
    # Llama-3-8B's attention (32 / 8 heads of 128) at TP 2 over 4096 tokens; 32 / 8 heads of 64 (the fp64
    # check of longer sequences would not fit)
    attention=((1, 16, 4, 4096, 128), (1, 32, 8, 4096, 64)),
)
QUICK_SHAPES = Shapes(
    gemms=((1024, 1536, 512),),
    swiglu=((1024, 2048),),
    grads=Decoder("tiny", hidden=128, layers=2, ffn=344, kv_hidden=64, vocab=4096),
    vocab=((1024, 32000),),
    grouped=((2048, 8, 512, 256),),
    warmup_ms=5,
    rep_ms=10,
    attention=((1, 8, 2, 1024, 64),),
)
# Without a GPU: the same cases in Triton's interpreter, shapes it runs in seconds
INTERPRETER_SHAPES = Shapes(
    gemms=((32, 48, 16),),
    swiglu=((8, 32),),
    grads=Decoder("tiny", hidden=16, layers=1, ffn=32, kv_hidden=8, vocab=50),
    vocab=((8, 100),),
    grouped=((24, 3, 16, 8),),
    warmup_ms=0,
    rep_ms=0,
)
GEMM_DTYPES = (torch.bfloat16, torch.float16)
# name -> (bias, activation, residual, swiglu): the fused epilogues of kernels/matmul.py
EPILOGUES = {
    "": (False, None, False, False),
    "+bias+gelu_tanh": (True, "gelu_tanh", False, False),
    "+bias+silu+residual": (True, "silu", True, False),
    "+swiglu": (False, None, False, True),
}
# torch's unscale op (torch._amp_foreach_non_finite_check_and_unscale_) has no CUDA bf16 kernel
# (torch 2.11): with bf16 gradients there is no torch op to compare against.
GRAD_DTYPES = (torch.float32, torch.float16)
LABEL_SMOOTHING = 0.1
NO_GPU = (
    "no CUDA GPU is visible (torch.cuda.is_available() is False): running the same checks on tiny shapes in "
    "Triton's interpreter instead; its times are numpy's, not Triton's, and say nothing about a GPU"
)
LOSS_SCALE = 2.0**16
KERNELS = ("matmul", "swiglu", "grad_stats", "vocab_ce", "grouped_matmul", "flash_attention")  # cases() order
FIELDS = (
    "kernel", "op", "provider", "dtype", "shape", "time_ms", "tflops", "gbps", "ratio_to_torch", "max_abs_err",
    "err_over_tol", "ok", "auto_path", "auto_ratio_to_torch", "device", "torch", "triton",
)  # fmt: skip


@dataclass
class Pair:
    """The two providers of one case: each call runs the op once and returns its outputs."""

    triton: Callable
    torch: Callable
    before_timing: Callable = lambda: None  # e.g. make an in-place op repeatable
    # For long reductions in low precision (gradients summed over thousands of rows) both sides
    # are off by more than the dtype's tolerance: each is then measured against this fp64 run.
    fp64: Callable | None = None
    # Whether backend="auto" runs the kernel here (tplayers.backend, measured on first use);
    # ops it does not measure keep their kernel on a GPU
    auto_runs_kernel: Callable = lambda: True


@dataclass(frozen=True)
class Case:
    kernel: str  # the module in kernels/
    op: str  # what is timed
    dtype: torch.dtype
    shape: str
    build: Callable  # (impl, device) -> Pair; impl: the Triton launchers (or, on CPU, the references)
    flops: float = 0.0  # per call, for TFLOP/s
    nbytes: float = 0.0  # per call, least traffic, for GB/s


def _size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


# ---- the pairs ------------------------------------------------------------------------------


def gemm_pair(M, N, K, dtype, epilogue, impl, device):
    has_bias, activation, has_residual, swiglu = EPILOGUES[epilogue]
    gen = torch.Generator(device=device).manual_seed(0)
    a = _randn((M, K), dtype, device, gen)
    w = _randn((N, K), dtype, device, gen, scale=K**-0.5)  # outputs ~ N(0, 1), as a trained layer's
    bias = _randn((N,), dtype, device, gen) if has_bias else None
    residual = _randn((M, N), dtype, device, gen) if has_residual else None
    act = {None: lambda y: y, "gelu_tanh": partial(F.gelu, approximate="tanh"), "silu": F.silu}[activation]

    def triton_fn():
        if swiglu:
            h = torch.empty((M, N // 2), device=device, dtype=dtype)
            return impl.matmul(a, w, swiglu_out=h), h
        return impl.matmul(a, w, bias=bias, activation=activation, residual=residual)

    def torch_fn():
        y = act(F.linear(a, w, bias))
        if swiglu:  # the fused GEMM's columns alternate gate, up
            return y, F.silu(y[:, 0::2]) * y[:, 1::2]
        return y + residual if has_residual else y

    def auto_runs_kernel():
        from tplayers.backend import _gemm_key, kernel_is_faster

        h = torch.empty((M, N // 2), device=device, dtype=dtype) if swiglu else None
        epilogue = dict(bias=bias, activation=activation, residual=residual, swiglu_out=h)
        return kernel_is_faster("gemm", _gemm_key(a, w, epilogue), dtype, a.device)

    return Pair(triton_fn, torch_fn, auto_runs_kernel=auto_runs_kernel)


def swiglu_pair(M, N, dtype, impl, device):
    gen = torch.Generator(device=device).manual_seed(0)
    y = _randn((M, 2 * N), dtype, device, gen)
    gate, up = y[:, :N], y[:, N:]  # the halves of one [gate | up] GEMM output, read in place
    return Pair(lambda: impl.swiglu(gate, up), lambda: F.silu(gate) * up)


def swiglu_backward_pair(M, N, dtype, impl, device):
    gen = torch.Generator(device=device).manual_seed(0)
    y = _randn((M, 2 * N), dtype, device, gen)
    dh = _randn((M, N), dtype, device, gen)
    gate, up = y[:, 0::2], y[:, 1::2]  # ParallelMLP's interleaved columns
    dy = torch.empty_like(y)

    def triton_fn():
        return impl.swiglu_backward(dh, gate, up, dgate=dy[:, 0::2], dup=dy[:, 1::2])

    def torch_fn():  # what autograd runs for F.silu(gate) * up
        return torch.ops.aten.silu_backward(dh * up, gate), dh * F.silu(gate)

    return Pair(triton_fn, torch_fn)


def grad_stats_pair(decoder, dtype, impl, device):
    gen = torch.Generator(device=device).manual_seed(0)
    # Gradients of a loss scaled by 2**16 (as bench/amp.py): ~65 in magnitude, fine in fp16.
    grads = [_randn(shape, dtype, device, gen, scale=1e-3 * LOSS_SCALE) for shape in decoder.shapes()]
    mine = [g.clone() for g in grads]  # each provider unscales its own copy
    inv_scale = torch.full((1,), 1 / LOSS_SCALE, device=device)

    def triton_fn():
        return (*impl.unscale_and_stats_(mine, inv_scale), *mine)

    def torch_fn():
        return (*unscale_and_stats_ref(grads, inv_scale), *grads)

    return Pair(triton_fn, torch_fn, before_timing=lambda: inv_scale.fill_(1.0))


def vocab_ce_pair(R, V, dtype, impl, device):
    gen = torch.Generator(device=device).manual_seed(0)
    logits = _randn((R, V), dtype, device, gen, scale=2.0)
    target = torch.randint(V, (R,), generator=gen, device=device)
    eps = LABEL_SMOOTHING

    def triton_fn():
        stats = impl.vocab_ce_stats(logits, target)
        lse = stats[:, MAX] + stats[:, SUMEXP].log()
        return (1 - eps) * (lse - stats[:, TARGET]) + eps * (lse - stats[:, SUM] / V)

    def torch_fn():
        return F.cross_entropy(logits, target, reduction="none", label_smoothing=eps)

    return Pair(triton_fn, torch_fn)


def _routing(P, E, device, gen):
    """P pairs over E experts at random (balanced on average), sorted by expert; each of the P / 2
    tokens picked by two of them."""
    expert = torch.randint(E, (P,), generator=gen, device=device).sort().values
    counts = torch.bincount(expert, minlength=E)
    gather = torch.randint(P // 2, (P,), generator=gen, device=device)
    return counts, gather


def _per_expert(x, counts, fn):
    """fn(e, rows of expert e) for each expert, concatenated: the loop MoE code writes."""
    return torch.cat([fn(e, part) for e, part in enumerate(x.split(counts.tolist()))])


def grouped_pair(P, E, H, F_, dtype, impl, device, *, op, baseline):
    gen = torch.Generator(device=device).manual_seed(0)
    counts, gather = _routing(P, E, device, gen)
    offs = counts.cumsum(0).to(torch.int32)
    if op == "gate_up+swiglu":
        x = _randn((P // 2, H), dtype, device, gen)
        w = _randn((E, 2 * F_, H), dtype, device, gen, scale=H**-0.5)

        def triton_fn():
            return impl.grouped_matmul(x, w, counts, gather=gather, swiglu=True)

        def torch_fn():
            rows = x[gather]
            if baseline == "_grouped_mm":
                y = torch._grouped_mm(rows, w.transpose(1, 2), offs=offs)
            else:
                y = _per_expert(rows, counts, lambda e, r: F.linear(r, w[e]))
            return F.silu(y[:, :F_]) * y[:, F_:]

        return Pair(triton_fn, torch_fn)
    h = _randn((P, F_), dtype, device, gen)
    w = _randn((E, H, F_), dtype, device, gen, scale=F_**-0.5)
    scale = torch.rand(P, generator=gen, device=device)
    scatter = torch.randperm(P, generator=gen, device=device)

    def triton_down():
        return impl.grouped_matmul(h, w, counts, scale=scale, scatter=scatter, out_rows=P)

    def torch_down():
        if baseline == "_grouped_mm":
            y = torch._grouped_mm(h, w.transpose(1, 2), offs=offs)
        else:
            y = _per_expert(h, counts, lambda e, r: F.linear(r, w[e]))
        out = torch.zeros_like(y)
        out[scatter] = (y.float() * scale[:, None]).to(dtype)
        return out

    return Pair(triton_down, torch_down)


def grouped_mlp_pair(P, E, H, F_, dtype, impl, device):
    """The experts' MLP forward and backward (every gradient) against the loop under autograd."""
    gen = torch.Generator(device=device).manual_seed(0)
    counts, _ = _routing(P, E, device, gen)
    rows, k = P // 2, 2
    scatter = torch.randperm(rows * k, generator=gen, device=device)[:P]  # each pair's (row, pick) cell
    gather = scatter // k  # read from the row it is written to
    x = _randn((rows, H), dtype, device, gen).requires_grad_()
    gate_up = _randn((E, 2 * F_, H), dtype, device, gen, scale=H**-0.5).requires_grad_()
    down = _randn((E, H, F_), dtype, device, gen, scale=F_**-0.5).requires_grad_()
    scale = torch.rand(P, generator=gen, device=device).requires_grad_()
    dout = _randn((rows, H), dtype, device, gen)
    inputs = (x, gate_up, down, scale)

    def triton_fn():
        out = impl.grouped_mlp(x, gather, scatter, k, counts, gate_up, down, scale)
        return (out, *(g.to(dtype) for g in torch.autograd.grad(out, inputs, dout)))  # scale's at the compute dtype

    def loop(x, gate_up, down, scale, dout):
        def expert(e, r):
            gate, up = F.linear(r, gate_up[e]).chunk(2, -1)
            return F.linear(F.silu(gate) * up, down[e])

        y = _per_expert(x[gather], counts, expert) * scale[:, None].to(x.dtype)
        out = y.new_zeros(rows * k, H).index_copy(0, scatter, y).view(rows, k, H).sum(1)
        return (out, *(g.to(x.dtype) for g in torch.autograd.grad(out, (x, gate_up, down, scale), dout)))

    def fp64_fn():
        leaves = [t.detach().double().requires_grad_() for t in inputs]
        return loop(*leaves, dout.double())

    return Pair(triton_fn, lambda: loop(*inputs, dout), fp64=fp64_fn)


def attention_pair(B, H, KH, S, D, dtype, impl, device, *, backward):
    """Causal GQA attention (and its backward: dq, dk, dv) against torch's SDPA (flash / efficient
    kernels, under autograd), checked against an fp64 SDPA run."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = _randn((B, H, S, D), dtype, device, gen).requires_grad_()
    k, v = (_randn((B, KH, S, D), dtype, device, gen).requires_grad_() for _ in range(2))
    do = _randn((B, H, S, D), dtype, device, gen)
    pos = torch.arange(S, dtype=torch.int32, device=device).expand(B, S).contiguous()
    doc = torch.zeros(B, S, dtype=torch.int32, device=device)

    def triton_fn():
        o, lse = impl.flash_attention(q, k, v, pos, doc, pos, doc)
        if not backward:
            return o
        return (o, *(g.to(dtype) for g in impl.flash_attention_backward(do, q, k, v, o, lse, pos, doc, pos, doc)))

    def sdpa(q, k, v, do):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return (o, *torch.autograd.grad(o, (q, k, v), do)) if backward else o

    def fp64_fn():
        return sdpa(*(t.detach().double().requires_grad_() for t in (q, k, v)), do.double())

    def auto_runs_kernel():  # nn.ParallelAttention's choice, measured forward + backward
        from tplayers.backend import kernel_is_faster, token_bucket
        from tplayers.nn import attention  # noqa: F401 -- registers its recipe

        return kernel_is_faster("attention", (token_bucket(B * S), H, KH, token_bucket(S), D, 1, 0), dtype, q.device)

    return Pair(triton_fn, lambda: sdpa(q, k, v, do), fp64=fp64_fn, auto_runs_kernel=auto_runs_kernel)


def cases(shapes):
    """Every pair of `shapes`, in the order they run."""
    out = []
    for dtype in GEMM_DTYPES:
        for epilogue in EPILOGUES:
            for M, N, K in shapes.gemms:
                out.append(Case("matmul", f"matmul{epilogue}", dtype, f"M{M} N{N} K{K}",
                                partial(gemm_pair, M, N, K, dtype, epilogue), flops=2.0 * M * N * K))  # fmt: skip
    # reads + writes of (M, N) tensors: forward gate, up -> h; backward dh, gate, up -> dgate, dup
    for op, pair, passes in (("swiglu", swiglu_pair, 3), ("swiglu_backward", swiglu_backward_pair, 5)):
        for dtype in GEMM_DTYPES:
            for M, N in shapes.swiglu:
                nbytes = passes * M * N * _size(dtype)
                out.append(Case("swiglu", op, dtype, f"M{M} N{N}", partial(pair, M, N, dtype), nbytes=nbytes))
    numel = sum(torch.Size(s).numel() for s in shapes.grads.shapes())
    for dtype in GRAD_DTYPES:
        out.append(Case(
            "grad_stats", "unscale_and_stats_", dtype, f"{len(shapes.grads.shapes())} tensors, {numel / 1e6:.1f}M",
            partial(grad_stats_pair, shapes.grads, dtype), nbytes=2 * numel * _size(dtype),
        ))  # fmt: skip
    for dtype in (torch.bfloat16, torch.float32):
        for R, V in shapes.vocab:
            out.append(Case("vocab_ce", "vocab_ce_stats+loss", dtype, f"R{R} V{V}", partial(vocab_ce_pair, R, V, dtype),
                            nbytes=R * V * _size(dtype)))  # fmt: skip
    for dtype in GEMM_DTYPES:
        for P, E, H, F_ in shapes.grouped:
            shape = f"P{P} E{E} H{H} F{F_}"
            for op, flops in (("gate_up+swiglu", 4.0 * P * H * F_), ("down+scale+scatter", 2.0 * P * H * F_)):
                for baseline in ("_grouped_mm", "loop"):
                    build = partial(grouped_pair, P, E, H, F_, dtype, op=op, baseline=baseline)
                    out.append(Case("grouped_matmul", f"{op} vs {baseline}", dtype, shape, build, flops=flops))
            out.append(Case("grouped_matmul", "grouped_mlp fwd+bwd vs loop", dtype, shape,
                            partial(grouped_mlp_pair, P, E, H, F_, dtype), flops=18.0 * P * H * F_))  # fmt: skip
    for dtype in GEMM_DTYPES:
        for B, H, KH, S, D in shapes.attention:
            causal = 2.0 * B * H * S * S * D  # q k^T and p v over half the square
            for op, backward, flops in (("flash_attention vs sdpa", False, causal),
                                        ("flash_attention fwd+bwd vs sdpa", True, 3.5 * causal)):  # fmt: skip
                build = partial(attention_pair, B, H, KH, S, D, dtype, backward=backward)
                out.append(Case("flash_attention", op, dtype, f"B{B} H{H} KH{KH} S{S} D{D}", build, flops=flops))
    return out


# ---- checking, timing, rows -----------------------------------------------------------------


def _outputs(result):
    return result if isinstance(result, tuple | list) else (result,)


def compare(got, want):
    """(max |got - want|, max |got - want| / (atol + rtol |want|)) over every pair of outputs, with
    the tolerance of want's dtype; equal values (infs, and nan on both sides) count as equal, nan on
    one side as a mismatch."""
    worst_abs, worst_ratio = 0.0, 0.0
    for g, w in zip(_outputs(got), _outputs(want), strict=True):
        if w.numel() == 0:
            continue
        tol = tolerance(w.dtype)
        g, w = g.float(), w.float()
        same = (g == w) | (g.isnan() & w.isnan())
        diff = torch.where(same, 0.0, (g - w).abs())
        ratio = torch.where(same, 0.0, diff / (tol["atol"] + tol["rtol"] * w.abs()))
        worst_abs = max(worst_abs, diff.max().item(), key=_nan_last)
        worst_ratio = max(worst_ratio, ratio.max().item(), key=_nan_last)
    return worst_abs, worst_ratio


def compare_to_fp64(got, want, exact):
    """compare(got, want), whose ratio is replaced, where smaller, by the largest over outputs of
    rms(got - exact) / (1.25 rms(want - exact)): Triton's error from the fp64 run against torch's
    own, with a quarter's slack. Either says Triton computes what torch does."""
    worst_abs, by_table = compare(got, want)
    worst_ratio = 0.0
    for g, w, e in zip(_outputs(got), _outputs(want), _outputs(exact), strict=True):
        if e.numel():
            rms = [(t.double() - e).square().mean().sqrt().item() for t in (g, w)]
            ratio = rms[0] / (1.25 * rms[1]) if rms[1] else (math.inf if rms[0] else 0.0)
            worst_ratio = max(worst_ratio, ratio, key=_nan_last)
    return worst_abs, min(by_table, worst_ratio, key=_nan_last)


def _nan_last(x):
    """Sort key under which nan is larger than any number (so max() keeps a nan)."""
    return (x != x, x)


def do_bench_timer(warmup_ms, rep_ms):
    """ms of one call: triton.testing.do_bench's median (it flushes L2 between calls)."""
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def wall_clock_timer(reps=3):
    """ms of one call, median of `reps` (the CPU path, where there is no do_bench)."""

    def timer(fn):
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)

    return timer


def bench_case(case, impl, device, timer):
    """Check then time one case: its two rows, triton's then torch's."""
    pair = case.build(impl, device)
    if pair.fp64 is None:
        max_abs, over = compare(pair.triton(), pair.torch())
    else:
        max_abs, over = compare_to_fp64(pair.triton(), pair.torch(), pair.fp64())
    pair.before_timing()
    ms = {"triton": timer(pair.triton), "torch": timer(pair.torch)}
    auto = ("triton" if pair.auto_runs_kernel() else "torch") if device.type == "cuda" else "torch"
    rows = []
    for provider, t in ms.items():
        rows.append({
            "kernel": case.kernel, "op": case.op, "provider": provider, "dtype": str(case.dtype).removeprefix("torch."),
            "shape": case.shape, "time_ms": t, "tflops": case.flops / t / 1e9 if case.flops else "",
            "gbps": case.nbytes / t / 1e6 if case.nbytes else "", "ratio_to_torch": t / ms["torch"],
            "max_abs_err": max_abs, "err_over_tol": over, "ok": over <= 1.0,  # nan: not ok
            "auto_path": auto, "auto_ratio_to_torch": ms[auto] / ms["torch"],
        })  # fmt: skip
    return rows


def triton_kernels():
    from tplayers.kernels.flash_attention import flash_attention, flash_attention_backward
    from tplayers.kernels.grad_stats import unscale_and_stats_
    from tplayers.kernels.grouped_matmul import grouped_matmul, grouped_mlp
    from tplayers.kernels.matmul import matmul
    from tplayers.kernels.swiglu import swiglu, swiglu_backward
    from tplayers.kernels.vocab_ce import vocab_ce_stats

    return SimpleNamespace(matmul=matmul, swiglu=swiglu, swiglu_backward=swiglu_backward,
                           unscale_and_stats_=unscale_and_stats_, vocab_ce_stats=vocab_ce_stats,
                           grouped_matmul=grouped_matmul, grouped_mlp=grouped_mlp, flash_attention=flash_attention,
                           flash_attention_backward=flash_attention_backward)  # fmt: skip


def reference_kernels():
    """The pure-torch `<op>_ref`s in the launchers' place: the whole pipeline without a GPU (tests)."""
    from tplayers.kernels.flash_attention_ref import flash_attention_backward_ref, flash_attention_ref
    from tplayers.kernels.grouped_matmul_ref import grouped_matmul_ref
    from tplayers.kernels.matmul_ref import matmul_ref
    from tplayers.kernels.swiglu_ref import swiglu_backward_ref, swiglu_ref
    from tplayers.kernels.vocab_ce_ref import vocab_ce_stats_ref

    return SimpleNamespace(matmul=matmul_ref, swiglu=swiglu_ref, swiglu_backward=swiglu_backward_ref,
                           unscale_and_stats_=unscale_and_stats_ref, vocab_ce_stats=vocab_ce_stats_ref,
                           grouped_matmul=grouped_matmul_ref, grouped_mlp=_grouped_mlp_ref,
                           flash_attention=flash_attention_ref,
                           flash_attention_backward=flash_attention_backward_ref)  # fmt: skip


def _grouped_mlp_ref(x, gather, scatter, k, counts, gate_up, down, scale):
    """The experts' MLP from the reference GEMMs (autograd through them): grouped_mlp's contract."""
    from tplayers.kernels.grouped_matmul_ref import grouped_matmul_ref

    h = grouped_matmul_ref(x, gate_up, counts, gather=gather, swiglu=True)
    cells = grouped_matmul_ref(h, down, counts, scale=scale, scatter=scatter, out_rows=x.shape[0] * k)
    return cells.view(x.shape[0], k, down.shape[1]).sum(1)


def run(case_list, impl, device, timer, log=None):
    """Every case's two rows; `log(triton_row, torch_row)` after each case."""
    rows = []
    for case in case_list:
        rows += bench_case(case, impl, device, timer)
        if log is not None:
            log(*rows[-2:])
    return rows


# ---- reporting ------------------------------------------------------------------------------


def _rate(row):
    return f"{row['tflops']:.1f} TFLOP/s" if row["tflops"] != "" else f"{row['gbps']:.0f} GB/s"


HEADER = (
    f"{'op':<28}{'dtype':<10}{'shape':<30}{'triton ms':>10}{'torch ms':>10}{'tri/torch':>10}"
    f"{'triton':>16}{'torch':>16}{'max abs err':>13}{'err/tol':>9}  ok  {'auto':>13}"
)
FOOTNOTE = (
    "(tri/torch < 1: Triton faster; err/tol: the largest |triton - torch| over atol + rtol |torch| from "
    "tplayers.tolerances for torch's dtype, <= 1 passes; for fwd+bwd, whose gradients sum thousands of rows, "
    "that or, where smaller, Triton's rms error from an fp64 run over 1.25x torch's own; auto: the path "
    "backend='auto' runs, measured on first use (tplayers.backend), and its time over torch's)"
)


def _line(tri, ref):
    return (
        f"{tri['op']:<28}{tri['dtype']:<10}{tri['shape'][:29]:<30}{tri['time_ms']:10.3f}{ref['time_ms']:10.3f}"
        f"{tri['ratio_to_torch']:10.3f}{_rate(tri):>16}{_rate(ref):>16}{tri['max_abs_err']:13.3g}"
        f"{tri['err_over_tol']:9.3f}  {'yes' if tri['ok'] else 'NO ':<3}"
        f" {tri['auto_path']:>6} {tri['auto_ratio_to_torch']:5.2f}"
    )


def print_table(rows):
    """The table that main() prints as the cases run, for rows read back from a CSV."""
    print(HEADER)
    for tri, ref in zip(rows[0::2], rows[1::2], strict=True):
        print(_line(tri, ref))
    print(FOOTNOTE)


def plot(rows, path):
    """One panel per kernel: triton / torch time per op, dtype and shape (horizontal bars)."""
    tri = [r for r in rows if r["provider"] == "triton"]
    kernels = list(dict.fromkeys(r["kernel"] for r in tri))
    counts = [sum(r["kernel"] == k for r in tri) for k in kernels]
    fig, axes = figure(len(kernels), 1, figsize=(9, 1.2 + 0.28 * sum(counts) + 0.6 * len(kernels)), squeeze=False,
                       gridspec_kw={"height_ratios": counts})  # fmt: skip
    colours = {"bfloat16": "tab:blue", "float16": "tab:orange", "float32": "tab:green"}
    for ax, kernel in zip(axes[:, 0], kernels, strict=True):
        mine = [r for r in tri if r["kernel"] == kernel]
        ys = range(len(mine))
        ax.barh(ys, [r["ratio_to_torch"] for r in mine], color=[colours[r["dtype"]] for r in mine])
        ax.set_yticks(ys, [f"{r['op']} {r['dtype']} {r['shape']}" for r in mine], fontsize="x-small")
        ax.invert_yaxis()
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{kernel}: triton time / torch time (lower is better)", fontsize="small")
    fig.suptitle(f"tplayers kernels against torch, {rows[0]['device']}", fontsize="medium")
    save_figure(fig, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes, short timing (smoke test)")
    p.add_argument("--no-tests", action="store_true", help="on a GPU: skip running the kernel tests there first")
    p.add_argument("--only", nargs="+", choices=KERNELS, default=KERNELS, help="these kernels' cases only")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "kernels")
    return p.parse_args(argv)


def _interpreting() -> bool:
    """Whether the kernels will run in Triton's interpreter: TRITON_INTERPRET=1 set before
    triton is imported (here, unless something imported triton already)."""
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    from tplayers.kernels import matmul

    return matmul.INTERPRET


def run_kernel_tests(device: str, out: Path, select: tuple[str, ...] = ("tests",)) -> int:
    """The suite's `kernel` tests on `device` (pytest's exit status; 0 when this copy has no tests/),
    their output also written to <out>/kernel_tests.txt; `select`: pytest's paths / node ids, relative
    to the checkout."""
    tests = ROOT / "tests"
    if not (tests / "conftest.py").is_file():
        print(f"bench/kernels.py: no test suite at {tests} (an installed copy): kernel tests not run", file=sys.stderr)
        return 0
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TPLAYERS_TEST_DEVICE"] = device
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "kernel", "-p", "no:cacheprovider", *select]
    print("kernel tests on the device: " + " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_tests.txt").write_text(done.stdout + done.stderr)
    print("\n".join((done.stdout + done.stderr).strip().splitlines()[-15:]), flush=True)
    return done.returncode


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("bench/kernels.py: TRITON_INTERPRET=1 would run the kernels in Triton's interpreter: unset it",
              file=sys.stderr)  # fmt: skip
        return 2
    if torch.cuda.is_available():
        shapes = QUICK_SHAPES if args.quick else SHAPES
        device = torch.device("cuda", torch.cuda.current_device())
        info = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__, triton=version("triton"))
        timer = do_bench_timer(shapes.warmup_ms, shapes.rep_ms)
        tests_failed = 0 if args.no_tests else run_kernel_tests("cuda", args.out)
    else:
        print(f"bench/kernels.py: {NO_GPU}", file=sys.stderr)
        if not _interpreting():
            print("bench/kernels.py: triton was imported before TRITON_INTERPRET could be set", file=sys.stderr)
            return 2
        shapes, device, timer = INTERPRETER_SHAPES, torch.device("cpu"), wall_clock_timer(1)
        info = dict(device="cpu (Triton interpreter)", torch=torch.__version__, triton=version("triton"))
        tests_failed = 0  # the suite runs them in the interpreter itself
    print("Triton kernels against torch's ops, " + ", ".join(f"{k}={v}" for k, v in info.items()))
    print(HEADER, flush=True)  # the rows follow as the cases run (the first GEMMs autotune and compile)
    chosen = [case for case in cases(shapes) if case.kernel in args.only]
    rows = run(chosen, triton_kernels(), device, timer, log=lambda tri, ref: print(_line(tri, ref), flush=True))
    print(FOOTNOTE)
    for row in rows:
        row.update(info)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "kernels.csv", FIELDS)
    plot(rows, args.out / "kernels.png")
    print(f"\nwrote {args.out / 'kernels.csv'} and {args.out / 'kernels.png'}")
    bad = [f"{r['op']} {r['dtype']} {r['shape']}" for r in rows if r["provider"] == "triton" and not r["ok"]]
    if bad:
        print(f"bench/kernels.py: Triton and torch differ beyond the tolerance on {', '.join(bad)}", file=sys.stderr)
    if tests_failed:
        print(f"bench/kernels.py: kernel tests failed on the device (see {args.out / 'kernel_tests.txt'})",
              file=sys.stderr)  # fmt: skip
    return 1 if bad or tests_failed else 0


if __name__ == "__main__":
    sys.exit(main())
