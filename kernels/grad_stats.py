"""The fused gradient pass of dynamic loss scaling + global gradient clipping as one Triton
multi-tensor kernel: unscale in place, per-tensor [sum |g|, sum g^2, max |g|] and the
non-finite flag, reading every gradient once. The launcher, and the pure-torch reference
re-exported from grad_stats_ref.py (which states the contract).

Multi-tensor apply: the tensors are grouped by dtype and each group is ONE launch over all of its
tensors. A device table holds each tensor's base address (`data_ptr()` as int64, cast back to a
typed pointer in the kernel) and a per-block table (tensor index, start element) gives every
program one BLOCK-long contiguous chunk of one tensor, so loads are coalesced whatever the
tensor sizes. Each program writes its partial [sum |g|, sum g^2, max |g|, non-finite] to its own
column of a partials buffer (no atomics: deterministic); torch reduces the partials of each tensor
(a contiguous run of blocks) with segment reductions, also deterministic.

Layouts: a tensor whose elements fill its memory span (contiguous, or a permutation such as a
transpose: `_fills_its_span`) is processed in place in memory order, which
neither the elementwise unscale nor the order-free statistics care about. Any other layout
(a slice with gaps) goes through a contiguous copy that is written back after the kernel:
correct, but two extra passes over that tensor; gradients are dense in practice.
"""

import math
import os

import torch
import triton
import triton.language as tl

from .grad_stats_ref import check_tensors, inv_scale_tensor, unscale_and_stats_ref

