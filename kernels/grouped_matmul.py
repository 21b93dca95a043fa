"""Grouped GEMM over experts (ScatterMoE-style), its launchers and `grouped_matmul_ref`.

The contract is the pure-torch reference's (grouped_matmul_ref.py, re-exported here): rows are
(token, expert) pairs sorted by expert, read from x through a gather index and written through
a scatter index, so no permuted copy of the tokens is ever made; w is (E, N, K) per expert in
nn.Linear's layout (any strides: a transposed view serves the backward). Kernels:

    _grouped_kernel       one program per (row tile, column tile); a row tile never spans two
                          experts (the tile table below), so each program reads one expert's
                          weights. Epilogues in fp32: SwiGLU on [gate; up] (two accumulators,
                          the gate and up columns of the same tile), and the per-row routing
                          weight; optionally the pre-activation [gate | up] stored too (the
                          backward's input)
    _weight_grad_kernel   dW[e] = sum over e's pairs of dy^T x: one program per (expert, N tile,
                          K tile), looping over the expert's rows in fp32 (the gather index
                          one tile ahead, so the loads pipeline); no atomics, so the result
                          does not depend on scheduling

The tile table is built on the device from the per-expert counts (no host sync): tile t belongs
to the expert whose cumulative tile count first exceeds t; `ceil(P / BLOCK_M) + E` programs are
launched, the ones past the last tile return at once.

`grouped_mlp` is the experts' MLP (autograd): gate|up GEMM with the SwiGLU epilogue, down GEMM
scaled by the routing weight and scattered into a (rows, k) grid summed per row; its backward
runs the same kernels on transposed weight views, the SwiGLU backward kernel, and the
weight-gradient kernel.
"""

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .grouped_matmul_ref import check_args, grouped_matmul_ref, grouped_weight_grad_ref
from .swiglu import swiglu_backward
from .tuning import configs_for_running_gpu

__all__ = ["grouped_matmul", "grouped_matmul_ref", "grouped_mlp", "grouped_weight_grad", "grouped_weight_grad_ref"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The row tile is fixed (the tile table depends on it); columns, depth, warps and stages are
# tuned. 64 rows: an expert's pairs come in hundreds to thousands per step at real batch sizes,
# and a short last tile wastes at most 63 rows per expert. Two accumulators (SwiGLU) of
# 64 x 128 fp32 over 8 warps are 64 registers a thread: the limit that keeps matmul.py's fused
# kernels free of spills on both targets (checked by `tplayers compile-report`).
BLOCK_M = 64
INTERPRETER_BLOCK_M = 16


def _config(bn, bk, warps, stages, arch):
    cfg = triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)
    cfg.arch = arch
    return cfg


SM80_CONFIGS = [_config(128, 32, 8, 4, 80), _config(64, 32, 4, 4, 80), _config(128, 64, 8, 3, 80)]
SM90_CONFIGS = [_config(128, 64, 8, 3, 90), _config(64, 64, 4, 4, 90), _config(128, 64, 8, 4, 90)]
WGRAD_CONFIGS = [_config(64, 64, 4, 3, 80), _config(128, 64, 8, 3, 80), _config(64, 64, 4, 3, 90),
                 _config(128, 128, 8, 3, 90)]  # fmt: skip
INTERPRETER_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 16}


