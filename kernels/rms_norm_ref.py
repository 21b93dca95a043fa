"""`rms_norm_ref` / `rms_norm_backward_ref`: the pure-torch RMSNorm of HF's Llama (and the 140
transformers norms whose forward is its, word for word), with the Triton kernels' signatures, and
the argument checks both share. No triton import here: it is the CPU path, the test oracle and
the benchmark baseline.

Shapes: x (R, N) rows of N features, any float dtype, contiguous rows; weight (N,). As HF's
LlamaRMSNorm computes it:
    h     = x in fp32,  rstd = rsqrt(mean(h^2) + eps)              (R,) fp32, kept for backward
    n     = (h * rstd) cast to x's dtype
    y     = weight * n                  in promote(weight, x)'s dtype
backward, with dn = dy * weight (rounded to y's dtype, as autograd's product is) in fp32:
    dx    = rstd * (dn - m * mean(dn * m))      m = h * rstd in fp32, cast to x's dtype
    dw    = sum over rows of dy * n                                fp32 sum, cast to weight's dtype
"""

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_args(x, weight, eps):
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"rms_norm: x must be 2-D (rows, features) fp32/fp16/bf16, got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError("rms_norm: x's rows must be contiguous")
    if weight.dim() != 1 or weight.shape[0] != x.shape[1] or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"rms_norm: weight must be ({x.shape[1]},) fp32/fp16/bf16, got {weight.dtype} {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight is on {weight.device} but x is on {x.device}")
    if not isinstance(eps, float) or eps < 0:
        raise ValueError(f"rms_norm: eps must be a non-negative float, got {eps!r}")


def out_dtype(x, weight) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype)


def rms_norm_ref(x, weight, eps):
    """(y, rstd): HF's RMSNorm of the rows of x (module docstring), and each row's rstd (fp32)."""
    check_args(x, weight, eps)
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h * rstd).to(x.dtype), rstd.squeeze(-1)


def rms_norm_backward_ref(dy, x, weight, rstd):
    """(dx, dweight) of y = rms_norm(x, weight) given dy and the forward's rstd (module docstring)."""
    m = x.float() * rstd[:, None]
    dn = (dy * weight).float()
    dx = rstd[:, None] * (dn - m * (dn * m).mean(-1, keepdim=True))
    dw = (dy.float() * m.to(x.dtype).float()).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)
