"""Fused statistics pass of vocab-parallel cross-entropy, its launcher and `vocab_ce_stats_ref`.

One read of this rank's logits shard (R, V_local) gives, per row, in fp32: the local max, the
local sum of exp(logit - local max), the target logit if the target falls in this shard (else
0) and the local sum of logits (for label smoothing); the contract is in vocab_ce_ref.py,
re-exported here. Each program owns BLOCK_R rows and walks the vocab shard in BLOCK_V columns
with an online max / sum-exp, so any shard size works in bounded registers. The logits may be
a strided view (rows and columns), e.g. a slice of the LM head's output.

`vocab_ce_grad` is the fused LM-head loss's second pass over a chunk of logits it owns: with the
rows' global log-sum-exp known, it overwrites the logits with their gradient
scale * (softmax - onehot(target)) (the contract is `vocab_ce_grad_ref`), so the chunk's
gradient GEMMs read it without another (rows x vocabulary) buffer.
"""

import os

import torch
import triton
import triton.language as tl

from .vocab_ce_ref import (
    MAX,
    SUM,
    SUMEXP,
    TARGET,
    check_args,
    check_grad_args,
    vocab_ce_grad_ref,
    vocab_ce_stats_ref,
)

__all__ = [
    "MAX",
    "SUM",
    "SUMEXP",
    "TARGET",
    "vocab_ce_grad",
    "vocab_ce_grad_ref",
    "vocab_ce_stats",
    "vocab_ce_stats_ref",
]

# The interpreter must be chosen before triton is imported; record what was chosen.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The interpreter runs each program in numpy: few, large programs are fastest. A small BLOCK_V
# still makes the online max / sum-exp loop run several times on the test shapes.
INTERPRETER_CONFIG = {"BLOCK_R": 16, "BLOCK_V": 64}


@triton.jit
def _vocab_ce_stats_kernel(
    logits_ptr, target_ptr, stats_ptr,
    R, V, vocab_start,
    stride_lr, stride_lv, stride_t,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = offs_r < R
    # Wrap out-of-range rows onto valid ones so the loads need no row mask; never stored.
    rows = (offs_r % R).to(tl.int64)  # 64-bit: R * stride_lr can pass 2**31
    row_ptrs = logits_ptr + rows * stride_lr
    offs_v = tl.arange(0, BLOCK_V)

    row_max = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    sum_exp = tl.zeros((BLOCK_R,), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs_v
        col_ok = cols < V
        x = tl.load(row_ptrs[:, None] + cols.to(tl.int64)[None, :] * stride_lv, mask=col_ok[None, :],
                    other=float("-inf")).to(tl.float32)  # fmt: skip
        new_max = tl.maximum(row_max, tl.max(x, axis=1))
        # A row whose logits so far are all -inf (masked vocabulary) keeps max -inf and sum 0:
        # shift by 0 there instead, so exp(-inf - -inf) never makes a nan.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        sum_exp = sum_exp * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        row_max = new_max
        row_sum += tl.sum(tl.where(col_ok[None, :], x, 0.0), axis=1)

    # The target logit: one more element per row, read only where it lies in this shard.
    local = tl.load(target_ptr + rows * stride_t).to(tl.int64) - vocab_start
    hit = (local >= 0) & (local < V)
    picked = tl.load(logits_ptr + rows * stride_lr + tl.where(hit, local, 0) * stride_lv, mask=hit,
                     other=0.0).to(tl.float32)  # fmt: skip

    out = stats_ptr + offs_r.to(tl.int64) * 4
    tl.store(out + 0, row_max, mask=row_ok)
    tl.store(out + 1, sum_exp, mask=row_ok)
    tl.store(out + 2, picked, mask=row_ok)
    tl.store(out + 3, row_sum, mask=row_ok)


@triton.jit
def _vocab_ce_grad_kernel(
    logits_ptr, target_ptr, lse_ptr, scale_ptr,
    R, V, vocab_start,
    stride_lr, stride_lv, stride_t,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = offs_r < R
    rows = (offs_r % R).to(tl.int64)
    lse = tl.load(lse_ptr + rows)
    scale = tl.load(scale_ptr + rows)
    local = tl.load(target_ptr + rows * stride_t).to(tl.int64) - vocab_start
    row_ptrs = logits_ptr + rows * stride_lr
    offs_v = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs_v
        ok = row_ok[:, None] & (cols < V)[None, :]
        ptrs = row_ptrs[:, None] + cols.to(tl.int64)[None, :] * stride_lv
        x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        p = tl.exp(x - lse[:, None])
        p = tl.where(cols[None, :] == local[:, None], p - 1.0, p)
        tl.store(ptrs, (p * scale[:, None]).to(logits_ptr.dtype.element_ty), mask=ok)


def _gpu_config(V):
    """One row per program, the vocab shard in tiles of up to 4096 columns (fp32: 32 per thread at 4 warps)."""
    block_v = min(triton.next_power_of_2(V), 4096)
    return {"BLOCK_R": 1, "BLOCK_V": block_v}, (8 if block_v >= 4096 else 4)


def _launch(kernel, name, logits, tensors, vocab_start, stride_t):
    """Both kernels' launch: logits, the kernel's other tensors, then (R, V, vocab_start, the
    strides); one row per program on the GPU, a few large programs in the interpreter."""
    if not INTERPRET and not logits.is_cuda:
        raise RuntimeError(
            f"the Triton {name} needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported to run in "
            "Triton's interpreter; set_backend('torch') uses the reference"
        )
    R, V = logits.shape
    args = (logits, *tensors, R, V, vocab_start, logits.stride(0), logits.stride(1), stride_t)
    if INTERPRET:
        kernel[(triton.cdiv(R, INTERPRETER_CONFIG["BLOCK_R"]),)](*args, **INTERPRETER_CONFIG)
        return
    meta, warps = _gpu_config(V)
    with torch.cuda.device(logits.device):
        kernel[(triton.cdiv(R, meta["BLOCK_R"]),)](*args, **meta, num_warps=warps)


def vocab_ce_stats(logits, target, vocab_start=0):
    """Per-row max, sum-exp, target logit and logit sum of a vocab shard, in fp32, in one kernel.

    logits (R, V_local), target (R,) global ids, `vocab_start` the shard's first global id.
    Returns a new contiguous fp32 (R, 4) tensor with columns MAX, SUMEXP, TARGET, SUM.
    """
    check_args(logits, target, vocab_start)
    R, V = logits.shape
    stats = torch.empty((R, 4), device=logits.device, dtype=torch.float32)
    if R:
        _launch(_vocab_ce_stats_kernel, "vocab_ce_stats", logits, (target, stats), vocab_start, target.stride(0))
    return stats


def vocab_ce_grad(logits, target, lse, scale, vocab_start=0):
    """Overwrite `logits` (R, V_local) with scale * (softmax - onehot(target)), softmax over the
    whole vocabulary through the rows' global `lse` (R,) fp32; `scale` (R,) fp32 (0: an ignored
    row); returns `logits`. One read and one write of the shard, fp32 math."""
    check_grad_args(logits, target, lse, scale, vocab_start)
    if logits.shape[0]:
        _launch(_vocab_ce_grad_kernel, "vocab_ce_grad", logits, (target, lse, scale), vocab_start, target.stride(0))
    return logits
