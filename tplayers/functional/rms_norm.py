"""RMSNorm over the last dim as HF's LlamaRMSNorm computes it, in one kernel each way on the Triton
backend (kernels/rms_norm.py), HF's own ops on the torch backend.

    y = weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype),  x32 = x in fp32

Triton: x (..., N) is read once forward (y and each row's rstd written) and once backward with dy
(dx written, dweight summed over the rows in fp32); saved for backward: x and rstd (R,) fp32, where
HF's eager norm keeps fp32 copies of x and of the normalised rows. No communication.
"""

import torch

from tplayers.backend import get_backend, register, token_bucket, uses_triton


class _RMSNormFn(torch.autograd.Function):
    """x (..., N), weight (N,) -> y (..., N) in promote(x, weight)'s dtype."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        from tplayers.kernels.rms_norm import rms_norm

        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        y, rstd = rms_norm(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        from tplayers.kernels.rms_norm import rms_norm_backward

        x2, weight, rstd = ctx.saved_tensors
        dx, dweight = rms_norm_backward(dy.reshape(-1, dy.shape[-1]), x2, weight, rstd)
        return dx.view(ctx.shape), dweight, None


def rms_norm(x, weight, eps: float):
    """HF's RMSNorm of x over its last dim (module docstring), on the selected backend."""
    measured = x.is_cuda and get_backend() == "auto"  # the shape class only where it decides
    key = (token_bucket(x.numel() // max(1, x.shape[-1])), x.shape[-1], str(weight.dtype)) if measured else ()
    if x.numel() and uses_triton(x, "rms_norm", key):
        return _RMSNormFn.apply(x, weight, eps)
    return _hf_rms_norm(x, weight, eps)


def _hf_rms_norm(x, weight, eps):
    input_dtype = x.dtype  # the torch backend: HF's own ops, as its forward runs them
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


def _recipe(key, dtype, device):
    """The norm's forward and backward on rows of the class `key`, each path (tplayers.backend.register)."""
    rows, n, weight_dtype = key
    x = torch.randn(rows, n, device=device, dtype=dtype, requires_grad=True)
    weight = torch.ones(n, device=device, dtype=getattr(torch, weight_dtype.removeprefix("torch.")),
                        requires_grad=True)  # fmt: skip
    dy = torch.randn(rows, n, device=device, dtype=torch.promote_types(dtype, weight.dtype))

    def step(fn):
        return lambda: fn(x, weight, 1e-6).backward(dy)

    return step(_RMSNormFn.apply), step(_hf_rms_norm)


register("rms_norm", _recipe)
