"""Flash attention over position / document metadata: forward and backward Triton kernels, their
launchers and the pure-torch references (re-exported from flash_attention_ref.py, which gives the
contract).

Forward: one program per (BLOCK_M queries, head); an online softmax over BLOCK_N key tiles in
fp32 (exp2, the scale and log2(e) folded into one multiply of the scores), returning o and the
natural-log lse that context parallelism merges partial results with. Which key tiles a query
tile visits comes from the tokens' metadata, before the attention's launch (`tile_schedule`, one
small launch over each tile's position / document bounds; `tile_kinds` / `tile_lists` in
flash_attention_ref.py are its torch reference: any token order, head-tail or per-document,
skips what it can): tiles where no pair is allowed (every key after every query,
outside the window, no document in common) are not visited; tiles where every pair is allowed and
every token real run without metadata loads, masks or guards (FA2's off-diagonal tiles); the rest
run masked. Each program walks two lists of tile indices (whole, then masked) in
loops without a branch, which Triton pipelines (a branch in the loop body had kept its loads
from being pipelined), as FlexAttention's block masks do.

Backward, FA2's split: `_flash_dkdv_kernel` walks the query tiles (the same two lists, per key
tile) for one key/value tile of one key/value head (every query head of its group in turn, so
K / V are never expanded) and keeps dK, dV in fp32; `_flash_dq_kernel` walks the key tiles for
one query tile. Both use the final o and lse (delta = rowsum(dO * O) is one torch reduction
before them), so a context-parallel ring calls it per key block with the merged o / lse and gets
that block's exact share of each gradient.

Tensor cores: q k^T and p v (and the backward's four products) are tl.dot on the input dtype with
fp32 accumulation; fp32 inputs use input_precision "ieee" unless TF32 is enabled. The interpreter
multiplies bf16 bit patterns in tl.dot, so there tiles are upcast to fp32 (UPCAST).
"""

import contextlib
import math
import os

import torch
import triton
import triton.language as tl

from .flash_attention_ref import (
    NO_TOKEN,
    check_attention_args,
    flash_attention_backward_ref,
    flash_attention_ref,
)

__all__ = ["flash_attention", "flash_attention_backward", "flash_attention_backward_ref", "flash_attention_ref"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Small tiles in the interpreter, so the test shapes walk several tiles and skip some.
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16)
_NO_TOKEN = tl.constexpr(NO_TOKEN)  # tile bounds of a tile without real tokens: meets nothing


def _gpu_config(kernel, head_dim, arch):
    """Tiles and warps per kernel ("fwd", "dkdv", "dq"), head size and arch (80: Ampere, 90:
    Hopper), from the compile report (`tplayers compile-report --kernel flash-...`): no spills on
    sm_80 / sm_90a. On sm_80 a 128-row forward tile with head size 128 spills at 8 warps (255
    registers): 64 rows there; dK / dV at head size 64 spill with 64-key tiles at 4 or 8 warps: 32;
    on sm_90a dK / dV at head size 128 spill with 64-query tiles: 32. On sm_90 at head sizes 65-128
    the forward and dQ take the fastest spill-free config of bench/sweep.py on an H200 (2026-11-28,
    B1 H16 KH4 S4096 D128 bf16: 64 x 64 tiles on 4 warps, 3 stages; the forward 0.11 ms faster than
    128 x 64 on 8 warps, dQ 0.27 ms faster than 64 x 64 on 8 warps); the rest not yet tuned."""
    wide = head_dim > 64
    if arch == 90 and wide and head_dim <= 128 and kernel in ("fwd", "dq"):
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    if kernel == "fwd":
        if arch == 80 and wide:
            return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
        return dict(BLOCK_M=128, BLOCK_N=64 if head_dim <= 128 else 32, num_warps=8 if wide else 4, num_stages=2)
    if kernel == "dkdv" and arch == 80 and not wide:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if kernel == "dkdv" and arch == 90 and wide:  # 64-query tiles spill at 1-2 stages, 4-8 warps
        return dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=2)
    # dkdv: one key tile against every query tile; dq: one query tile against every key tile
    return dict(BLOCK_M=64, BLOCK_N=64 if head_dim <= 128 else 32, num_warps=8 if wide else 4, num_stages=2)


