"""`swiglu_ref` / `swiglu_backward_ref`: the pure-torch SwiGLU epilogue with the Triton kernels'
signatures and contract, and the argument checks both share. No triton import here: it is the
CPU path, the test oracle and the benchmark baseline.

Shapes: gate, up, dh, h, dgate, dup are all (M, N); any strides (gate and up are usually the two
halves of one fused [gate | up] GEMM output, (M, 2N), read in place):
    forward   h     = silu(g) * u                    silu(g) = g * sigmoid(g)
    backward  dup   = dh * silu(g)
              dgate = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
The reference computes them as eager torch (HF's MLP and its autograd) does: each op in the
inputs' dtype (fp32 inside each kernel, rounded per op), written into the outputs without a
copy; the Triton kernels keep fp32 from input to output and round once.
"""

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_inputs(op, *named):
    """Same shape, dtype and device for every input; float dtypes only. Returns the shape."""
    (name0, t0), rest = named[0], named[1:]
    if t0.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name0} must be fp32/fp16/bf16, got {t0.dtype}")
    if t0.dim() != 2:
        raise ValueError(f"{op}: {name0} must be 2-D (M, N), got {tuple(t0.shape)}")
    for name, t in rest:
        if t.shape != t0.shape:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} but {name0} has {tuple(t0.shape)}")
        if t.dtype != t0.dtype:
            raise TypeError(f"{op}: {name} is {t.dtype} but {name0} is {t0.dtype}")
        if t.device != t0.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {name0} is on {t0.device}")
    return tuple(t0.shape)


def check_output(op, name, out, shape, device):
    if out is None:
        return
    if tuple(out.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {shape}, got {tuple(out.shape)}")
    if out.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be fp32/fp16/bf16, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"{op}: {name} is on {out.device} but the inputs are on {device}")


def check_forward(gate, up, out):
    shape = check_inputs("swiglu", ("gate", gate), ("up", up))
    check_output("swiglu", "out", out, shape, gate.device)
    return shape


def check_backward(dh, gate, up, dgate, dup):
    shape = check_inputs("swiglu_backward", ("gate", gate), ("up", up), ("dh", dh))
    check_output("swiglu_backward", "dgate", dgate, shape, gate.device)
    check_output("swiglu_backward", "dup", dup, shape, gate.device)
    return shape


def _store(value, out, dtype):
    return value.to(dtype) if out is None else out.copy_(value)


def swiglu_ref(gate, up, *, out=None):
    """h = silu(gate) * up as eager torch computes it, written to `out` (any strides) or a new tensor."""
    check_forward(gate, up, out)
    silu = torch.nn.functional.silu(gate)
    return torch.mul(silu, up, out=out) if out is not None and out.dtype == gate.dtype else _store(
        silu * up, out, gate.dtype)  # fmt: skip


def swiglu_backward_ref(dh, gate, up, *, dgate=None, dup=None):
    """(dgate, dup) of h = silu(gate) * up as eager torch's autograd computes them; written to
    `dgate` / `dup` (any strides: the two halves of one fused gradient buffer) or new tensors."""
    check_backward(dh, gate, up, dgate, dup)
    d = dh.to(gate.dtype)
    # dgate = dh * up * silu'(gate), with torch's fused silu backward; dup = dh * silu(gate)
    if dgate is not None and dgate.dtype == gate.dtype:
        dg = torch.ops.aten.silu_backward.grad_input(d * up, gate, grad_input=dgate)
    else:
        dg = _store(torch.ops.aten.silu_backward(d * up, gate), dgate, gate.dtype)
    silu = torch.nn.functional.silu(gate)
    du = torch.mul(d, silu, out=dup) if dup is not None and dup.dtype == gate.dtype else _store(d * silu, dup,
                                                                                                gate.dtype)  # fmt: skip
    return dg, du
