"""The experts' MLP over (token, expert) pairs sorted by expert: act(x W_gate^T) * (x W_up^T),
then W_down, each pair's output scaled by its routing weight, in two grouped GEMMs
(`kernels/grouped_matmul.py`: rows read through the pairs' gather index, SwiGLU fused into the
first GEMM, the routing weight into the second) on the Triton backend; on the torch backend
through `torch._grouped_mm` (cuBLAS's grouped GEMM, autograd through it) where it runs (CUDA,
bf16, 16-byte rows), else the pure-torch reference (differentiable as it is). `auto` takes the
faster of the two GPU paths, measured per shape class forward and backward ("experts").
"""

import torch
import torch.nn.functional as F
from torch import nn

from tplayers.backend import register, token_bucket, uses_triton


def is_silu(act) -> bool:
    """Whether `act` is SiLU (torch's, or HF's SiLUActivation): the epilogue the kernel fuses."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is torch.nn.functional.silu


def expert_mlp(x, pairs, k, gate_up, down, scale, act):
    """Each received row's sum over its (token, expert) pairs (`tplayers.functional.dispatch.Pairs`:
    rows of x through `gather`, sorted by expert) of scale[p] * W_down[e] (act(gate) * up), with
    gate_up[e] = [W_gate; W_up] (2F, H) and down[e] (H, F); the pairs summed in pick order.
    Returns (rows, H) in x's dtype."""
    rows = x.shape[0]
    if is_silu(act):
        cublas = grouped_mm_runs(x, gate_up, down)
        key = (token_bucket(pairs.gather.shape[0]), *gate_up.shape, k) if cublas and x.is_cuda else ()
        if uses_triton(x, "experts" if key else None, key):
            from tplayers.kernels.grouped_matmul import grouped_mlp

            return grouped_mlp(x, pairs.gather, pairs.scatter, k, pairs.counts, gate_up, down, scale)
        if cublas:
            return grouped_mm_mlp(x, pairs.gather, pairs.scatter, k, pairs.counts, gate_up, down, scale)
    from tplayers.kernels.grouped_matmul_ref import grouped_matmul_ref

    if is_silu(act):
        h = grouped_matmul_ref(x, gate_up, pairs.counts, gather=pairs.gather, swiglu=True)
    else:
        gate, up = grouped_matmul_ref(x, gate_up, pairs.counts, gather=pairs.gather).chunk(2, dim=-1)
        h = act(gate) * up
    cells = grouped_matmul_ref(h, down, pairs.counts, scale=scale, scatter=pairs.scatter, out_rows=rows * k)
    return cells.view(rows, k, down.shape[1]).sum(1)


def grouped_mm_runs(x, gate_up, down) -> bool:
    """Whether torch._grouped_mm takes these experts: on CUDA in bf16 (its kernel's dtype), every row
    a multiple of 16 bytes (its operands' strides)."""
    return x.is_cuda and x.dtype == gate_up.dtype == down.dtype == torch.bfloat16 and x.shape[1] % 8 == 0 and (
        down.shape[2] % 8 == 0)  # fmt: skip


def grouped_mm_mlp(x, gather, scatter, k, counts, gate_up, down, scale):
    """The experts' SwiGLU MLP (`grouped_mlp`'s contract) through torch._grouped_mm: the pairs' rows
    gathered, [gate | up] per expert, silu(gate) * up, down, each pair scaled, its cell of the
    (rows, k) grid summed per row. Autograd runs the backward (torch's grouped GEMMs again)."""
    offs = counts.cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x[gather], gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs) * scale[:, None].to(x.dtype)
    cells = y.new_zeros(x.shape[0] * k, y.shape[1]).index_copy(0, scatter, y)
    return cells.view(x.shape[0], k, y.shape[1]).sum(1)


def _experts_recipe(key, dtype, device):
    """Forward and backward of both GPU paths on random balanced routing of the class `key`
    (pairs, experts, 2F, H, k): tplayers.backend.register."""
    from tplayers.kernels.grouped_matmul import grouped_mlp

    pairs, experts, two_f, hidden, k = key
    rows = max(1, pairs // k)
    scatter = torch.randperm(rows * k, device=device)  # every cell once, in expert order below
    counts = torch.bincount(torch.randint(experts, (rows * k,), device=device), minlength=experts)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    gate_up = (torch.randn(experts, two_f, hidden, device=device) * hidden**-0.5).to(dtype).requires_grad_()
    down = (torch.randn(experts, hidden, two_f // 2, device=device) * two_f**-0.5).to(dtype).requires_grad_()
    scale = torch.rand(rows * k, device=device, requires_grad=True)
    args = (x, scatter // k, scatter, k, counts, gate_up, down, scale)
    dout = torch.randn(rows, hidden, device=device, dtype=dtype)

    def step(fn):
        return lambda: fn(*args).backward(dout)

    return step(grouped_mlp), step(grouped_mm_mlp)


register("experts", _experts_recipe)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, factor):
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx, dy):
        return dy * ctx.factor, None


def scale_grad(t, factor):
    """`t` itself, its gradient multiplied by `factor` (1: `t`, no graph node)."""
    return t if factor == 1 else _ScaleGrad.apply(t, factor)
