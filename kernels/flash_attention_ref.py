"""Attention over tokens described by their positions and documents: the contract of
kernels/flash_attention.py, in pure torch (the CPU path, the test oracle, the benchmark baseline).

q (B, H, M, D) and k, v (B, KH, N, D), with KH dividing H: query head h reads key/value head
h // (H / KH), as HF's `repeat_kv` does, without expanding K / V. Which key a query sees comes
from per-token int32 metadata only, so the tokens may be in any order (a context-parallel rank
holds a permuted part of the sequence):

    q_pos (B, M), k_pos (B, N): the tokens' indices in the whole sequence (causality, windows)
    q_doc (B, M), k_doc (B, N): document ids; a query sees a key only of its own document.
        Padding keys carry -1 and padding queries -2, so nothing sees them and they see nothing.

    allowed(i, j) = q_doc[i] == k_doc[j]
                    and (not causal or k_pos[j] <= q_pos[i])
                    and (window is None or |q_pos[i] - k_pos[j]| < window)
    s = scale * q k^T, then softcap * tanh(s / softcap) where softcap is given (Gemma 2)

Returns o (B, H, M, D) in q's dtype (or `out_dtype`) and the natural-log log-sum-exp lse (B, H, M) in fp32; a
query that sees no key gets o = 0 and lse = -inf. The backward takes the final o and lse (of
every key block merged, under context parallelism), so it is the gradient of one block's share:
dq (B, H, M, D), dk and dv (B, KH, N, D), all fp32.
"""

import math

import torch
import torch.nn.functional as F

__all__ = ["check_attention_args", "flash_attention_backward_ref", "flash_attention_ref", "tile_kinds", "tile_lists"]

NO_TOKEN = 1 << 30  # tile bounds of a tile without real tokens: meets nothing


FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check_attention_args(q, k, v, q_pos, q_doc, k_pos, k_doc, dtypes=FLOATS):
    """(The reference takes fp64 too, as an oracle.)"""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"flash_attention: q (B, H, M, D), k and v (B, KH, N, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    (B, H, M, D), (_, KH, N, _) = q.shape, k.shape
    if k.shape[0] != B or k.shape[3] != D or KH == 0 or H % KH:
        raise ValueError(f"flash_attention: k {tuple(k.shape)} does not match q {tuple(q.shape)} (KH must divide H)")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.dtype not in dtypes:
        raise ValueError(f"flash_attention: q, k, v must share one of {dtypes}, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")  # fmt: skip
    for name, t, n in (("q_pos", q_pos, M), ("q_doc", q_doc, M), ("k_pos", k_pos, N), ("k_doc", k_doc, N)):
        if t.shape != (B, n) or t.dtype != torch.int32:
            raise ValueError(f"flash_attention: {name} must be int32 ({B}, {n}), got {t.dtype} {tuple(t.shape)}")


def _acc(t):
    """fp32 for the low-precision dtypes, fp64 kept (the oracle)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q, k, q_pos, q_doc, k_pos, k_doc, scale, causal, window, softcap):
    """fp32 scores (B, H, M, N) with -inf where a query may not see a key, and the capped
    pre-mask scores' tanh (for the backward; None without softcap)."""
    n_rep = q.shape[1] // k.shape[1]
    kf = _acc(k).repeat_interleave(n_rep, dim=1)
    s = torch.matmul(_acc(q), kf.transpose(-1, -2)) * scale
    tanh = None
    if softcap:
        tanh = torch.tanh(s / softcap)
        s = tanh * softcap
    allowed = q_doc[:, :, None] == k_doc[:, None, :]
    diff = q_pos[:, :, None].long() - k_pos[:, None, :].long()
    if causal:
        allowed &= diff >= 0
    if window is not None:
        allowed &= diff.abs() < window
    return s.masked_fill(~allowed[:, None], float("-inf")), tanh


def _probabilities(s, lse):
    """exp(s - lse), 0 where the query sees nothing (lse = -inf)."""
    shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - shift[..., None])


