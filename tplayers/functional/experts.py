"""The experts' MLP over (token, expert) pairs sorted by expert: act(x W_gate^T) * (x W_up^T),
then W_down, each pair's output scaled by its routing weight, in two grouped GEMMs
(`kernels/grouped_matmul.py`: rows read through the pairs' gather index, SwiGLU fused into the
first GEMM, the routing weight into the second) on the Triton backend, or their pure-torch
reference (differentiable as it is) on the torch backend.
"""

import torch
from torch import nn

from tplayers.backend import uses_triton


def is_silu(act) -> bool:
    """Whether `act` is SiLU (torch's, or HF's SiLUActivation): the epilogue the kernel fuses."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is torch.nn.functional.silu


def expert_mlp(x, pairs, k, gate_up, down, scale, act):
    """Each received row's sum over its (token, expert) pairs (`tplayers.functional.dispatch.Pairs`:
    rows of x through `gather`, sorted by expert) of scale[p] * W_down[e] (act(gate) * up), with
    gate_up[e] = [W_gate; W_up] (2F, H) and down[e] (H, F); the pairs summed in pick order.
    Returns (rows, H) in x's dtype."""
    rows = x.shape[0]
    if uses_triton(x) and is_silu(act):
        from tplayers.kernels.grouped_matmul import grouped_mlp

        return grouped_mlp(x, pairs.gather, pairs.scatter, k, pairs.counts, gate_up, down, scale)
    from tplayers.kernels.grouped_matmul_ref import grouped_matmul_ref

    if is_silu(act):
        h = grouped_matmul_ref(x, gate_up, pairs.counts, gather=pairs.gather, swiglu=True)
    else:
        gate, up = grouped_matmul_ref(x, gate_up, pairs.counts, gather=pairs.gather).chunk(2, dim=-1)
        h = act(gate) * up
    cells = grouped_matmul_ref(h, down, pairs.counts, scale=scale, scatter=pairs.scatter, out_rows=rows * k)
    return cells.view(rows, k, down.shape[1]).sum(1)


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
