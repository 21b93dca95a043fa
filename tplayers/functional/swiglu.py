"""The column-parallel GEMM with SwiGLU in its epilogue: h = silu(gate) * up.

n = TP size, f = F/n. The local weight (2f, H) has its rows interleaved gate, up, gate, up, ...
so every output tile of the GEMM holds matching gate and up columns and the epilogue turns each
pair into one column of h (kernels/matmul.py, `swiglu_out`):

    plain: x (..., H)       -> y (..., 2f) = x W^T + b (saved) and h (..., f), one kernel
    SP:    x (B, S/n, H)    -> the same over the all-gathered sequence (all_gather_matmul)
    backward: dy (..., 2f) = [dgate, dup] interleaved, one elementwise kernel (kernels/swiglu.py)
              writing straight into the strided halves of one buffer, then the column GEMM's
              own dgrad / wgrad (linear.column_backward).

Saved: y, the GEMM's output, rather than recomputing it (that would repeat the GEMM and, under
sequence parallelism, its all-gather); silu(gate) is recomputed in the backward kernel.

Where torch runs the GEMM (no sequence parallelism) it runs HF's own ops instead: gate and up as
two GEMMs on the weight's strided rows (no copy), silu(gate) * up on contiguous tensors (the
strided halves of y cost elementwise passes at half their bandwidth), and in the backward one
interleaving copy of (dgate, dup) for the single dgrad / wgrad GEMM.
"""

import torch
import torch.nn.functional as F

from tplayers.backend import gemm, gemm_runs_triton, uses_triton
from tplayers.functional.linear import _flat, column_backward
from tplayers.functional.overlap import all_gather_matmul
from tplayers.functional.sequence import gathered_sizes
from tplayers.kernels.swiglu_ref import swiglu_backward_ref


def _swiglu_backward_kernel(tensor):
    if uses_triton(tensor):
        from tplayers.kernels.swiglu import swiglu_backward
    else:  # the reference module does not import triton
        from tplayers.kernels.swiglu_ref import swiglu_backward_ref as swiglu_backward
    return swiglu_backward


class ColumnSwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, overlap, widest):
        ctx.group, ctx.sequence_parallel, ctx.overlap, ctx.widest = group, sequence_parallel, overlap, widest
        ctx.has_bias, ctx.reduce_input_grad = bias is not None, True
        f = weight.shape[0] // 2
        if sequence_parallel:
            ctx.sizes = gathered_sizes(x, 1, group)  # every rank's part of the sequence
            h = x.new_empty((x.shape[0], sum(ctx.sizes), f))
            y, chunks = all_gather_matmul(
                x, weight, group, bias=bias, overlap=overlap, swiglu_out=h, widest=widest, sizes=ctx.sizes
            )
            ctx.save_for_backward(chunks, weight, y)
            return h
        x2 = _flat(x)
        ctx.fused = gemm_runs_triton(x2, weight, bias=bias, swiglu_out=True)  # decided before h is allocated
        if not ctx.fused:  # HF's own ops: contiguous gate and up, no strided elementwise pass
            gate, up = (F.linear(x2, weight[i::2], bias[i::2] if bias is not None else None) for i in (0, 1))
            ctx.save_for_backward(x, weight, gate, up)
            return (F.silu(gate) * up).view(*x.shape[:-1], f)
        h = x.new_empty((x2.shape[0], f))
        y = gemm(x2, weight, bias=bias, swiglu_out=h).view(*x.shape[:-1], 2 * f)
        ctx.save_for_backward(x, weight, y)
        return h.view(*x.shape[:-1], f)

    @staticmethod
    def backward(ctx, dh):
        if ctx.sequence_parallel or ctx.fused:
            saved, weight, y = ctx.saved_tensors
            y2 = _flat(y)
            dy = torch.empty_like(y2)
            _swiglu_backward_kernel(y2)(
                dh.reshape(y2.shape[0], y2.shape[-1] // 2), y2[:, 0::2], y2[:, 1::2], dgate=dy[:, 0::2],
                dup=dy[:, 1::2],
            )  # fmt: skip
            shape = y.shape
        else:
            saved, weight, gate, up = ctx.saved_tensors
            dgate, dup = swiglu_backward_ref(dh.reshape(gate.shape), gate, up)
            dy = torch.stack((dgate, dup), dim=-1)  # the rows' interleaving, for the one dgrad / wgrad GEMM
            shape = (*saved.shape[:-1], weight.shape[0])
        return (*column_backward(ctx, dy.view(shape), saved, weight), None, None, None, None)


def column_parallel_swiglu(x, weight, bias, group, *, sequence_parallel=False, overlap="auto", widest=None):
    """silu(gate) * up of the column-parallel GEMM x W^T + b whose output columns alternate gate, up.
    `widest`: the largest rank's rows where the pairs split unevenly (see `use_ring`)."""
    if weight.shape[0] % 2:
        raise ValueError(f"the fused gate|up weight needs an even number of rows, got {weight.shape[0]}")
    return ColumnSwiGLUFn.apply(x, weight, bias, group, sequence_parallel, overlap, widest)
