"""SwiGLU on the fused column output: h = silu(gate) * up, as an autograd Function over the
Triton kernels of kernels/swiglu.py (or their references on the torch backend)."""

import torch

from tplayers.backend import uses_triton


def _swiglu_kernels(tensor):
    if uses_triton(tensor):
        from tplayers.kernels.swiglu import swiglu, swiglu_backward
    else:  # the reference module does not import triton
        from tplayers.kernels.swiglu_ref import swiglu_backward_ref as swiglu_backward
        from tplayers.kernels.swiglu_ref import swiglu_ref as swiglu
    return swiglu, swiglu_backward


class SwiGLUFn(torch.autograd.Function):
    """h (..., f) = silu(gate) * up from the fused column output y (..., 2f) = [gate | up].

    Backward: dy (..., 2f) = [dgate | dup], written by one kernel straight into the two halves of
    one buffer, which is the column GEMM's output gradient (its dgrad and wgrad read it as is).
    Saved: y itself, not recomputed. It already exists (the column GEMM's output), so saving it
    costs no new allocation; recomputing it would cost the column GEMM again, and under sequence
    parallelism its all-gather too. silu(gate) is recomputed in the backward kernel (elementwise,
    cheap) rather than saved. Nothing saved is overwritten in place.
    """

    @staticmethod
    def forward(ctx, y):
        f = y.shape[-1] // 2
        y2 = y.reshape(-1, 2 * f)  # a view: the column output is contiguous
        swiglu, _ = _swiglu_kernels(y)
        h = swiglu(y2[:, :f], y2[:, f:])
        ctx.save_for_backward(y2)
        ctx.shape = y.shape
        return h.view(*y.shape[:-1], f)

    @staticmethod
    def backward(ctx, dh):
        (y2,) = ctx.saved_tensors
        f = y2.shape[-1] // 2
        _, swiglu_backward = _swiglu_kernels(y2)
        dy = torch.empty_like(y2)
        swiglu_backward(dh.reshape(-1, f), y2[:, :f], y2[:, f:], dgate=dy[:, :f], dup=dy[:, f:])
        return dy.view(ctx.shape)


def swiglu_fused(y):
    """silu(gate) * up of y (..., 2f) = [gate | up], differentiable."""
    return SwiGLUFn.apply(y)
