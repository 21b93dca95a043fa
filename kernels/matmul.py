"""Tiled GEMM `C = epilogue(A @ B^T)` with a fused epilogue, its launcher and `matmul_ref`.

The contract (shapes, epilogue, argument checks) is shared with the pure-torch `matmul_ref`
in matmul_ref.py, re-exported here. Shapes (weights follow nn.Linear's (out, in) layout):
    a: (M, K) or (BATCH, M, K)        b: (N, K) or (BATCH, N, K)
    c: (M, N) or (BATCH, M, N); with reduce_batch=True, c is (M, N) = sum_b a_b @ b_b^T
Epilogue, in this order, in fp32:  c = act(scale * acc + bias) + residual (+ c_old if accumulate)
then cast to c's dtype. Every operand may be a strided view (a chunk of an all-gather buffer,
a slice of an output, a transposed weight), so the overlap engine never copies.
"""

import os

import torch
import triton
import triton.language as tl

from .matmul_ref import ACTIVATIONS, check_args, matmul_ref
from .tuning import TunedLaunch, configs_for_running_gpu

__all__ = ["matmul", "matmul_ref"]

# The interpreter must be chosen before triton is imported; record what was chosen.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _config(bm, bn, bk, group_m, warps, stages, arch):
    cfg = triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
        num_warps=warps,
        num_stages=stages,
    )
    cfg.arch = arch  # used to prune configs to the running GPU
    return cfg