def flash_attention_ref(
    q, k, v, q_pos, q_doc, k_pos, k_doc, *, scale=None, causal=True, window=None, softcap=None, out_dtype=None
):  # fmt: skip
    check_attention_args(q, k, v, q_pos, q_doc, k_pos, k_doc, (*FLOATS, torch.float64))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s, _ = _scores(q, k, q_pos, q_doc, k_pos, k_doc, scale, causal, window, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = _probabilities(s, lse)
    n_rep = q.shape[1] // k.shape[1]
    o = torch.matmul(p, _acc(v).repeat_interleave(n_rep, dim=1))
    return o.to(out_dtype or q.dtype), lse


def flash_attention_backward_ref(
    do, q, k, v, o, lse, q_pos, q_doc, k_pos, k_doc, *, scale=None, causal=True, window=None, softcap=None
):  # fmt: skip
    check_attention_args(q, k, v, q_pos, q_doc, k_pos, k_doc, (*FLOATS, torch.float64))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    (B, H, _, D), KH = q.shape, k.shape[1]
    n_rep = H // KH
    s, tanh = _scores(q, k, q_pos, q_doc, k_pos, k_doc, scale, causal, window, softcap)
    p = _probabilities(s, lse)
    do, vf = _acc(do), _acc(v).repeat_interleave(n_rep, dim=1)
    delta = (do * _acc(o)).sum(-1, keepdim=True)
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
    if softcap:
        ds = ds * (1.0 - tanh * tanh)
    kf = _acc(k).repeat_interleave(n_rep, dim=1)
    dq = torch.matmul(ds, kf) * scale
    dk = (torch.matmul(ds.transpose(-1, -2), _acc(q)) * scale).view(B, KH, n_rep, -1, D).sum(2)
    dv = torch.matmul(p.transpose(-1, -2), do).view(B, KH, n_rep, -1, D).sum(2)
    return dq, dk, dv


# -- which key tiles each query tile visits: the reference of the kernels' schedule (tile_schedule) --


def tile_bounds(pos, doc, block):
    """(B, cdiv(n, block), 4) int32: each tile's lowest / highest position and document over its
    real tokens (doc >= 0; none: +-2**30, which meets nothing); and (B, tiles) bool: whether every
    token of the tile is real (a last tile past n is not)."""
    B, n = pos.shape
    pad = -n % block
    doc = F.pad(doc, (0, pad), value=-1).view(B, -1, block)
    pos = F.pad(pos, (0, pad)).view(B, -1, block)
    real = doc >= 0
    bounds = [torch.where(real, t, fill).amin(-1) if fill > 0 else torch.where(real, t, fill).amax(-1)
              for t, fill in ((pos, NO_TOKEN), (pos, -NO_TOKEN), (doc, NO_TOKEN), (doc, -NO_TOKEN))]  # fmt: skip
    return torch.stack(bounds, -1), real.all(-1)


def tile_kinds(q_pos, q_doc, k_pos, k_doc, block_m, block_n, causal, window):
    """(B, query tiles, key tiles) int8: 0 where every pair of the two tiles is allowed and every
    token real (a whole tile: no mask), 1 where some pair may be (a masked tile), 2 where none is
    (skipped). From the tiles' bounds: any token order (head-tail, per-document) skips what it can."""
    (qb, q_real), (kb, k_real) = tile_bounds(q_pos, q_doc, block_m), tile_bounds(k_pos, k_doc, block_n)
    qp_lo, qp_hi, qd_lo, qd_hi = (t[:, :, None] for t in qb.unbind(-1))
    kp_lo, kp_hi, kd_lo, kd_hi = (t[:, None, :] for t in kb.unbind(-1))
    meets = (kd_hi >= qd_lo) & (kd_lo <= qd_hi)  # false where either tile has no real token
    whole = q_real[:, :, None] & k_real[:, None, :] & (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)
    if causal:
        meets &= kp_lo <= qp_hi
        whole &= kp_hi <= qp_lo
    if window is not None:
        meets &= (kp_hi > qp_lo - window) & (kp_lo < qp_hi + window)
        whole &= (qp_hi - kp_lo < window) & (kp_hi - qp_lo < window)
    return torch.where(whole & meets, 0, torch.where(meets, 1, 2)).to(torch.int8)


def tile_lists(kinds):
    """Per row of `kinds` (B, rows, tiles): the tiles to visit, whole ones first then masked ones,
    in order within each (int32, (B, rows, tiles)), and how many are whole and how many meet at
    all (int32, (B, rows) each). The kernels loop over these without a branch, which Triton's
    software pipelining needs; FlexAttention's block masks keep the same two lists."""
    order = torch.sort(kinds, dim=-1, stable=True).indices.to(torch.int32).contiguous()
    whole = (kinds == 0).sum(-1, dtype=torch.int32).contiguous()
    meet = (kinds <= 1).sum(-1, dtype=torch.int32).contiguous()
    return order, whole, meet