# exp(x) = exp2(x * log2(e)): the scores are kept in log2 units, the scale folded in (one multiply)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _scores(q, k, scale, softcap, HAS_SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """A tile's scores in log2 units (softcapped), all pairs; and the softcap's tanh for the backward."""
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    if HAS_SOFTCAP:  # softcap * tanh(scale * s / softcap); t = tanh for the backward
        t = 2.0 * tl.sigmoid(2.0 * scale * s / softcap) - 1.0
        return t * (softcap * LOG2E), t
    return s * (scale * LOG2E), s


@triton.jit
def _masked(s, qp, qd, kp, kd, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """`s` with -inf where a query may not see a key (a tile that is not whole: see _tile_lists)."""
    ok = qd[:, None] == kd[None, :]
    diff = qp[:, None] - kp[None, :]
    if CAUSAL:
        ok = ok & (diff >= 0)
    if HAS_WINDOW:
        ok = ok & (diff < window) & (diff > -window)
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _key_tile_scores(q, qp, qd, k_base, v_base, kpos, kdoc, n0, N, offs_d, d_ok, stride_kn, stride_vn, scale,
                     softcap, window, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                     BLOCK_N: tl.constexpr):  # fmt: skip
    """A key tile's K and V and the query tile's scores against it (log2 units; masked where the
    tile is not whole), with the softcap's tanh: what the forward and dQ passes share."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = offs_n < N
        kv_mask = n_ok[:, None] & d_ok[None, :]
    else:
        kv_mask = d_ok[None, :]
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s, t = _scores(q, k, scale, softcap, HAS_SOFTCAP, INPUT_PRECISION)
    if MASKED:
        kp = tl.load(kpos + offs_n, mask=n_ok, other=0)
        kd = tl.load(kdoc + offs_n, mask=n_ok, other=-1)
        s = _masked(s, qp, qd, kp, kd, window, CAUSAL, HAS_WINDOW)
    return k, v, s, t


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, qp, qd, k_base, v_base, kpos, kdoc, n0, N, offs_d, d_ok, stride_kn, stride_vn,
              scale, softcap, window, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """One key tile of the online softmax. A whole tile (every pair allowed, every token real) needs
    no metadata, no mask and no guard for rows that see nothing: FA2's off-diagonal tiles."""
    _, v, s, _ = _key_tile_scores(q, qp, qd, k_base, v_base, kpos, kdoc, n0, N, offs_d, d_ok, stride_kn, stride_vn,
                                  scale, softcap, window, MASKED, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, UPCAST,
                                  INPUT_PRECISION, BLOCK_N)  # fmt: skip
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:  # rows that have seen no allowed key yet keep max -inf: shift by 0 so no nan appears
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.math.exp2(s - m_new_safe[:, None])
    alpha = tl.math.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _flash_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, qpos_ptr, qdoc_ptr, kpos_ptr, kdoc_ptr, list_ptr, whole_ptr, meet_ptr,
    H, N_REP, M, N, D, TILES_N, scale, softcap, window,
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
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kh * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kh * stride_vh
    kpos, kdoc = kpos_ptr + b * N, kdoc_ptr + b * N
    row = (b * tl.num_programs(0) + tl.program_id(0)).to(tl.int64)
    tiles = list_ptr + row * TILES_N  # this query tile's key tiles: the whole ones first
    whole, meet = tl.load(whole_ptr + row), tl.load(meet_ptr + row)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for i in range(0, whole):
        n0 = tl.load(tiles + i) * BLOCK_N
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, qp, qd, k_base, v_base, kpos, kdoc, n0, N, offs_d, d_ok,
                                  stride_kn, stride_vn, scale, softcap, window, False, CAUSAL, HAS_WINDOW,
                                  HAS_SOFTCAP, UPCAST, INPUT_PRECISION, BLOCK_N)  # fmt: skip
    for i in range(whole, meet):
        n0 = tl.load(tiles + i) * BLOCK_N
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, qp, qd, k_base, v_base, kpos, kdoc, n0, N, offs_d, d_ok,
                                  stride_kn, stride_vn, scale, softcap, window, True, CAUSAL, HAS_WINDOW,
                                  HAS_SOFTCAP, UPCAST, INPUT_PRECISION, BLOCK_N)  # fmt: skip

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    o_base = o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])  # fmt: skip
    tl.store(lse_ptr + bh.to(tl.int64) * M + offs_m, lse, mask=m_ok)


