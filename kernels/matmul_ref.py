"""`matmul_ref`: the pure-torch GEMM with the Triton `matmul`'s signature and contract, and
the argument checks both share. No triton import here: it is the CPU path, the test oracle
and the benchmark baseline, and must work where triton is not installed.

Shapes (weights follow nn.Linear's (out, in) layout, so B is usually a weight):
    a: (M, K) or (BATCH, M, K)        b: (N, K) or (BATCH, N, K)
    c: (M, N) or (BATCH, M, N); with reduce_batch=True, c is (M, N) = sum_b a_b @ b_b^T
Epilogue:  c = act(scale * acc + bias) + residual (+ c_old if accumulate), cast to c's dtype.
"""

import torch

ACTIVATIONS = {None: 0, "gelu_tanh": 1, "silu": 2}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def output_shape(a, b, reduce_batch):
    """Check operand shapes and return the shape of C."""
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise ValueError(f"matmul: a and b must be 2-D or 3-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"matmul: a has K={a.shape[-1]} but b has K={b.shape[-1]} (a @ b^T)")
    if b.dim() == 3 and (a.dim() != 3 or a.shape[0] != b.shape[0]):
        raise ValueError(f"matmul: batched b {tuple(b.shape)} needs a with the same batch, got {tuple(a.shape)}")
    if reduce_batch and a.dim() != 3:
        raise ValueError("matmul: reduce_batch=True needs a 3-D a")
    M, N = a.shape[-2], b.shape[-2]
    return (M, N) if a.dim() == 2 or reduce_batch else (a.shape[0], M, N)


def check_args(a, b, bias, activation, residual, out, accumulate, reduce_batch, out_dtype, swiglu_out=None):
    """Every check `matmul` and `matmul_ref` make; returns the shape of C."""
    if a.dtype != b.dtype or a.dtype not in FLOAT_DTYPES:
        raise TypeError(f"matmul: a and b must share a float dtype (fp32/fp16/bf16), got {a.dtype} and {b.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"matmul: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    shape = output_shape(a, b, reduce_batch)
    for name, t in (("b", b), ("bias", bias), ("residual", residual), ("out", out), ("swiglu_out", swiglu_out)):
        if t is not None and t.device != a.device:
            raise ValueError(f"matmul: {name} is on {t.device} but a is on {a.device}")
        if t is not None and name != "b" and t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"matmul: {name} must be fp32/fp16/bf16, got {t.dtype}")
    if bias is not None and tuple(bias.shape) != (shape[-1],):
        raise ValueError(f"matmul: bias must have shape ({shape[-1]},), got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != shape:
        raise ValueError(f"matmul: residual must have shape {shape}, got {tuple(residual.shape)}")
    if out is not None:
        if tuple(out.shape) != shape:
            raise ValueError(f"matmul: out must have shape {shape}, got {tuple(out.shape)}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError(f"matmul: out is {out.dtype} but out_dtype={out_dtype}")
    if accumulate and (out is None or out.dtype != torch.float32):
        raise ValueError("matmul: accumulate=True needs an fp32 `out` to accumulate into")
    if swiglu_out is not None:
        if activation is not None or residual is not None or accumulate or reduce_batch:
            raise ValueError("matmul: swiglu_out goes with a plain epilogue (scale and bias only)")
        if shape[-1] % 2 or tuple(swiglu_out.shape) != (*shape[:-1], shape[-1] // 2):
            raise ValueError(f"matmul: swiglu_out must have shape {(*shape[:-1], shape[-1] // 2)} (C has {shape})")
    return shape


def plain_epilogue(scale, activation, residual):
    return scale == 1.0 and activation is None and residual is None


def _addmm_batches(c, a, b, reduce_batch):
    """c += a @ b^T, per batch (or summed over it), as addmm calls on the strided views: BLAS
    takes them as they are, where einsum would first copy them into another layout."""
    if a.dim() == 2:
        return c.addmm_(a, b.t())
    for i in range(a.shape[0]):
        (c if reduce_batch else c[i]).addmm_(a[i], (b[i] if b.dim() == 3 else b).t())
    return c


def _activation(c, activation):
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(c, approximate="tanh")
    if activation == "silu":
        return torch.nn.functional.silu(c)
    return c


def matmul_ref(
    a, b, *, bias=None, scale=1.0, activation=None, residual=None, out=None,
    accumulate=False, reduce_batch=False, out_dtype=None, swiglu_out=None,
):  # fmt: skip
    """C = act(scale * (a @ b^T) + bias) + residual, like the Triton `matmul`, in torch; with
    `swiglu_out`, also H = silu(C[..., 0::2]) * C[..., 1::2] (C's columns alternate gate, up)."""
    check_args(a, b, bias, activation, residual, out, accumulate, reduce_batch, out_dtype, swiglu_out)
    c = _matmul_ref(
        a, b, bias=bias, scale=scale, activation=activation, residual=residual, out=out,
        accumulate=accumulate, reduce_batch=reduce_batch, out_dtype=out_dtype,
    )  # fmt: skip
    if swiglu_out is not None:  # as eager torch computes it (HF's MLP), no fp32 copy of c
        gate, up = c[..., 0::2], c[..., 1::2]
        if swiglu_out.dtype == c.dtype:
            torch.mul(torch.nn.functional.silu(gate), up, out=swiglu_out)
        else:
            swiglu_out.copy_(torch.nn.functional.silu(gate) * up)
    return c


def _matmul_ref(
    a, b, *, bias=None, scale=1.0, activation=None, residual=None, out=None,
    accumulate=False, reduce_batch=False, out_dtype=None,
):  # fmt: skip
    """The GEMM and epilogue of `matmul_ref`, arguments already checked.

    Computed in the wider of the input and output dtypes; an epilogue runs in fp32. The plain
    2-D-weight case is exactly `F.linear` (what nn.Linear computes), writing into a contiguous
    2-D `out` without a copy.
    """
    target = out.dtype if out is not None else (out_dtype or a.dtype)
    compute = torch.promote_types(a.dtype, target)
    if a.dtype != compute or b.dtype != compute:
        a, b = a.to(compute), b.to(compute)
    if bias is not None and bias.dtype != compute:
        bias = bias.to(compute)
    plain = plain_epilogue(scale, activation, residual) and not accumulate
    if plain and out is not None and out.dtype == compute and out.is_contiguous() and a.dim() == 2:
        return torch.addmm(bias, a, b.t(), out=out) if bias is not None else torch.mm(a, b.t(), out=out)
    if accumulate and bias is None and plain_epilogue(scale, activation, residual) and out.dtype == compute:
        return _addmm_batches(out, a, b, reduce_batch)  # weight-gradient accumulation, in place
    if reduce_batch:
        c = _addmm_batches(torch.zeros(out.shape if out is not None else output_shape(a, b, True), dtype=compute,
                                       device=a.device), a, b, reduce_batch=True)  # fmt: skip
    elif b.dim() == 2:
        c = torch.nn.functional.linear(a, b, bias if plain else None)
    else:
        c = torch.matmul(a, b.mT)
    if plain:
        if bias is not None and (reduce_batch or b.dim() == 3):
            c = c + bias
    else:
        c = c.float() * scale
        if bias is not None:
            c = c + bias.float()
        c = _activation(c, activation)
        if residual is not None:
            c = c + residual.float()
        if accumulate:
            return out.add_(c)
    if out is None:
        return c.to(target)
    return out.copy_(c)
