"""The SwiGLU epilogue `h = silu(gate) * up` and its backward as elementwise Triton kernels, their
launchers and the pure-torch references (re-exported from swiglu_ref.py).

gate and up are (M, N) with any strides: in ParallelMLP they are the two halves of one fused
[gate | up] column-parallel GEMM output (M, 2N), read in place; the backward writes dgate and
dup straight into the two halves of one (M, 2N) buffer, which is the fused GEMM's output
gradient. Math in fp32 on fp32 / fp16 / bf16 tensors; see swiglu_ref.py for the formulas.
Elementwise only (no tl.dot), so bf16 needs no upcast switch for the interpreter.

ParallelMLP interleaves the fused GEMM's columns (gate, up, gate, up, ...), so the backward's
gate / up / dgate / dup are the stride-2 column halves of y and dy. Read one column at a time
at stride 2, a 16-bit row cannot be loaded as wide vectors, and the split costs registers and a
shared-memory layout change (96 registers on sm_90a). `swiglu_backward` recognises that layout
and launches `_swiglu_bwd_pairs_kernel`, which loads contiguous (BLOCK_M, 2*BLOCK_N) tiles of y,
splits the pairs in registers (`tl.split`) and stores dy the same way (`tl.join`).
"""

import os

import torch
import triton
import triton.language as tl

from .swiglu_ref import check_backward, check_forward, swiglu_backward_ref, swiglu_ref

__all__ = ["swiglu", "swiglu_backward", "swiglu_backward_ref", "swiglu_ref"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# A (BLOCK_M, BLOCK_N) tile per program: rows of an FFN activation are long, so wide tiles keep
# the loads coalesced along N; a 16x128 tile over 4 warps * 32 threads is 16 elements a thread.
GPU_CONFIG = dict(BLOCK_M=16, BLOCK_N=128, num_warps=4)
# The interpreter runs each program in numpy: few, large programs are fastest.
INTERPRETER_CONFIG = dict(BLOCK_M=64, BLOCK_N=64)


@triton.jit
def _swiglu_fwd_kernel(
    gate_ptr, up_ptr, h_ptr,
    M, N,
    stride_gm, stride_gn, stride_um, stride_un, stride_hm, stride_hn,
    INT64_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if INT64_OFFSETS:  # a tensor spans >= 2**31 elements: 32-bit offsets would wrap
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    g = tl.load(gate_ptr + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn, mask=mask, other=0.0)
    u = tl.load(up_ptr + offs_m[:, None] * stride_um + offs_n[None, :] * stride_un, mask=mask, other=0.0)
    g = g.to(tl.float32)
    h = g * tl.sigmoid(g) * u.to(tl.float32)
    h_ptrs = h_ptr + offs_m[:, None] * stride_hm + offs_n[None, :] * stride_hn
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dh_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr,
    M, N,
    stride_dhm, stride_dhn, stride_gm, stride_gn, stride_um, stride_un,
    stride_dgm, stride_dgn, stride_dum, stride_dun,
    INT64_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if INT64_OFFSETS:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    m, n = offs_m[:, None], offs_n[None, :]
    d = tl.load(dh_ptr + m * stride_dhm + n * stride_dhn, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + m * stride_gm + n * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + m * stride_um + n * stride_un, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = d * u * sig * (1.0 + g * (1.0 - sig))
    du = d * silu
    tl.store(dgate_ptr + m * stride_dgm + n * stride_dgn, dg.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + m * stride_dum + n * stride_dun, du.to(dup_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_pairs_kernel(
    dh_ptr, y_ptr, dy_ptr,
    M, N,
    stride_dhm, stride_dhn, stride_ym, stride_dym,
    INT64_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The backward on interleaved pairs: y and dy are (M, 2N) with unit column stride, column
    2j holding gate j and 2j+1 up j; dh is (M, N)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.program_id(1) * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # y / dy columns
    if INT64_OFFSETS:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        offs_c = offs_c.to(tl.int64)
    m = offs_m[:, None]
    mask_h = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    mask_y = (offs_m < M)[:, None] & (offs_c < 2 * N)[None, :]
    d = tl.load(dh_ptr + m * stride_dhm + offs_n[None, :] * stride_dhn, mask=mask_h, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + m * stride_ym + offs_c[None, :], mask=mask_y, other=0.0).to(tl.float32)
    g, u = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N, 2)))
    sig = tl.sigmoid(g)
    dg = d * u * sig * (1.0 + g * (1.0 - sig))
    du = d * g * sig
    dy = tl.reshape(tl.join(dg, du), (BLOCK_M, 2 * BLOCK_N))
    tl.store(dy_ptr + m * stride_dym + offs_c[None, :], dy.to(dy_ptr.dtype.element_ty), mask=mask_y)


def _pairs(first, second):
    """The (M, 2N) tensor whose stride-2 column halves are `first` and `second`, or None."""
    if first.stride(1) != 2 or second.stride() != first.stride() or first.dtype != second.dtype:
        return None
    if second.data_ptr() != first.data_ptr() + first.element_size():
        return None
    M, N = first.shape
    return first.as_strided((M, 2 * N), (first.stride(0), 1))


def _max_offset(t):
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True) if size)


def _launch(kernel, tensors, M, N, strides=None):
    """Launch `kernel` over (M, N) tiles with each tensor's pointer, then `strides` (default:
    every tensor's strides)."""
    if not INTERPRET and not tensors[0].is_cuda:
        raise RuntimeError(
            "the Triton swiglu needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
            "imported to run in Triton's interpreter; set_backend('torch') uses the reference"
        )
    if M == 0 or N == 0:
        return
    cfg = INTERPRETER_CONFIG if INTERPRET else GPU_CONFIG
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    strides = [s for t in tensors for s in t.stride()] if strides is None else list(strides)
    int64 = any(_max_offset(t) >= 2**31 for t in tensors)
    if INTERPRET:
        kernel[grid](*tensors, M, N, *strides, INT64_OFFSETS=int64, **cfg)
    else:
        with torch.cuda.device(tensors[0].device):
            kernel[grid](*tensors, M, N, *strides, INT64_OFFSETS=int64, **cfg)


def swiglu(gate, up, *, out=None):
    """h = silu(gate) * up, fp32 math, one pass; into `out` (any strides) or a new tensor of gate's dtype."""
    M, N = check_forward(gate, up, out)
    if out is None:
        out = torch.empty((M, N), device=gate.device, dtype=gate.dtype)
    _launch(_swiglu_fwd_kernel, (gate, up, out), M, N)
    return out


def swiglu_backward(dh, gate, up, *, dgate=None, dup=None):
    """(dgate, dup) of h = silu(gate) * up from dh, fp32 math, one pass reading gate / up / dh
    once; into `dgate` / `dup` (any strides, e.g. the halves of one fused buffer) or new tensors."""
    M, N = check_backward(dh, gate, up, dgate, dup)
    if dgate is None:
        dgate = torch.empty((M, N), device=gate.device, dtype=gate.dtype)
    if dup is None:
        dup = torch.empty((M, N), device=gate.device, dtype=gate.dtype)
    y, dy = _pairs(gate, up), _pairs(dgate, dup)
    if y is not None and dy is not None and M and N:  # ParallelMLP's interleaved layout
        _launch(_swiglu_bwd_pairs_kernel, (dh, y, dy), M, N, strides=(*dh.stride(), y.stride(0), dy.stride(0)))
    else:
        _launch(_swiglu_bwd_kernel, (dh, gate, up, dgate, dup), M, N)
    return dgate, dup