@triton.jit
def _probabilities(s, lse2, MASKED: tl.constexpr):
    """exp(s - lse) from log2 units; under a mask 0 where not allowed (also on rows that see nothing:
    lse = -inf). A whole tile has neither."""
    if MASKED:
        return tl.where(s == float("-inf"), 0.0, tl.math.exp2(s - tl.where(lse2 == float("-inf"), 0.0, lse2)[:, None]))
    return tl.math.exp2(s - lse2[:, None])


@triton.jit
def _dkdv_tile(dk, dv, k, v, kp, kd, q_base, do_base, lse_ptr, delta_ptr, qpos, qdoc, m0, M, offs_d, d_ok,
               stride_qm, stride_dom, scale, softcap, window, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
               INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    offs_m = m0 + tl.arange(0, BLOCK_M)
    if MASKED:
        m_ok = offs_m < M
        q_mask = m_ok[:, None] & d_ok[None, :]
        lse = tl.load(lse_ptr + offs_m, mask=m_ok, other=float("-inf"))
        delta = tl.load(delta_ptr + offs_m, mask=m_ok, other=0.0)
    else:
        q_mask = d_ok[None, :]
        lse = tl.load(lse_ptr + offs_m)
        delta = tl.load(delta_ptr + offs_m)
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    s, t = _scores(q, k, scale, softcap, HAS_SOFTCAP, INPUT_PRECISION)
    if MASKED:
        qp = tl.load(qpos + offs_m, mask=m_ok, other=0)
        qd = tl.load(qdoc + offs_m, mask=m_ok, other=-2)
        s = _masked(s, qp, qd, kp, kd, window, CAUSAL, HAS_WINDOW)
    p = _probabilities(s, lse * LOG2E, MASKED)
    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=INPUT_PRECISION)
    ds = p * (tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION) - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _flash_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    qpos_ptr, qdoc_ptr, kpos_ptr, kdoc_ptr, list_ptr, whole_ptr, meet_ptr,
    H, N_REP, M, N, D, TILES_M, scale, softcap, window,
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
    qpos, qdoc = qpos_ptr + b * M, qdoc_ptr + b * M
    row = (b * tl.num_programs(0) + tl.program_id(0)).to(tl.int64)
    tiles = list_ptr + row * TILES_M  # this key tile's query tiles: the whole ones first
    whole, meet = tl.load(whole_ptr + row), tl.load(meet_ptr + row)

    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for g in range(0, N_REP):  # every query head reading this key/value head
        h = kh * N_REP + g
        q_base = q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh
        do_base = do_ptr + b.to(tl.int64) * stride_dob + h * stride_doh
        row_base = (b * H + h).to(tl.int64) * M
        for i in range(0, whole):
            m0 = tl.load(tiles + i) * BLOCK_M
            dk, dv = _dkdv_tile(dk, dv, k, v, kp, kd, q_base, do_base, lse_ptr + row_base, delta_ptr + row_base,
                                qpos, qdoc, m0, M, offs_d, d_ok, stride_qm, stride_dom, scale, softcap, window,
                                False, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, UPCAST, INPUT_PRECISION, BLOCK_M)  # fmt: skip
        for i in range(whole, meet):
            m0 = tl.load(tiles + i) * BLOCK_M
            dk, dv = _dkdv_tile(dk, dv, k, v, kp, kd, q_base, do_base, lse_ptr + row_base, delta_ptr + row_base,
                                qpos, qdoc, m0, M, offs_d, d_ok, stride_qm, stride_dom, scale, softcap, window,
                                True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, UPCAST, INPUT_PRECISION, BLOCK_M)  # fmt: skip

    out = b.to(tl.int64) * KH * N * D + kh * N * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(dk_ptr + out, dk * scale, mask=kv_mask)
    tl.store(dv_ptr + out, dv, mask=kv_mask)


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, qp, qd, k_base, v_base, kpos, kdoc, n0, N, offs_d, d_ok, stride_kn, stride_vn,
             scale, softcap, window, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
             HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
             BLOCK_N: tl.constexpr):  # fmt: skip
    k, v, s, t = _key_tile_scores(q, qp, qd, k_base, v_base, kpos, kdoc, n0, N, offs_d, d_ok, stride_kn, stride_vn,
                                  scale, softcap, window, MASKED, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, UPCAST,
                                  INPUT_PRECISION, BLOCK_N)  # fmt: skip
    p = _probabilities(s, lse2, MASKED)
    ds = p * (tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION) - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)


