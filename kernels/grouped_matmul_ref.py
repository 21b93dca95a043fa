"""`grouped_matmul_ref`: the pure-torch grouped GEMM over experts with the Triton
`grouped_matmul`'s signature and contract. No triton import here: it is the CPU path, the test
oracle and the benchmark baseline.

The rows are (token, expert) pairs sorted by expert: expert e has `counts[e]` of them, in order.
Weights follow nn.Linear's layout per expert, w: (E, N, K). For pair p of expert e:

    y[p] = x[gather[p]] @ w[e]^T              fp32 accumulation; gather None: row p of x
    y[p] = silu(y[p, :N/2]) * y[p, N/2:]      swiglu=True: w[e] holds [gate; up], y is (P, N/2)
    y[p] = y[p] * scale[p]                     scale (P,): the routing weight (None: 1)
    out[scatter[p]] = y[p]                     scatter None: out = y (P rows); else `out_rows`
                                               rows, zero where no pair is written

cast to x's dtype once, at the end. An expert with no pairs, or no experts at all, is fine: its
weights are read by no row (and get a zero gradient through autograd, not None).

`grouped_weight_grad_ref`: dW[e] = dy[rows of e]^T @ x[gather[rows of e]], in fp32, (E, N, K).
"""

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_args(x, w, counts, gather, scale, swiglu, scatter, out_rows):
    """Every check `grouped_matmul` and `grouped_matmul_ref` make; returns the output shape."""
    if x.dtype != w.dtype or x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"grouped_matmul: x and w must share a float dtype, got {x.dtype} and {w.dtype}")
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_matmul: x (rows, K) and w (E, N, K), got {tuple(x.shape)} and {tuple(w.shape)}")
    if counts.dim() != 1 or counts.shape[0] != w.shape[0]:
        raise ValueError(f"grouped_matmul: counts must hold one count per expert ({w.shape[0]}), got {counts.shape}")
    pairs = int(counts.sum()) if counts.numel() else 0
    if gather is None and pairs != x.shape[0]:
        raise ValueError(f"grouped_matmul: {pairs} pairs but x has {x.shape[0]} rows and no gather index")
    for name, t in (("gather", gather), ("scale", scale), ("scatter", scatter)):
        if t is not None and (t.dim() != 1 or t.shape[0] != pairs):
            raise ValueError(f"grouped_matmul: {name} must hold one entry per pair ({pairs}), got {tuple(t.shape)}")
        if t is not None and t.device != x.device:
            raise ValueError(f"grouped_matmul: {name} is on {t.device} but x is on {x.device}")
    if swiglu and w.shape[1] % 2:
        raise ValueError(f"grouped_matmul(swiglu=True): w's N ({w.shape[1]}) must hold [gate; up] halves")
    if (scatter is None) != (out_rows is None):
        raise ValueError("grouped_matmul: scatter and out_rows go together")
    n = w.shape[1] // 2 if swiglu else w.shape[1]
    return (pairs if scatter is None else out_rows, n)


def grouped_matmul_ref(x, w, counts, *, gather=None, scale=None, swiglu=False, scatter=None, out_rows=None):
    check_args(x, w, counts, gather, scale, swiglu, scatter, out_rows)
    rows = x.index_select(0, gather) if gather is not None else x
    parts = []
    for e, part in enumerate(rows.split(counts.tolist())):
        y = F.linear(part.float(), w[e].float())
        if swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        parts.append(y)
    n = w.shape[1] // 2 if swiglu else w.shape[1]
    if parts:
        y = torch.cat(parts)
    else:  # no experts here: w (empty) still in the graph, so its gradient is an (empty) zero, not None
        y = rows.float() @ rows.new_zeros(rows.shape[1], n, dtype=torch.float32) + 0 * w.float().sum()
    if scale is not None:
        y = y * scale.float()[:, None]
    y = y.to(x.dtype)
    if scatter is None:
        return y
    return y.new_zeros(out_rows, n).index_copy(0, scatter, y)


def grouped_weight_grad_ref(dy, x, counts, *, gather=None):
    """dW (E, N, K) in fp32: each expert's pairs' dy^T @ x rows."""
    rows = x.index_select(0, gather) if gather is not None else x
    grads = [
        d.float().t() @ r.float() for d, r in zip(dy.split(counts.tolist()), rows.split(counts.tolist()), strict=True)
    ]
    if grads:
        return torch.stack(grads)
    return dy.new_zeros(0, dy.shape[1], x.shape[1], dtype=torch.float32)
