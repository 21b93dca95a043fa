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


def expert_mlp(x, gather, counts, gate_up, down, scale, act):
    """Per pair p of expert e (rows sorted by expert, `counts[e]` each): scale[p] * W_down[e]
    (act(gate) * up) of x[gather[p]], with gate_up[e] = [W_gate; W_up] (2F, H) and down[e] (H, F).
    Returns (pairs, H) in x's dtype."""
    if uses_triton(x):
        from tplayers.kernels.grouped_matmul import grouped_mlp

        if is_silu(act):
            return grouped_mlp(x, gather, counts, gate_up, down, scale)
    from tplayers.kernels.grouped_matmul_ref import grouped_matmul_ref

    if is_silu(act):
        h = grouped_matmul_ref(x, gate_up, counts, gather=gather, swiglu=True)
    else:
        gate, up = grouped_matmul_ref(x, gate_up, counts, gather=gather).chunk(2, dim=-1)
        h = act(gate) * up
    return grouped_matmul_ref(h, down, counts, scale=scale)


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
