"""RMSNorm forward and backward as Triton kernels, their launchers and the pure-torch references
(re-exported from rms_norm_ref.py, which states the math: HF's LlamaRMSNorm, rounding where it rounds).

Forward: one row per program (on the GPU; several in the interpreter), the whole row in registers
(BLOCK_N the next power of two of the features): one read of x and the weight, one write of y and
of each row's rstd (fp32), which the backward reads instead of recomputing the mean of squares.
HF's eager norm runs some eight kernels forward and keeps an fp32 copy of x and the normalised
rows for backward; this keeps x and rstd.

Backward: each program walks a contiguous run of rows, writing dx and accumulating its rows'
share of dweight in fp32 registers; the launcher sums the programs' (programs, N) partials (as
Liger Kernel's RMSNorm does): dweight needs a sum over every row, which no single row owns.
"""

import contextlib
import os

import torch
import triton
import triton.language as tl

from .rms_norm_ref import check_args, out_dtype, rms_norm_backward_ref, rms_norm_ref

__all__ = ["rms_norm", "rms_norm_backward", "rms_norm_backward_ref", "rms_norm_ref"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_FEATURES = 65536  # a row in registers: beyond this the reference runs
# The interpreter runs each program in numpy: few, large programs are fastest.
INTERPRETER_ROWS = 16
INTERPRETER_PROGRAMS = 3


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr,
    R, N, stride_x, stride_y, eps,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < R, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    n = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF casts back before the weight
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = w[None, :] * n
    tl.store(y_ptr + r64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr,
    R, N, stride_dy, stride_x, stride_dx, rows_per_program,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = start + i
        ok = col_ok & ((cols * 0 + row) < R)  # the last program's run may pass the end: zeros add nothing
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(row, R - 1))  # any row's past the end: its dy is 0
        m = x * rstd
        dn = (dy * w).to(dy_ptr.dtype.element_ty).to(tl.float32)  # autograd's product, in y's dtype
        dx = rstd * (dn - m * (tl.sum(dn * m, axis=0) / N))
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)
        dw += dy * m.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dw_ptr + pid.to(tl.int64) * N + cols, dw, mask=col_ok)


def _warps(block_n: int) -> int:
    """Warps for a row of `block_n` features: about 16 fp32 values a thread, 4 to 16 warps."""
    return min(16, max(4, block_n // 512))


def gpu_config(N, rows_per_program=True):
    """The launch config the GPU runs a row of N features with (also read by the compile report):
    the forward's one row per program (BLOCK_R), the row's power-of-two tile, the warps."""
    block_n = triton.next_power_of_2(N)
    return {**({"BLOCK_R": 1} if rows_per_program else {}), "BLOCK_N": block_n, "num_warps": _warps(block_n)}


def _check_device(x):
    if not INTERPRET and not x.is_cuda:
        raise RuntimeError(
            "the Triton rms_norm needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported to run "
            "in Triton's interpreter; set_backend('torch') uses the reference"
        )


def rms_norm(x, weight, eps):
    """(y, rstd) of HF's RMSNorm over the rows of x (R, N) (rms_norm_ref.py), in one kernel."""
    check_args(x, weight, eps)
    _check_device(x)
    R, N = x.shape
    if N > MAX_FEATURES:
        return rms_norm_ref(x, weight, eps)
    y = torch.empty((R, N), device=x.device, dtype=out_dtype(x, weight))
    rstd = torch.empty((R,), device=x.device, dtype=torch.float32)
    if R == 0:
        return y, rstd
    config = gpu_config(N)
    if INTERPRET:
        config = {"BLOCK_R": INTERPRETER_ROWS, "BLOCK_N": config["BLOCK_N"]}
    args = (x, weight, y, rstd, R, N, x.stride(0), y.stride(0), eps)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _rms_norm_fwd_kernel[(triton.cdiv(R, config["BLOCK_R"]),)](*args, **config)
    return y, rstd


def rms_norm_backward(dy, x, weight, rstd):
    """(dx, dweight) of y = rms_norm(x, weight) from dy (R, N) and the forward's rstd (R,) fp32."""
    check_args(x, weight, 0.0)
    _check_device(x)
    R, N = x.shape
    if N > MAX_FEATURES:
        return rms_norm_backward_ref(dy, x, weight, rstd)
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    if R == 0:
        return dx, torch.zeros_like(weight)
    if INTERPRET:
        programs = min(R, INTERPRETER_PROGRAMS)
    else:
        programs = min(R, 2 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    per_program = triton.cdiv(R, programs)
    programs = triton.cdiv(R, per_program)
    partial = torch.empty((programs, N), device=x.device, dtype=torch.float32)
    config = gpu_config(N, rows_per_program=False)
    if INTERPRET:
        config.pop("num_warps")
    args = (dy, x, weight, rstd, dx, partial, R, N, dy.stride(0), x.stride(0), dx.stride(0), per_program)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _rms_norm_bwd_kernel[(programs,)](*args, **config)
    return dx, partial.sum(0).to(weight.dtype)