@triton.jit
def _flash_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    qpos_ptr, qdoc_ptr, kpos_ptr, kdoc_ptr, list_ptr, whole_ptr, meet_ptr,
    H, N_REP, M, N, D, TILES_N, scale, softcap, window,
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
    lse2 = tl.load(lse_ptr + bh.to(tl.int64) * M + offs_m, mask=m_ok, other=float("-inf")) * LOG2E
    delta = tl.load(delta_ptr + bh.to(tl.int64) * M + offs_m, mask=m_ok, other=0.0)
    qp = tl.load(qpos_ptr + b * M + offs_m, mask=m_ok, other=0)
    qd = tl.load(qdoc_ptr + b * M + offs_m, mask=m_ok, other=-2)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kh * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kh * stride_vh
    kpos, kdoc = kpos_ptr + b * N, kdoc_ptr + b * N
    row = (b * tl.num_programs(0) + tl.program_id(0)).to(tl.int64)
    tiles = list_ptr + row * TILES_N
    whole, meet = tl.load(whole_ptr + row), tl.load(meet_ptr + row)

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for i in range(0, whole):
        n0 = tl.load(tiles + i) * BLOCK_N
        dq = _dq_tile(dq, q, do, lse2, delta, qp, qd, k_base, v_base, kpos, kdoc, n0, N, offs_d, d_ok, stride_kn,
                      stride_vn, scale, softcap, window, False, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, UPCAST,
                      INPUT_PRECISION, BLOCK_N)  # fmt: skip
    for i in range(whole, meet):
        n0 = tl.load(tiles + i) * BLOCK_N
        dq = _dq_tile(dq, q, do, lse2, delta, qp, qd, k_base, v_base, kpos, kdoc, n0, N, offs_d, d_ok, stride_kn,
                      stride_vn, scale, softcap, window, True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, UPCAST,
                      INPUT_PRECISION, BLOCK_N)  # fmt: skip

    out = bh.to(tl.int64) * M * D + offs_m[:, None] * D + offs_d[None, :]
    tl.store(dq_ptr + out, dq * scale, mask=q_mask)


@triton.jit
def _bounds(pos_ptr, doc_ptr, offs, n):
    """Per row of token indices `offs` (rows, BLOCK): the lowest / highest position and document over
    its real tokens (doc >= 0; none: +-NO_TOKEN, which meets nothing), and whether every token is real."""
    inside = offs < n
    doc = tl.load(doc_ptr + offs, mask=inside, other=-1)
    pos = tl.load(pos_ptr + offs, mask=inside, other=0)
    real = doc >= 0
    p_lo, p_hi = tl.min(tl.where(real, pos, _NO_TOKEN), axis=1), tl.max(tl.where(real, pos, -_NO_TOKEN), axis=1)
    d_lo, d_hi = tl.min(tl.where(real, doc, _NO_TOKEN), axis=1), tl.max(tl.where(real, doc, -_NO_TOKEN), axis=1)
    return p_lo, p_hi, d_lo, d_hi, tl.min(real.to(tl.int32), axis=1) == 1


