"""Flash attention over position / document metadata: forward and backward Triton kernels, their
launchers and the pure-torch references (re-exported from flash_attention_ref.py, which gives the
contract).

Forward: one program per (BLOCK_M queries, head); an online softmax over BLOCK_N key tiles in
fp32, returning o and the natural-log lse that context parallelism merges partial results with.
A key tile is skipped whole when its tokens' bounds cannot meet the query tile's: every key after
every query (causal), every key outside the window, or no document in common. The bounds come
from the metadata the program loads anyway, so any token order (head-tail, per-document) skips
what it can.

Backward, FA2's split: `_flash_dkdv_kernel` walks the query tiles for one key/value tile of one
key/value head (every query head of its group in turn, so K / V are never expanded) and keeps dK,
dV in fp32; `_flash_dq_kernel` walks the key tiles for one query tile. Both use the final o and
lse (delta = rowsum(dO * O) is one torch reduction before them), so a context-parallel ring calls
it per key block with the merged o / lse and gets that block's exact share of each gradient.

Tensor cores: q k^T and p v (and the backward's four products) are tl.dot on the input dtype with
fp32 accumulation; fp32 inputs use input_precision "ieee" unless TF32 is enabled. The interpreter
multiplies bf16 bit patterns in tl.dot, so there tiles are upcast to fp32 (UPCAST).
"""

import contextlib
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .flash_attention_ref import check_attention_args, flash_attention_backward_ref, flash_attention_ref

__all__ = ["flash_attention", "flash_attention_backward", "flash_attention_backward_ref", "flash_attention_ref"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Small tiles in the interpreter, so the test shapes walk several tiles and skip some.
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16)
_BIG = 1 << 30  # tile bounds of a tile without real tokens: meets nothing


def _gpu_config(kernel, head_dim, arch):
    """Tiles and warps per kernel ("fwd", "dkdv", "dq"), head size and arch (80: Ampere, 90:
    Hopper), from the compile report (`tplayers compile-report --kernel flash-...`): no spills on
    sm_80 / sm_90a. On sm_80 a 128-row forward tile with head size 128 spills at 8 warps (255
    registers): 64 rows there; dK / dV at head size 64 spill with 64-key tiles at 4 or 8 warps: 32."""
    wide = head_dim > 64
    if kernel == "fwd":
        if arch == 80 and wide:
            return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
        return dict(BLOCK_M=128, BLOCK_N=64 if head_dim <= 128 else 32, num_warps=8 if wide else 4, num_stages=2)
    if kernel == "dkdv" and arch == 80 and not wide:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    # dkdv: one key tile against every query tile; dq: one query tile against every key tile
    return dict(BLOCK_M=64, BLOCK_N=64 if head_dim <= 128 else 32, num_warps=8 if wide else 4, num_stages=2)


@triton.jit
def _bounds_meet(qp_lo, qp_hi, qd_lo, qd_hi, kp_lo, kp_hi, kd_lo, kd_hi, window, CAUSAL: tl.constexpr,
                 HAS_WINDOW: tl.constexpr):  # fmt: skip
    """Whether a query tile and a key tile with these position / document bounds may have an allowed pair."""
    meets = (kd_hi >= qd_lo) & (kd_lo <= qd_hi)  # false where either tile has no real token
    if CAUSAL:
        meets = meets & (kp_lo <= qp_hi)
    if HAS_WINDOW:
        meets = meets & (kp_hi > qp_lo - window) & (kp_lo < qp_hi + window)
    return meets