__all__ = ["GPU_CONFIG", "unscale_and_stats_", "unscale_and_stats_ref"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# 4096 elements over 8 warps = 16 a thread: 2 (fp16 / bf16) or 4 (fp32) 16-byte loads a thread.
# Compiled for sm_80 / sm_90a: 31-32 registers (statistics only) to 45-52 (unscale), no spills,
# so 4-8 programs (32-64 warps) are resident per SM, with 32-128 KiB of loads in flight: above
# the ~20 KiB per SM that H100's HBM3 needs (3.35 TB/s * ~0.8 us latency / 132 SMs). The
# partials cost 16 bytes per 8-16 KiB read, noise next to the gradients.
GPU_CONFIG = dict(BLOCK=4096, num_warps=8)
# The interpreter runs each program in numpy: few, large programs are fastest, but tests keep
# tensors small, so a block of 512 still gives them several blocks per tensor to reduce.
INTERPRETER_CONFIG = dict(BLOCK=512)

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# Pointers (data_ptr() values) that are multiples of this let the kernel promise 16-byte alignment,
# so the compiler emits 128-bit vector loads; the caching allocator's blocks always are.
ALIGNMENT = 16


@triton.jit
def _to_fp32(x, EMULATE_BF16: tl.constexpr):
    if EMULATE_BF16:  # bf16 is the top half of an fp32: exact
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _round_to(y, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even (what the GPU's cvt.rn and torch do)."""
    if EMULATE_BF16:
        bits = y.to(tl.uint32, bitcast=True)
        # Add just under half a bf16 ulp, plus one if the kept part is odd: ties go to even;
        # a carry into the exponent is the correct round-up (to inf past the largest bf16).
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(y != y, 0x7FC0, rounded)  # nan: the canonical quiet nan, as torch
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return y.to(DTYPE)


@triton.jit
def _unscale_stats_kernel(
    ptr_table_ptr, block_table_ptr, inv_scale_ptr, partials_ptr,
    n_blocks,
    DTYPE: tl.constexpr, UNSCALE: tl.constexpr, ALIGNED: tl.constexpr, EMULATE_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One BLOCK-long chunk of one tensor per program.

    Params: ptr_table_ptr int64 [n_tensors] (data_ptr() of each tensor), block_table_ptr int64
    [3, n_blocks] (rows: tensor index, start element of the block, elements of the tensor from
    that start on), inv_scale_ptr fp32 [1] (read only if UNSCALE), partials_ptr fp32
    [4, n_blocks] (out: sum |g|, sum g^2, max |g| (nan if any g is), non-finite 0/1), n_blocks i32.
    Constexprs: DTYPE (tl.float32 / tl.float16 / tl.bfloat16: every tensor of the launch),
    UNSCALE (multiply in place by inv_scale), ALIGNED (every data_ptr() is 16-byte aligned),
    EMULATE_BF16 (bf16 <-> fp32 by integer bit operations; False on GPU), BLOCK. Grid: (n_blocks,).
    Ahead of time: signature *i64, *i64, *fp32, *fp32 (all 16-byte aligned), i32, with GPU_CONFIG's
    BLOCK / num_warps, ALIGNED=True and EMULATE_BF16=False (sm_80 / sm_90a: 31-52 registers, no
    spills, 128-bit loads and stores in full blocks).
    """
    pid = tl.program_id(0)
    tensor = tl.load(block_table_ptr + pid)
    # 64-bit by construction: the block's start is an int64 scalar added to the base pointer once,
    # so tensors of >= 2**31 elements need no special case; per-element offsets stay in [0, BLOCK).
    start = tl.load(block_table_ptr + n_blocks + pid)
    base = tl.load(ptr_table_ptr + tensor).to(tl.pointer_type(DTYPE))
    if ALIGNED:  # a pointer read from memory has unknown alignment: without this hint (on the
        base = tl.multiple_of(base, 16)  # pointer; the int64 before the cast loses it) no 128-bit loads
    base += tl.multiple_of(start, BLOCK)
    # The block's element count comes from the table, so the compiler cannot prove a mask
    # constant over 16-byte groups: full blocks (all but each tensor's last) load unmasked and
    # vectorised, the tail block masked. The branch is uniform across the program.
    remaining = tl.minimum(tl.load(block_table_ptr + 2 * n_blocks + pid), BLOCK).to(tl.int32)
    offs = tl.arange(0, BLOCK)
    ptrs = base + offs
    mask = offs < remaining  # 32-bit compares: the count is capped at BLOCK
    full = remaining == BLOCK
    if full:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    g = _to_fp32(x, EMULATE_BF16)
    if UNSCALE:
        # fp32 product, one rounding to the dtype: torch's _amp_foreach_non_finite_check_and_unscale_
        y = _round_to(g * tl.load(inv_scale_ptr), DTYPE, EMULATE_BF16)
        if full:
            tl.store(ptrs, y)
        else:
            tl.store(ptrs, y, mask=mask)
        g = _to_fp32(y, EMULATE_BF16)  # statistics of what is stored, not of the fp32 product
    a = tl.abs(g)  # masked lanes are 0: they add nothing to any statistic
    is_nan = g != g
    # The hardware max drops nan (max.f32 returns the other operand): propagate it explicitly.
    amax = tl.where(tl.max(is_nan.to(tl.int32), axis=0) > 0, float("nan"), tl.max(a, axis=0))
    nonfinite = tl.max((is_nan | (a == float("inf"))).to(tl.float32), axis=0)
    tl.store(partials_ptr + pid, tl.sum(a, axis=0))
    tl.store(partials_ptr + n_blocks + pid, tl.sum(g * g, axis=0))
    tl.store(partials_ptr + 2 * n_blocks + pid, amax)
    tl.store(partials_ptr + 3 * n_blocks + pid, nonfinite)


def _fills_its_span(t):
    """Whether t's elements are exactly the numel() slots from data_ptr() on, in some dim order
    (contiguous, transposed, any permutation): then memory order is a valid visiting order."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if size == 0:
            return True
        if stride != expected:  # a gap (sliced) or an overlap (expanded, stride 0)
            return False
        expected *= size
    return True


# (device, dtype, BLOCK, numels) -> (block table, blocks per tensor): shapes repeat every step,
# so the tables are built once; only the small pointer table is uploaded per call.
_BLOCK_TABLES = {}
_MAX_CACHED = 16


def _block_table(numels, dtype, block, device):
    """int64 [3, n_blocks] on `device` (tensor index, start element, elements left from start)
    and the blocks per tensor, int64 [n_tensors] (the segment lengths of the partials)."""
    key = (device, dtype, block, numels)
    if key not in _BLOCK_TABLES:
        counts = torch.tensor([triton.cdiv(n, block) for n in numels], dtype=torch.int64)
        tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
        first = torch.cumsum(counts, 0) - counts  # index of each tensor's first block
        start = (torch.arange(len(tensor)) - first[tensor]) * block
        remaining = torch.tensor(numels, dtype=torch.int64)[tensor] - start
        table = torch.stack([tensor, start, remaining]).to(device)
        if len(_BLOCK_TABLES) >= _MAX_CACHED:
            _BLOCK_TABLES.pop(next(iter(_BLOCK_TABLES)))  # oldest first
        _BLOCK_TABLES[key] = (table, counts.to(device))
    return _BLOCK_TABLES[key]


def _launch_group(tensors, inv, cfg):
    """One launch over same-dtype, dense tensors. Returns (stats fp32 [k, 3], found_inf fp32 [1])."""
    device, dtype, block = tensors[0].device, tensors[0].dtype, cfg["BLOCK"]
    table, counts = _block_table(tuple(t.numel() for t in tensors), dtype, block, device)
    n_blocks = table.shape[1]
    if n_blocks == 0:  # only empty tensors
        return torch.zeros((len(tensors), 3), device=device), torch.zeros(1, device=device)
    ptrs = [t.data_ptr() for t in tensors]
    ptr_table = torch.tensor(ptrs, dtype=torch.int64).to(device)
    partials = torch.empty((4, n_blocks), dtype=torch.float32, device=device)
    aligned = all(p % ALIGNMENT == 0 for p in ptrs)
    # inv is read only when UNSCALE; any fp32 pointer stands in for it otherwise
    args = (ptr_table, table, partials if inv is None else inv, partials, n_blocks)
    # Triton 3.9's interpreter truncates fp32 -> bf16 instead of rounding to nearest even: there
    # the kernel converts bf16 by hand. On a GPU the conversions are single cvt.rn instructions.
    emulate_bf16 = INTERPRET and dtype == torch.bfloat16
    flags = dict(DTYPE=TL_DTYPES[dtype], UNSCALE=inv is not None, ALIGNED=aligned, EMULATE_BF16=emulate_bf16)
    if INTERPRET:
        _unscale_stats_kernel[(n_blocks,)](*args, **flags, **cfg)
    else:
        with torch.cuda.device(device):
            _unscale_stats_kernel[(n_blocks,)](*args, **flags, **cfg)
    # Each tensor's blocks are a contiguous run of columns: segment reductions, no atomics.
    # initial=0 is right for the max too (|g| >= 0) and gives an empty tensor its row of zeros.
    seg = dict(lengths=counts, unsafe=True, initial=0.0)  # unsafe: no host sync to check lengths
    l1 = torch.segment_reduce(partials[0], "sum", **seg)
    l2sq = torch.segment_reduce(partials[1], "sum", **seg)
    linf = torch.segment_reduce(partials[2], "max", **seg)
    # A block's nan max may be dropped by the segment max; a nan in a tensor always shows in its
    # sum of |g| (sums of values >= 0 cannot make nan otherwise): restore it from there.
    linf = torch.where(torch.isnan(l1), math.nan, linf)
    return torch.stack([l1, l2sq, linf], dim=1), partials[3].amax().reshape(1)


def unscale_and_stats_(tensors, inv_scale):
    """Unscale `tensors` in place by `inv_scale` (None: statistics only, no write) and return
    (stats fp32 [len(tensors), 3] = per tensor [sum |g|, sum g^2, max |g|], found_inf fp32 [1]);
    one launch per dtype. The contract is in grad_stats_ref.py."""
    device = check_tensors("unscale_and_stats_", tensors, inv_scale)
    tensors = list(tensors)
    stats = torch.zeros((len(tensors), 3), dtype=torch.float32, device=device)
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    if not tensors:
        return stats, found_inf
    if not INTERPRET and device.type != "cuda":
        raise RuntimeError(
            "the Triton unscale_and_stats_ needs CUDA tensors, or TRITON_INTERPRET=1 set before triton "
            "is imported to run in Triton's interpreter; set_backend('torch') uses the reference"
        )
    cfg = INTERPRETER_CONFIG if INTERPRET else GPU_CONFIG
    inv = None if inv_scale is None else inv_scale_tensor(inv_scale, device)
    groups = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    for index in groups.values():
        group = [tensors[i] for i in index]
        # Dense layouts in place; anything else through a contiguous copy (see the module docstring).
        work = [t if _fills_its_span(t) else t.contiguous() for t in group]
        group_stats, group_found = _launch_group(work, inv, cfg)
        stats[index] = group_stats
        torch.maximum(found_inf, group_found, out=found_inf)
        if inv is not None:
            for t, w in zip(group, work, strict=True):
                if w is not t:
                    t.copy_(w)
    return stats, found_inf