@triton.jit
def _kinds(qp_lo, qp_hi, qd_lo, qd_hi, q_all, kp_lo, kp_hi, kd_lo, kd_hi, k_all, window, CAUSAL: tl.constexpr,
           HAS_WINDOW: tl.constexpr):  # fmt: skip
    """tile_kinds' rule on tile bounds: 0 whole, 1 masked, 2 skipped."""
    meets = (kd_hi >= qd_lo) & (kd_lo <= qd_hi)
    whole = q_all & k_all & (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)
    if CAUSAL:
        meets = meets & (kp_lo <= qp_hi)
        whole = whole & (kp_hi <= qp_lo)
    if HAS_WINDOW:
        meets = meets & (kp_hi > qp_lo - window) & (kp_lo < qp_hi + window)
        whole = whole & (qp_hi - kp_lo < window) & (kp_hi - qp_lo < window)
    return tl.where(whole & meets, 0, tl.where(meets, 1, 2))


@triton.jit
def _row_kinds(rp_lo, rp_hi, rd_lo, rd_hi, r_all, col_pos, col_doc, c0, C, window, ROWS_ARE_QUERIES: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """The kinds of column tiles c0 .. c0 + CHUNK against one row tile (past the last tile: 2)."""
    tiles = c0 + tl.arange(0, CHUNK)
    offs = tiles[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    cp_lo, cp_hi, cd_lo, cd_hi, c_all = _bounds(col_pos, col_doc, offs, C)
    if ROWS_ARE_QUERIES:
        return _kinds(rp_lo, rp_hi, rd_lo, rd_hi, r_all, cp_lo, cp_hi, cd_lo, cd_hi, c_all, window, CAUSAL,
                      HAS_WINDOW), tiles  # fmt: skip
    return _kinds(cp_lo, cp_hi, cd_lo, cd_hi, c_all, rp_lo, rp_hi, rd_lo, rd_hi, r_all, window, CAUSAL,
                  HAS_WINDOW), tiles  # fmt: skip


@triton.jit
def _schedule_kernel(
    rpos_ptr, rdoc_ptr, cpos_ptr, cdoc_ptr, order_ptr, whole_ptr, meet_ptr, R, C, TILES_C, window,
    ROWS_ARE_QUERIES: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One row tile's list (tile_lists of tile_kinds, in one launch): its column tiles, whole ones then
    masked ones, each in order, and how many of each. Two passes over the column tiles: the first
    counts the whole ones, so the second can place the masked ones after them."""
    b = tl.program_id(1)
    row = (b * tl.num_programs(0) + tl.program_id(0)).to(tl.int64)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
    rp_lo, rp_hi, rd_lo, rd_hi, r_all = _bounds(rpos_ptr + b * R, rdoc_ptr + b * R, offs_r, R)
    col_pos, col_doc = cpos_ptr + b * C, cdoc_ptr + b * C
    n_whole = tl.zeros((1,), dtype=tl.int32)
    n_masked = tl.zeros((1,), dtype=tl.int32)
    for c0 in range(0, TILES_C, CHUNK):
        kind, _ = _row_kinds(rp_lo, rp_hi, rd_lo, rd_hi, r_all, col_pos, col_doc, c0, C, window, ROWS_ARE_QUERIES,
                             CAUSAL, HAS_WINDOW, BLOCK_C, CHUNK)  # fmt: skip
        n_whole += tl.sum((kind == 0).to(tl.int32), axis=0)
        n_masked += tl.sum((kind == 1).to(tl.int32), axis=0)
    first = tl.arange(0, 1)
    tl.store(whole_ptr + row + first, n_whole)
    tl.store(meet_ptr + row + first, n_whole + n_masked)
    next_whole = tl.zeros((1,), dtype=tl.int32)
    next_masked = n_whole
    for c0 in range(0, TILES_C, CHUNK):
        kind, tiles = _row_kinds(rp_lo, rp_hi, rd_lo, rd_hi, r_all, col_pos, col_doc, c0, C, window,
                                 ROWS_ARE_QUERIES, CAUSAL, HAS_WINDOW, BLOCK_C, CHUNK)  # fmt: skip
        is_whole, is_masked = (kind == 0).to(tl.int32), (kind == 1).to(tl.int32)
        slot = tl.where(kind == 0, next_whole + tl.cumsum(is_whole, axis=0), next_masked + tl.cumsum(is_masked, axis=0))
        tl.store(order_ptr + row * TILES_C + slot - 1, tiles, mask=kind <= 1)
        next_whole += tl.sum(is_whole, axis=0)
        next_masked += tl.sum(is_masked, axis=0)


def tile_schedule(row_pos, row_doc, col_pos, col_doc, block_r, block_c, causal, window, rows_are_queries=True):
    """tile_lists(tile_kinds(...)) (flash_attention_ref.py, its reference) in one launch (those torch
    ops are ~50 launches, which cost more than the attention at 4096 tokens): per row tile (query tiles, or with
    rows_are_queries=False key tiles), the column tiles to visit, whole first, and the two counts.
    Entries past a row's count are not written."""
    B, R = row_pos.shape
    C = col_pos.shape[1]
    rows, tiles_c = triton.cdiv(R, block_r), triton.cdiv(C, block_c)
    order = torch.empty((B, rows, tiles_c), dtype=torch.int32, device=row_pos.device)
    whole = torch.empty((B, rows), dtype=torch.int32, device=row_pos.device)
    meet = torch.empty_like(whole)
    chunk = max(2, min(64, triton.next_power_of_2(tiles_c), 8192 // block_c))
    _schedule_kernel[(rows, B)](
        row_pos, row_doc, col_pos, col_doc, order, whole, meet, R, C, tiles_c, int(window or 0),
        ROWS_ARE_QUERIES=rows_are_queries, CAUSAL=bool(causal), HAS_WINDOW=window is not None,
        BLOCK_R=block_r, BLOCK_C=block_c, CHUNK=chunk,
    )  # fmt: skip
    return order, whole, meet


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
    q_pos, q_doc, k_pos, k_doc = (t.contiguous() for t in (q_pos, q_doc, k_pos, k_doc))
    with _on(q):
        order, whole, meet = tile_schedule(q_pos, q_doc, k_pos, k_doc, cfg["BLOCK_M"], cfg["BLOCK_N"], causal, window)
        _flash_fwd_kernel[grid](
            q, k, v, o, lse, q_pos, q_doc, k_pos, k_doc,
            order, whole, meet, H, H // KH, M, N, D, order.shape[2], *_scalars(q, scale, window, softcap),
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
    dq = torch.empty((B, H, M, D), device=q.device, dtype=torch.float32)  # every element written below
    dk = torch.empty((B, KH, N, D), device=q.device, dtype=torch.float32)
    dv = torch.empty_like(dk)
    if B * H * M * N == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    meta = q_pos, q_doc, k_pos, k_doc = tuple(t.contiguous() for t in (q_pos, q_doc, k_pos, k_doc))
    kv_cfg, q_cfg = _config("dkdv", D), _config("dq", D)
    scalars, strides = _scalars(q, scale, window, softcap), (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                                              *do.stride()[:3])  # fmt: skip
    flags = _flags(q, causal, window, softcap)
    with _on(q):
        by_key = tile_schedule(k_pos, k_doc, q_pos, q_doc, kv_cfg["BLOCK_N"], kv_cfg["BLOCK_M"], causal, window,
                               rows_are_queries=False)  # per key tile, its query tiles  # fmt: skip
        by_query = tile_schedule(q_pos, q_doc, k_pos, k_doc, q_cfg["BLOCK_M"], q_cfg["BLOCK_N"], causal, window)
        _flash_dkdv_kernel[(triton.cdiv(N, kv_cfg["BLOCK_N"]), B * KH)](
            q, k, v, do, lse, delta, dk, dv, *meta, *by_key, H, H // KH, M, N, D, by_key[0].shape[2],
            *scalars, *strides, **flags, **kv_cfg,
        )  # fmt: skip
        _flash_dq_kernel[(triton.cdiv(M, q_cfg["BLOCK_M"]), B * H)](
            q, k, v, do, lse, delta, dq, *meta, *by_query, H, H // KH, M, N, D, by_query[0].shape[2],
            *scalars, *strides, **flags, **q_cfg,
        )  # fmt: skip
    return dq, dk, dv