# Chosen so that each compiles for its target without spills and fits shared memory with
# 2-byte inputs (checked by `tplayers compile-report`); fp32 inputs fall back to the ones
# that still fit, the others are pruned by the autotuner as out of resources. At most 64 fp32
# accumulator registers per thread (BLOCK_M * BLOCK_N / (32 * num_warps)): at 128 (128x128 on
# 4 warps, 128x256 on 8) the fused-epilogue and weight-gradient kernels spill on both targets.
SM80_CONFIGS = [
    _config(128, 128, 32, 8, 8, 4, 80),
    _config(64, 256, 32, 8, 8, 3, 80),
    _config(256, 64, 32, 8, 8, 3, 80),
    _config(128, 64, 32, 8, 4, 4, 80),
    _config(64, 128, 32, 8, 4, 4, 80),
    _config(64, 64, 32, 8, 4, 5, 80),
]
SM90_CONFIGS = [
    _config(128, 128, 64, 8, 8, 3, 90),
    _config(128, 128, 64, 8, 8, 4, 90),
    _config(64, 256, 64, 8, 8, 3, 90),
    _config(128, 64, 64, 8, 4, 4, 90),
    _config(64, 128, 64, 8, 4, 4, 90),
    _config(64, 64, 64, 8, 4, 4, 90),
]
# Hopper's TMA kernel (persistent, wgmma): the 128x256 tiles the pointer kernel's register budget
# rules out, on 8 warps, with the stages shared memory allows. 128 accumulator registers per thread
# only under a light epilogue (a bias at most): with an activation, a residual, SwiGLU or an fp32
# accumulate those spill (compile-report), so they keep to 64 (`tma_configs`).
TMA_CONFIGS = [
    _config(128, 256, 64, 8, 8, 3, 90),
    _config(128, 128, 64, 8, 8, 4, 90),
    _config(128, 128, 64, 8, 4, 4, 90),
    _config(64, 256, 64, 8, 4, 4, 90),
    _config(128, 64, 64, 8, 4, 4, 90),
]
# The interpreter runs each program in numpy: few, large programs are fastest.
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, res_ptr, h_ptr,
    M, N, K, BATCH, scale,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bn, stride_bk,
    stride_cb, stride_cm, stride_cn,
    stride_rb, stride_rm, stride_rn,
    stride_hb, stride_hm, stride_hn,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ACCUMULATE: tl.constexpr, REDUCE_BATCH: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INT64_OFFSETS: tl.constexpr, SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # Grouped ordering of output tiles so that neighbouring programs share A rows in L2.
    pid = tl.program_id(0)
    pid_batch = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Wrap out-of-range rows / columns onto valid ones so the loads need no M / N mask;
    # those results are never stored.
    offs_am = offs_m % M
    offs_bn = offs_n % N
    if INT64_OFFSETS:  # an operand spans >= 2**31 elements: 32-bit offsets would wrap
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        offs_am = offs_am.to(tl.int64)
        offs_bn = offs_bn.to(tl.int64)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A batch is either one program column each, or (reduce_batch) summed by every program.
    batch_end = BATCH if REDUCE_BATCH else pid_batch + 1
    a_batch = a_ptr + pid_batch.to(tl.int64) * stride_ab  # 64-bit: batch offsets can be large
    b_batch = b_ptr + pid_batch.to(tl.int64) * stride_bb
    for _ in range(pid_batch, batch_end):
        a_ptrs = a_batch + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_batch + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_mask = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
            if UPCAST:  # the interpreter multiplies bf16 bit patterns in tl.dot
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        a_batch += stride_ab
        b_batch += stride_bb

    _epilogue(acc, offs_m, offs_n, offs_bn, pid_n, pid_batch, M, N, scale, c_ptr, bias_ptr, res_ptr, h_ptr,
              stride_cb, stride_cm, stride_cn, stride_rb, stride_rm, stride_rn, stride_hb, stride_hm, stride_hn,
              HAS_BIAS, ACTIVATION, HAS_RESIDUAL, ACCUMULATE, SWIGLU, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def _epilogue(acc, offs_m, offs_n, offs_bn, pid_n, pid_batch, M, N, scale, c_ptr, bias_ptr, res_ptr, h_ptr,
              stride_cb, stride_cm, stride_cn, stride_rb, stride_rm, stride_rn, stride_hb, stride_hm, stride_hn,
              HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              ACCUMULATE: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """C = act(scale * acc + bias) + residual (+ C), stored through C's strides (any view), and the
    SwiGLU output of C's interleaved (gate, up) columns: shared by both GEMM kernels."""
    c = acc * scale
    if HAS_BIAS:
        c += tl.load(bias_ptr + offs_bn).to(tl.float32)[None, :]
    if ACTIVATION == 1:  # GeLU, tanh approximation; tanh(x) = 2 sigmoid(2x) - 1
        inner = 0.7978845608028654 * (c + 0.044715 * c * c * c)
        c = 0.5 * c * (2.0 * tl.sigmoid(2.0 * inner))
    elif ACTIVATION == 2:  # SiLU
        c = c * tl.sigmoid(c)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if HAS_RESIDUAL:
        r_ptrs = (
            res_ptr + pid_batch.to(tl.int64) * stride_rb
            + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn
        )  # fmt: skip
        c += tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
    c_ptrs = (
        c_ptr + pid_batch.to(tl.int64) * stride_cb
        + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    )  # fmt: skip
    if ACCUMULATE:
        c += tl.load(c_ptrs, mask=mask, other=0.0)
    tl.store(c_ptrs, c.to(c_ptr.dtype.element_ty), mask=mask)
    if SWIGLU:  # C's columns alternate gate, up: H = silu(gate) * up, one column per pair
        gate, up = tl.split(tl.reshape(c, (BLOCK_M, BLOCK_N // 2, 2)))
        offs_h = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        h_ptrs = (
            h_ptr + pid_batch.to(tl.int64) * stride_hb
            + offs_m[:, None] * stride_hm + offs_h[None, :] * stride_hn
        )  # fmt: skip
        h_mask = (offs_m < M)[:, None] & (offs_h < N // 2)[None, :]
        tl.store(h_ptrs, (gate * tl.sigmoid(gate) * up).to(h_ptr.dtype.element_ty), mask=h_mask)


@triton.jit
def _operand_tile(desc, batch, row0, k0, K_MAJOR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """A (BLOCK_R, BLOCK_K) tile of an operand through its TMA descriptor: K-major (unit stride
    along K, a weight or an activation) or row-major (unit stride along the rows: the transposed
    activations of a weight gradient), the (BLOCK_K, BLOCK_R) box transposed in shared memory."""
    if K_MAJOR:
        return desc.load([batch, row0, k0]).reshape(BLOCK_R, BLOCK_K)
    return desc.load([batch, k0, row0]).reshape(BLOCK_K, BLOCK_R).T


@triton.jit
def _tma_k_loop(acc, a_desc, b_desc, batch, m0, n0, k_tiles, A_K_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr,
                A_SHARED: tl.constexpr, B_SHARED: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """acc + A_batch[m0 tile] @ B_batch[n0 tile]^T over K; out-of-range rows / columns / K read as zeros (TMA)."""
    for kk in range(0, k_tiles):
        a = _operand_tile(a_desc, 0 if A_SHARED else batch, m0, kk * BLOCK_K, A_K_MAJOR, BLOCK_M, BLOCK_K)
        b = _operand_tile(b_desc, 0 if B_SHARED else batch, n0, kk * BLOCK_K, B_K_MAJOR, BLOCK_N, BLOCK_K)
        if UPCAST:  # the interpreter multiplies bf16 bit patterns in tl.dot
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _matmul_tma_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, res_ptr, h_ptr,
    M, N, K, BATCH, scale,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bn, stride_bk,
    stride_cb, stride_cm, stride_cn,
    stride_rb, stride_rm, stride_rn,
    stride_hb, stride_hm, stride_hn,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ACCUMULATE: tl.constexpr, REDUCE_BATCH: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INT64_OFFSETS: tl.constexpr, SWIGLU: tl.constexpr,
    A_K_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr, A_SHARED: tl.constexpr, B_SHARED: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Hopper's path (sm_90): the operands through tensor-memory-accelerator descriptors (3-D:
    batch, rows, K), a persistent program per SM walking output tiles in grouped order (Triton's
    persistent matmul), wgmma tiles, the same epilogue as `_matmul_kernel`. A 2-D operand of a
    batched GEMM (`*_SHARED`) is one matrix every batch reads."""
    a_batches = 1 if A_SHARED else BATCH
    b_batches = 1 if B_SHARED else BATCH
    if A_K_MAJOR:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[a_batches, M, K], strides=[stride_ab, stride_am, 1],
                                           block_shape=[1, BLOCK_M, BLOCK_K])  # fmt: skip
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[a_batches, K, M], strides=[stride_ab, stride_ak, 1],
                                           block_shape=[1, BLOCK_K, BLOCK_M])  # fmt: skip
    if B_K_MAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[b_batches, N, K], strides=[stride_bb, stride_bn, 1],
                                           block_shape=[1, BLOCK_N, BLOCK_K])  # fmt: skip
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[b_batches, K, N], strides=[stride_bb, stride_bk, 1],
                                           block_shape=[1, BLOCK_K, BLOCK_N])  # fmt: skip
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_batch = num_pid_m * num_pid_n
    num_tiles = tiles_per_batch * (1 if REDUCE_BATCH else BATCH)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_pid_in_group = GROUP_M * num_pid_n
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_batch = tile // tiles_per_batch
        t = tile % tiles_per_batch
        first_pid_m = (t // num_pid_in_group) * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((t % num_pid_in_group) % group_size_m)
        pid_n = (t % num_pid_in_group) // group_size_m
        m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # A batch is either its own tiles, or (reduce_batch) summed into every tile. Without
        # reduce_batch the nest is two loops deep (tiles, K), which Triton flattens and pipelines
        # across tiles: the next tile's loads overlap this one's epilogue.
        if REDUCE_BATCH:
            for batch in range(0, BATCH):
                acc = _tma_k_loop(acc, a_desc, b_desc, batch, m0, n0, k_tiles, A_K_MAJOR, B_K_MAJOR, A_SHARED,
                                  B_SHARED, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        else:
            acc = _tma_k_loop(acc, a_desc, b_desc, pid_batch, m0, n0, k_tiles, A_K_MAJOR, B_K_MAJOR, A_SHARED,
                              B_SHARED, UPCAST, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_bn = offs_n % N
        if INT64_OFFSETS:
            offs_m = offs_m.to(tl.int64)
            offs_n = offs_n.to(tl.int64)
            offs_bn = offs_bn.to(tl.int64)
        _epilogue(acc, offs_m, offs_n, offs_bn, pid_n, pid_batch, M, N, scale, c_ptr, bias_ptr, res_ptr, h_ptr,
                  stride_cb, stride_cm, stride_cn, stride_rb, stride_rm, stride_rn, stride_hb, stride_hm, stride_hn,
                  HAS_BIAS, ACTIVATION, HAS_RESIDUAL, ACCUMULATE, SWIGLU, BLOCK_M, BLOCK_N)  # fmt: skip


_matmul_autotuned = triton.autotune(
    configs=SM80_CONFIGS + SM90_CONFIGS,
    key=["M", "N", "K", "BATCH", "HAS_BIAS", "ACTIVATION", "HAS_RESIDUAL", "ACCUMULATE", "REDUCE_BATCH", "SWIGLU"],
    prune_configs_by={"early_config_prune": configs_for_running_gpu},
    restore_value=["c_ptr"],  # benchmarking an accumulating GEMM must not accumulate
)(_matmul_kernel)


def tma_configs(configs, light_epilogue: bool):
    """`configs` that compile without spills for the TMA kernel under this epilogue (see TMA_CONFIGS)."""
    return [c for c in configs
            if light_epilogue or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] // (32 * c.num_warps) <= 64]  # fmt: skip


def light_epilogue(flags) -> bool:
    """Whether a launch's epilogue is a bias at most (its constexpr flags)."""
    return not any(flags.get(f) for f in ("ACTIVATION", "HAS_RESIDUAL", "SWIGLU", "ACCUMULATE"))


def _tma_configs_for_launch(configs, named_args, **kwargs):
    """Triton's `early_config_prune` for the TMA kernel: the epilogue's configs, for this GPU."""
    return configs_for_running_gpu(tma_configs(configs, light_epilogue(kwargs)), named_args, **kwargs)


_matmul_tma_autotuned = triton.autotune(
    configs=TMA_CONFIGS,
    key=["M", "N", "K", "BATCH", "HAS_BIAS", "ACTIVATION", "HAS_RESIDUAL", "ACCUMULATE", "REDUCE_BATCH", "SWIGLU",
         "A_K_MAJOR", "B_K_MAJOR", "A_SHARED", "B_SHARED"],
    prune_configs_by={"early_config_prune": _tma_configs_for_launch},
    restore_value=["c_ptr"],
)(_matmul_tma_kernel)  # fmt: skip

_launch, _tma_launch = TunedLaunch(_matmul_autotuned), TunedLaunch(_matmul_tma_autotuned)

# The TMA kernel in the interpreter too, where a test asks (on a GPU it runs on sm_90 by itself).
TMA_IN_INTERPRETER = False
_SM_COUNT: dict = {}
_MAJOR: dict = {}  # device -> compute capability major


def _tma_layout(t):
    """How a TMA descriptor reads operand `t` ((M or N, K), or batched): "k" (unit stride along K),
    "rows" (unit stride along the rows: a transposed activation), or None where it cannot (a 4-byte
    dtype, an address or a stride not a multiple of 16 bytes): the pointer kernel runs those."""
    if t.dtype not in (torch.float16, torch.bfloat16) or t.data_ptr() % 16:
        return None
    size = t.element_size()
    rows, k = t.stride()[-2:]
    if t.dim() == 3 and (t.stride(0) * size) % 16:
        return None
    if k == 1 and (rows * size) % 16 == 0:
        return "k"
    if rows == 1 and (k * size) % 16 == 0:
        return "rows"
    return None


def _tma_layouts(a, b):
    """(a's, b's) TMA layouts where the TMA kernel runs them (sm_90 and both readable), else None."""
    if INTERPRET:
        hopper = TMA_IN_INTERPRETER
    else:
        if a.device not in _MAJOR:  # read once per device: every GEMM asks
            _MAJOR[a.device] = torch.cuda.get_device_capability(a.device)[0]
        hopper = _MAJOR[a.device] >= 9
    if not hopper:
        return None
    layouts = _tma_layout(a), _tma_layout(b)
    return None if None in layouts else layouts


def _batch_stride(t):
    """A 3-D operand's batch stride; for a 2-D one (one batch, never stepped over) a stride the
    descriptor accepts: a multiple of 16 bytes past the matrix."""
    if t.dim() == 3:
        return t.stride(0)
    step = 16 // t.element_size()
    return (t.shape[-2] * t.stride(-2) + t.shape[-1] * t.stride(-1) + step - 1) // step * step


def _scratch(size, alignment, stream):
    """Global memory for the descriptors a kernel builds on the device (Triton asks its allocator)."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def _ensure_allocator():
    """Device-side TMA descriptors need Triton's allocator. Triton keeps it per thread context (the
    autograd engine runs backward GEMMs on its own threads): set ours where none is set, leaving a
    user's own in place."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _max_offset(t):
    """The largest element offset within one matrix of `t` (batch offsets are 64-bit already)."""
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape[-2:], t.stride()[-2:], strict=True) if size)


def matmul(
    a, b, *, bias=None, scale=1.0, activation=None, residual=None, out=None,
    accumulate=False, reduce_batch=False, out_dtype=None, swiglu_out=None,
):  # fmt: skip
    """C = act(scale * (a @ b^T) + bias) + residual, with fp32 accumulation, in one kernel.

    `out` (any strides) receives C, or with accumulate=True has C added to it (fp32 only, for
    weight-gradient accumulation). Returns `out`, or a new tensor of `out_dtype` (default a's).
    `swiglu_out` (..., N/2): also H = silu(C[..., 0::2]) * C[..., 1::2], from the same epilogue.
    """
    shape = check_args(a, b, bias, activation, residual, out, accumulate, reduce_batch, out_dtype, swiglu_out)
    if not INTERPRET and not a.is_cuda:
        raise RuntimeError(
            "the Triton matmul needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
            "imported to run in Triton's interpreter; set_backend('torch') uses the reference"
        )
    if out is None:
        out = torch.empty(shape, device=a.device, dtype=out_dtype or a.dtype)
    M, N, K = a.shape[-2], b.shape[-2], a.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    if M == 0 or N == 0:
        return out
    if batch == 0:  # an empty sum
        return out if accumulate else out.zero_()
    batch_programs = 1 if reduce_batch or a.dim() == 2 else batch
    if batch_programs > 65535:
        raise ValueError(f"matmul: at most 65535 batches, got {batch_programs}")

    def stride3(t):
        return (0, *t.stride()) if t.dim() == 2 else t.stride()

    residual_strides = stride3(residual) if residual is not None else (0, 0, 0)
    swiglu_strides = stride3(swiglu_out) if swiglu_out is not None else (0, 0, 0)
    fp32_in = a.dtype == torch.float32
    if bias is not None:
        bias = bias.contiguous()  # (N,): loaded with unit stride
    args = (
        a, b, out, bias if bias is not None else out, residual if residual is not None else out,
        swiglu_out if swiglu_out is not None else out,
        M, N, K, batch, float(scale),
        *stride3(a), *stride3(b), *stride3(out), *residual_strides, *swiglu_strides,
    )  # fmt: skip
    flags = dict(
        HAS_BIAS=bias is not None,
        ACTIVATION=ACTIVATIONS[activation],
        HAS_RESIDUAL=residual is not None,
        ACCUMULATE=accumulate,
        REDUCE_BATCH=reduce_batch,
        UPCAST=INTERPRET and a.dtype == torch.bfloat16,
        INPUT_PRECISION="tf32" if fp32_in and torch.backends.cuda.matmul.allow_tf32 else "ieee",
        INT64_OFFSETS=any(_max_offset(t) >= 2**31 for t in (a, b, out, residual, swiglu_out) if t is not None),
        SWIGLU=swiglu_out is not None,
    )

    # The launch's shape class for the tuned-config cache: what the Autotuners' keys read
    key = (M, N, K, batch, *flags.values(), *(t.dtype for t in args[:6]))
    layouts = _tma_layouts(a, b)
    if layouts is not None:
        _ensure_allocator()
        tma_flags = dict(flags, A_K_MAJOR=layouts[0] == "k", B_K_MAJOR=layouts[1] == "k",
                         A_SHARED=a.dim() == 2, B_SHARED=b.dim() == 2)  # fmt: skip
        tma_args = list(args)
        tma_args[11], tma_args[14] = _batch_stride(a), _batch_stride(b)  # stride_ab, stride_bb
        if a.is_cuda and a.device not in _SM_COUNT:
            _SM_COUNT[a.device] = torch.cuda.get_device_properties(a.device).multi_processor_count
        sms = _SM_COUNT.get(a.device, 4)  # the interpreter: a few programs, each several tiles

        def persistent(meta):
            tiles = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]) * batch_programs
            return (min(sms, tiles),)

        if INTERPRET:
            _matmul_tma_kernel[persistent](*tma_args, **tma_flags, NUM_SMS=sms, **INTERPRETER_CONFIG)
        else:
            with torch.cuda.device(a.device):
                _tma_launch(persistent, (*key, *layouts, a.dim(), b.dim()), *tma_args, **tma_flags, NUM_SMS=sms)
        return out

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), batch_programs)

    if INTERPRET:
        _matmul_kernel[grid](*args, **flags, **INTERPRETER_CONFIG)
    else:
        with torch.cuda.device(a.device):
            _launch(grid, key, *args, **flags)
    return out