@triton.jit
def _grouped_kernel(
    x_ptr, w_ptr, out_ptr, pre_ptr, gather_ptr, scatter_ptr, scale_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_pm, stride_pn,
    HAS_GATHER: tl.constexpr, HAS_SCATTER: tl.constexpr, HAS_SCALE: tl.constexpr, SWIGLU: tl.constexpr,
    STORE_PRE: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start >= end:  # past the last tile
        return
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    offs_p = start + tl.arange(0, BLOCK_M)
    p_mask = offs_p < end
    if HAS_GATHER:
        rows = tl.load(gather_ptr + offs_p, mask=p_mask, other=0).to(tl.int64)
    else:
        rows = tl.where(p_mask, offs_p, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_wn = offs_n % N  # wrapped onto valid columns: loads need no N mask, never stored
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_base = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk
    w_ptrs = w_base + offs_wn[None, :] * stride_wn
    up_ptrs = w_base + (offs_wn + N)[None, :] * stride_wn  # SwiGLU: the up rows after the N gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=p_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 bit patterns in tl.dot
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if SWIGLU:
            bu = tl.load(up_ptrs, mask=k_mask[:, None], other=0.0)
            if UPCAST:
                bu = bu.to(tl.float32)
            acc_up = tl.dot(a, bu, acc_up, input_precision=INPUT_PRECISION)
            up_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    mask = p_mask[:, None] & n_valid[None, :]
    if STORE_PRE:  # [gate | up] before the activation, pair order: the backward's input
        pre = pre_ptr + offs_p.to(tl.int64)[:, None] * stride_pm + offs_n[None, :] * stride_pn
        tl.store(pre, acc.to(pre_ptr.dtype.element_ty), mask=mask)
        tl.store(pre + N * stride_pn, acc_up.to(pre_ptr.dtype.element_ty), mask=mask)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs_p, mask=p_mask, other=0.0).to(tl.float32)[:, None]
    if HAS_SCATTER:
        out_rows = tl.load(scatter_ptr + offs_p, mask=p_mask, other=0).to(tl.int64)
    else:
        out_rows = offs_p.to(tl.int64)
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weight_grad_kernel(
    dy_ptr, x_ptr, dw_ptr, gather_ptr, offsets_ptr,
    N, K,
    stride_dym, stride_dyn, stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
    HAS_GATHER: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    expert, pid = tl.program_id(0), tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    offs_n = (pid // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (pid % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask, k_mask = offs_n < N, offs_k < K
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # the gather index of the next row tile is loaded one tile ahead: x's rows then come from a
    # loop-carried value, which the software pipeliner can prefetch like a pointer increment
    offs_p = start + tl.arange(0, BLOCK_M)
    if HAS_GATHER:
        rows = tl.load(gather_ptr + offs_p, mask=offs_p < end, other=0).to(tl.int64)
    else:
        rows = offs_p.to(tl.int64)
    for p0 in range(start, end, BLOCK_M):
        offs_p = p0 + tl.arange(0, BLOCK_M)
        p_mask = offs_p < end
        next_p = offs_p + BLOCK_M
        if HAS_GATHER:
            next_rows = tl.load(gather_ptr + next_p, mask=next_p < end, other=0).to(tl.int64)
        else:
            next_rows = next_p.to(tl.int64)
        dy = tl.load(dy_ptr + offs_p.to(tl.int64)[None, :] * stride_dym + offs_n[:, None] * stride_dyn,
                     mask=n_mask[:, None] & p_mask[None, :], other=0.0)  # fmt: skip
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=p_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        if UPCAST:
            dy = dy.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(dy, x, acc, input_precision=INPUT_PRECISION)
        rows = next_rows
    dw = dw_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    tl.store(dw, acc, mask=n_mask[:, None] & k_mask[None, :])


_PRUNE = {"early_config_prune": configs_for_running_gpu}
_grouped_autotuned = triton.autotune(
    configs=SM80_CONFIGS + SM90_CONFIGS,
    key=["N", "K", "HAS_GATHER", "HAS_SCATTER", "HAS_SCALE", "SWIGLU", "STORE_PRE"],
    prune_configs_by=_PRUNE,
    restore_value=["out_ptr"],
)(_grouped_kernel)
_weight_grad_autotuned = triton.autotune(configs=WGRAD_CONFIGS, key=["N", "K", "HAS_GATHER"], prune_configs_by=_PRUNE)(
    _weight_grad_kernel
)


def _block_m():
    return INTERPRETER_BLOCK_M if INTERPRET else BLOCK_M


def _check_device(t):
    if not INTERPRET and not t.is_cuda:
        raise RuntimeError(
            "the Triton grouped GEMM needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported; "
            "set_backend('torch') uses the reference"
        )


def tile_table(counts, pairs, block_m):
    """(expert, first pair, end of the expert's pairs) of each of `ceil(pairs / block_m) + E` row
    tiles, on the device; tiles past the last one are empty (start == end)."""
    experts = counts.numel()
    t = torch.arange(-(-pairs // block_m) + experts, device=counts.device)
    if experts == 0:
        empty = torch.zeros_like(t, dtype=torch.int32)
        return empty, empty, empty
    offsets = F.pad(counts.cumsum(0), (1, 0))
    tiles = (counts + block_m - 1) // block_m
    last = tiles.cumsum(0)
    expert = torch.searchsorted(last, t, right=True)
    e = expert.clamp(max=experts - 1)
    start = offsets[e] + (t - (last[e] - tiles[e])) * block_m
    end = torch.where(expert < experts, offsets[e + 1], start)
    return e.to(torch.int32), start.to(torch.int32), end.to(torch.int32)


def _precision(x):
    return "tf32" if x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def grouped_matmul(x, w, counts, *, gather=None, scale=None, swiglu=False, scatter=None, out_rows=None, pre=None):
    """See grouped_matmul_ref.py; `pre` ((P, N) of x's dtype, SwiGLU only): also the [gate | up]
    pre-activation, in pair order."""
    shape = check_args(x, w, counts, gather, scale, swiglu, scatter, out_rows)
    _check_device(x)
    pairs, n = (gather.shape[0] if gather is not None else x.shape[0]), shape[1]
    out = (torch.zeros if scatter is not None else torch.empty)(shape, device=x.device, dtype=x.dtype)
    if pairs == 0 or n == 0:
        return out
    tables = tile_table(counts, pairs, _block_m())
    args = (
        x, w, out, pre if pre is not None else out, gather if gather is not None else counts,
        scatter if scatter is not None else counts, scale if scale is not None else out, *tables,
        n, x.shape[1], *x.stride(), *w.stride(), *out.stride(), *(pre.stride() if pre is not None else (0, 0)),
    )  # fmt: skip
    flags = dict(HAS_GATHER=gather is not None, HAS_SCATTER=scatter is not None, HAS_SCALE=scale is not None,
                 SWIGLU=swiglu, STORE_PRE=pre is not None, UPCAST=INTERPRET and x.dtype == torch.bfloat16,
                 INPUT_PRECISION=_precision(x))  # fmt: skip

    def grid(meta):
        return (tables[0].numel(), triton.cdiv(n, meta["BLOCK_N"]))

    if INTERPRET:
        _grouped_kernel[grid](*args, **flags, BLOCK_M=_block_m(), **INTERPRETER_CONFIG)
    else:
        with torch.cuda.device(x.device):
            _grouped_autotuned[grid](*args, **flags, BLOCK_M=BLOCK_M)
    return out


def grouped_weight_grad(dy, x, counts, *, gather=None):
    """dW (E, N, K) in fp32: each expert's pairs' dy^T @ x rows (see the reference)."""
    _check_device(x)
    experts, n, k = counts.numel(), dy.shape[1], x.shape[1]
    dw = torch.zeros((experts, n, k), device=x.device, dtype=torch.float32)
    if experts == 0 or n == 0 or k == 0:
        return dw
    offsets = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    args = (dy, x, dw, gather if gather is not None else offsets, offsets, n, k, *dy.stride(), *x.stride(),
            *dw.stride())  # fmt: skip
    flags = dict(HAS_GATHER=gather is not None, UPCAST=INTERPRET and x.dtype == torch.bfloat16,
                 INPUT_PRECISION=_precision(x))  # fmt: skip

    def grid(meta):
        return (experts, triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(k, meta["BLOCK_K"]))

    if INTERPRET:
        _weight_grad_kernel[grid](*args, **flags, BLOCK_M=_block_m(), **INTERPRETER_CONFIG)
    else:
        with torch.cuda.device(x.device):
            _weight_grad_autotuned[grid](*args, **flags, BLOCK_M=BLOCK_M)
    return dw


class _GroupedMLP(torch.autograd.Function):
    """out (R, H): row r's pairs' scale * W_down[e] silu(gate) * up, summed in pick order."""

    @staticmethod
    def forward(ctx, x, gather, scatter, k, counts, gate_up, down, scale):
        pairs, f = gather.shape[0], gate_up.shape[1] // 2
        pre = x.new_empty(pairs, 2 * f)
        h = grouped_matmul(x, gate_up, counts, gather=gather, swiglu=True, pre=pre)
        grid = grouped_matmul(h, down, counts, scale=scale, scatter=scatter, out_rows=x.shape[0] * k)
        ctx.save_for_backward(x, gather, scatter, counts, gate_up, down, scale, pre, h)
        ctx.k = k
        return grid.view(x.shape[0], k, down.shape[1]).sum(1)

    @staticmethod
    def backward(ctx, dout):
        x, gather, scatter, counts, gate_up, down, scale, pre, h = ctx.saved_tensors
        f = h.shape[1]
        dy = dout.to(x.dtype).index_select(0, scatter // ctx.k)  # each pair's output gradient: its row's
        gh = grouped_matmul(dy, down.transpose(1, 2), counts)  # dy W_down[e], before the routing weight
        dscale = (gh.float() * h.float()).sum(1).to(scale.dtype)
        dh = (gh.float() * scale.float()[:, None]).to(x.dtype)
        scaled = (dy.float() * scale.float()[:, None]).to(dy.dtype)  # the GEMM's operand as is: pipelined loads
        ddown = grouped_weight_grad(scaled, h, counts).to(down.dtype)
        dpre = torch.empty_like(pre)
        swiglu_backward(dh, pre[:, :f], pre[:, f:], dgate=dpre[:, :f], dup=dpre[:, f:])
        dgate_up = grouped_weight_grad(dpre, x, counts, gather=gather).to(gate_up.dtype)
        # each pair's input gradient into its (row, pick) cell, summed per row: no atomics
        dx = grouped_matmul(dpre, gate_up.transpose(1, 2), counts, scatter=scatter, out_rows=x.shape[0] * ctx.k)
        dx = dx.view(x.shape[0], ctx.k, x.shape[1]).sum(1)
        return dx, None, None, None, None, dgate_up, ddown, dscale


def grouped_mlp(x, gather, scatter, k, counts, gate_up, down, scale):
    """The experts' SwiGLU MLP over pairs (rows of x through `gather`, sorted by expert, `counts`
    per expert), each pair's output scaled by `scale` and written to cell `scatter` of a (rows, k)
    grid, summed per row: (rows, H). Differentiable in x, gate_up, down and scale. Each pair's
    cell is in the row it reads (scatter[p] // k == gather[p], as `dispatch.pairs` lays them out):
    the backward writes each pair's input gradient to that cell too, summed per row without atomics."""
    return _GroupedMLP.apply(x, gather, scatter, k, counts, gate_up, down, scale)