@triton.jit
def _meets(qp_lo, qp_hi, qd_lo, qd_hi, kb, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Whether a query tile and the key tile whose bounds `kb` points at may have an allowed pair."""
    kp_lo, kp_hi = tl.load(kb), tl.load(kb + 1)
    kd_lo, kd_hi = tl.load(kb + 2), tl.load(kb + 3)
    return _bounds_meet(qp_lo, qp_hi, qd_lo, qd_hi, kp_lo, kp_hi, kd_lo, kd_hi, window, CAUSAL, HAS_WINDOW)


@triton.jit
def _scores(q, k, qp, qd, kp, kd, scale, softcap, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
            HAS_SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """fp32 scores of a tile (softcapped), -inf where a query may not see a key; and the softcap's
    tanh for the backward."""
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale
    t = s
    if HAS_SOFTCAP:  # softcap * tanh(s / softcap); t = tanh for the backward
        t = 2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0
        s = t * softcap
    ok = qd[:, None] == kd[None, :]
    diff = qp[:, None] - kp[None, :]
    if CAUSAL:
        ok = ok & (diff >= 0)
    if HAS_WINDOW:
        ok = ok & (diff < window) & (diff > -window)
    return tl.where(ok, s, float("-inf")), t


@triton.jit
def _flash_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, qpos_ptr, qdoc_ptr, kpos_ptr, kdoc_ptr, qbounds_ptr, kbounds_ptr,
    H, N_REP, M, N, D, scale, softcap, window,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kh = h // N_REP
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok, d_ok = offs_m < M, offs_d < D
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    qp = tl.load(qpos_ptr + b * M + offs_m, mask=m_ok, other=0)
    qd = tl.load(qdoc_ptr + b * M + offs_m, mask=m_ok, other=-2)
    qb = qbounds_ptr + (b * ((M + BLOCK_M - 1) // BLOCK_M) + tl.program_id(0)).to(tl.int64) * 4
    qp_lo, qp_hi = tl.load(qb), tl.load(qb + 1)
    qd_lo, qd_hi = tl.load(qb + 2), tl.load(qb + 3)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kh * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kh * stride_vh

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        kp = tl.load(kpos_ptr + b * N + offs_n, mask=n_ok, other=0)
        kd = tl.load(kdoc_ptr + b * N + offs_n, mask=n_ok, other=-1)
        kb = kbounds_ptr + (b * ((N + BLOCK_N - 1) // BLOCK_N) + n0 // BLOCK_N).to(tl.int64) * 4
        if _meets(qp_lo, qp_hi, qd_lo, qd_hi, kb, window, CAUSAL, HAS_WINDOW):
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s, t = _scores(q, k, qp, qd, kp, kd, scale, softcap, window, CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                             INPUT_PRECISION)  # fmt: skip
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # rows that have seen no allowed key yet keep max -inf: shift by 0 so no nan appears
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - shift[:, None])
            alpha = tl.exp(m_i - shift)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
            m_i = m_new

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    o_base = o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])  # fmt: skip
    tl.store(lse_ptr + bh.to(tl.int64) * M + offs_m, lse, mask=m_ok)


@triton.jit
def _flash_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    qpos_ptr, qdoc_ptr, kpos_ptr, kdoc_ptr, qbounds_ptr, kbounds_ptr,
    H, N_REP, M, N, D, scale, softcap, window,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bkh = tl.program_id(1)
    KH = H // N_REP
    b, kh = bkh // KH, bkh % KH
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok, d_ok = offs_n < N, offs_d < D
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + b.to(tl.int64) * stride_kb + kh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=kv_mask, other=0.0)  # fmt: skip
    v = tl.load(v_ptr + b.to(tl.int64) * stride_vb + kh * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                mask=kv_mask, other=0.0)  # fmt: skip
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    kp = tl.load(kpos_ptr + b * N + offs_n, mask=n_ok, other=0)
    kd = tl.load(kdoc_ptr + b * N + offs_n, mask=n_ok, other=-1)
    kb = kbounds_ptr + (b * ((N + BLOCK_N - 1) // BLOCK_N) + tl.program_id(0)).to(tl.int64) * 4
    kp_lo, kp_hi = tl.load(kb), tl.load(kb + 1)
    kd_lo, kd_hi = tl.load(kb + 2), tl.load(kb + 3)

    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for g in range(0, N_REP):  # every query head reading this key/value head
        h = kh * N_REP + g
        q_base = q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh
        do_base = do_ptr + b.to(tl.int64) * stride_dob + h * stride_doh
        row_base = (b * H + h).to(tl.int64) * M
        for m0 in range(0, M, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < M
            qp = tl.load(qpos_ptr + b * M + offs_m, mask=m_ok, other=0)
            qd = tl.load(qdoc_ptr + b * M + offs_m, mask=m_ok, other=-2)
            qb = qbounds_ptr + (b * ((M + BLOCK_M - 1) // BLOCK_M) + m0 // BLOCK_M).to(tl.int64) * 4
            qp_lo, qp_hi = tl.load(qb), tl.load(qb + 1)
            qd_lo, qd_hi = tl.load(qb + 2), tl.load(qb + 3)
            if _bounds_meet(qp_lo, qp_hi, qd_lo, qd_hi, kp_lo, kp_hi, kd_lo, kd_hi, window, CAUSAL, HAS_WINDOW):
                q_mask = m_ok[:, None] & d_ok[None, :]
                q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
                do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :], mask=q_mask, other=0.0)
                if UPCAST:
                    q = q.to(tl.float32)
                    do = do.to(tl.float32)
                lse = tl.load(lse_ptr + row_base + offs_m, mask=m_ok, other=float("-inf"))
                delta = tl.load(delta_ptr + row_base + offs_m, mask=m_ok, other=0.0)
                s, t = _scores(q, k, qp, qd, kp, kd, scale, softcap, window, CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                 INPUT_PRECISION)  # fmt: skip
                # exp(s - lse), 0 where not allowed (also on rows that see nothing: lse = -inf)
                p = tl.where(s == float("-inf"), 0.0, tl.exp(s - tl.where(lse == float("-inf"), 0.0, lse)[:, None]))
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=INPUT_PRECISION)
                ds = p * (tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION) - delta[:, None])
                if HAS_SOFTCAP:
                    ds = ds * (1.0 - t * t)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=INPUT_PRECISION)

    out = b.to(tl.int64) * KH * N * D + kh * N * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(dk_ptr + out, dk * scale, mask=kv_mask)
    tl.store(dv_ptr + out, dv, mask=kv_mask)


@triton.jit
def _flash_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    qpos_ptr, qdoc_ptr, kpos_ptr, kdoc_ptr, qbounds_ptr, kbounds_ptr,
    H, N_REP, M, N, D, scale, softcap, window,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kh = h // N_REP
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok, d_ok = offs_m < M, offs_d < D
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=q_mask, other=0.0)  # fmt: skip
    do = tl.load(do_ptr + b.to(tl.int64) * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :], mask=q_mask, other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * M + offs_m, mask=m_ok, other=float("-inf"))
    delta = tl.load(delta_ptr + bh.to(tl.int64) * M + offs_m, mask=m_ok, other=0.0)
    qp = tl.load(qpos_ptr + b * M + offs_m, mask=m_ok, other=0)
    qd = tl.load(qdoc_ptr + b * M + offs_m, mask=m_ok, other=-2)
    qb = qbounds_ptr + (b * ((M + BLOCK_M - 1) // BLOCK_M) + tl.program_id(0)).to(tl.int64) * 4
    qp_lo, qp_hi = tl.load(qb), tl.load(qb + 1)
    qd_lo, qd_hi = tl.load(qb + 2), tl.load(qb + 3)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kh * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kh * stride_vh

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        kp = tl.load(kpos_ptr + b * N + offs_n, mask=n_ok, other=0)
        kd = tl.load(kdoc_ptr + b * N + offs_n, mask=n_ok, other=-1)
        kb = kbounds_ptr + (b * ((N + BLOCK_N - 1) // BLOCK_N) + n0 // BLOCK_N).to(tl.int64) * 4
        if _meets(qp_lo, qp_hi, qd_lo, qd_hi, kb, window, CAUSAL, HAS_WINDOW):
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s, t = _scores(q, k, qp, qd, kp, kd, scale, softcap, window, CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                             INPUT_PRECISION)  # fmt: skip
            # exp(s - lse), 0 where not allowed (also on rows that see nothing: lse = -inf)
            p = tl.where(s == float("-inf"), 0.0, tl.exp(s - tl.where(lse == float("-inf"), 0.0, lse)[:, None]))
            ds = p * (tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION) - delta[:, None])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - t * t)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)

    out = bh.to(tl.int64) * M * D + offs_m[:, None] * D + offs_d[None, :]
    tl.store(dq_ptr + out, dq * scale, mask=q_mask)


def tile_bounds(pos, doc, block):
    """(B, cdiv(n, block), 4) int32: each tile's lowest / highest position and document over its
    real tokens (doc >= 0; none: +-2**30, which meets nothing). A few torch reductions per call, so
    the kernels skip tiles with four scalar loads."""
    B, n = pos.shape
    pad = -n % block
    doc = F.pad(doc, (0, pad), value=-1).view(B, -1, block)
    pos = F.pad(pos, (0, pad)).view(B, -1, block)
    real = doc >= 0
    bounds = [torch.where(real, t, fill).amin(-1) if fill > 0 else torch.where(real, t, fill).amax(-1)
              for t, fill in ((pos, _BIG), (pos, -_BIG), (doc, _BIG), (doc, -_BIG))]  # fmt: skip
    return torch.stack(bounds, -1).to(torch.int32).contiguous()


def _unit_last(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _flags(q, causal, window, softcap):
    fp32 = q.dtype == torch.float32
    return dict(
        CAUSAL=bool(causal), HAS_WINDOW=window is not None, HAS_SOFTCAP=bool(softcap),
        UPCAST=INTERPRET and q.dtype == torch.bfloat16,
        INPUT_PRECISION="tf32" if fp32 and torch.backends.cuda.matmul.allow_tf32 else "ieee",
        BLOCK_D=max(16, triton.next_power_of_2(q.shape[-1])),
    )  # fmt: skip


def _on(q):
    return torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()


def _config(kernel, head_dim):
    if INTERPRET:
        return dict(INTERPRETER_CONFIG)
    return _gpu_config(kernel, head_dim, 90 if torch.cuda.get_device_capability()[0] >= 9 else 80)


def _check_device(q):
    if not INTERPRET and not q.is_cuda:
        raise RuntimeError(
            "the Triton flash_attention needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported to "
            "run in Triton's interpreter; set_backend('torch') uses the reference"
        )


def _scalars(q, scale, window, softcap):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return scale, float(softcap or 0.0), int(window or 0)


def flash_attention(
    q, k, v, q_pos, q_doc, k_pos, k_doc, *, scale=None, causal=True, window=None, softcap=None, out_dtype=None
):  # fmt: skip
    """o, lse of attention over metadata (see flash_attention_ref.py); o in `out_dtype` (default
    q's: fp32 keeps a context-parallel ring's partial outputs unrounded until they are merged)."""
    check_attention_args(q, k, v, q_pos, q_doc, k_pos, k_doc)
    _check_device(q)
    q, k, v = map(_unit_last, (q, k, v))
    (B, H, M, D), (KH, N) = q.shape, k.shape[1:3]
    o = torch.empty((B, H, M, D), device=q.device, dtype=out_dtype or q.dtype)
    lse = torch.empty((B, H, M), device=q.device, dtype=torch.float32)
    if B * H * M == 0:
        return o, lse
    cfg = _config("fwd", D)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), B * H)
    bounds = tile_bounds(q_pos, q_doc, cfg["BLOCK_M"]), tile_bounds(k_pos, k_doc, cfg["BLOCK_N"])
    with _on(q):
        _flash_fwd_kernel[grid](
            q, k, v, o, lse, q_pos.contiguous(), q_doc.contiguous(), k_pos.contiguous(), k_doc.contiguous(), *bounds,
            H, H // KH, M, N, D, *_scalars(q, scale, window, softcap),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            **_flags(q, causal, window, softcap), **cfg,
        )  # fmt: skip
    return o, lse


def flash_attention_backward(
    do, q, k, v, o, lse, q_pos, q_doc, k_pos, k_doc, *, scale=None, causal=True, window=None, softcap=None
):  # fmt: skip
    """dq, dk, dv (fp32) of one key block, given the final o and lse (see flash_attention_ref.py)."""
    check_attention_args(q, k, v, q_pos, q_doc, k_pos, k_doc)
    _check_device(q)
    q, k, v, do = map(_unit_last, (q, k, v, do))
    (B, H, M, D), (KH, N) = q.shape, k.shape[1:3]
    delta = (do.float() * o.float()).sum(-1).contiguous()
    lse = lse.contiguous()
    dq = torch.zeros((B, H, M, D), device=q.device, dtype=torch.float32)
    dk = torch.zeros((B, KH, N, D), device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    if B * H * M * N == 0:
        return dq, dk, dv
    meta = (q_pos.contiguous(), q_doc.contiguous(), k_pos.contiguous(), k_doc.contiguous())
    kv_cfg, q_cfg = _config("dkdv", D), _config("dq", D)

    def bounds(cfg):
        return tile_bounds(q_pos, q_doc, cfg["BLOCK_M"]), tile_bounds(k_pos, k_doc, cfg["BLOCK_N"])

    common = (H, H // KH, M, N, D, *_scalars(q, scale, window, softcap),
              *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])  # fmt: skip
    flags = _flags(q, causal, window, softcap)
    with _on(q):
        _flash_dkdv_kernel[(triton.cdiv(N, kv_cfg["BLOCK_N"]), B * KH)](
            q, k, v, do, lse, delta, dk, dv, *meta, *bounds(kv_cfg), *common, **flags, **kv_cfg
        )
        _flash_dq_kernel[(triton.cdiv(M, q_cfg["BLOCK_M"]), B * H)](
            q, k, v, do, lse, delta, dq, *meta, *bounds(q_cfg), *common, **flags, **q_cfg
        )
    return dq, dk, dv
