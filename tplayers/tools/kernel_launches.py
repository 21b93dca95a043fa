"""The launch table of the compile report (`tplayers.tools.compile_report`): every Triton kernel
in kernels/, launched each way its launcher launches it, with the arguments it passes (pointer
dtypes and alignment, which ints are 1 or multiples of 16), its configs for sm_80 / sm_90a and
the input dtypes it takes. A row that no longer matches its kernel's parameters is an error
there (SpecMismatch), so the table cannot drift from the kernels.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

DTYPES = ("fp16", "bf16", "fp32")


class Ptr(NamedTuple):
    """A pointer argument: its element type and whether its address is a multiple of 16 bytes."""

    dtype: str
    aligned: bool = True


# The JIT specialises an int argument on its value only: 1 becomes a constexpr, a multiple of 16
# gets tt.divisibility=16, anything else neither. The launch tables below give each int argument
# a representative value: 1, DIV16 or ANY. We assume sizes and non-unit strides are multiples of
# 16 (hidden sizes, vocab shards and token counts are; stride 0 is too) and counts are anything.
DIV16, ANY = 16, 3


@dataclass(frozen=True)
class KernelSpec:
    """One row family of the report.

    module / attr: the @triton.jit function (kernels/<module>.py). launch(dtype) -> (runtime
    arguments {name: Ptr | int | float}, constexpr arguments {name: value}) as the launcher
    passes them, without the config's constexprs. configs(module, cc) -> the launcher's configs
    for that arch, each a dict of constexprs (BLOCK_*) plus the options it sets (num_warps,
    num_stages; triton's defaults otherwise). dtypes: the input dtypes it is launched with.
    tensor_cores: the cubin must contain HMMA / HGMMA (GEMMs only). tma: its sm_90a cubin must
    load through the tensor memory accelerator (UTMALDG).
    """

    module: str
    attr: str
    launch: Callable
    configs: Callable
    dtypes: tuple
    tensor_cores: bool = False
    tma: bool = False


def _tl_dtype(dtype):
    import triton.language as tl

    return {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}[dtype]


def _gpu_config(module, cc):
    """A kernel whose launcher uses one GPU_CONFIG on every arch."""
    return [dict(module.GPU_CONFIG)]


# -- GEMM (kernels/matmul.py): four specialisations of one kernel --------------------------------

# The four specialisations the layers launch: constexpr flags, which strides are 1 (the JIT
# turns an int argument equal to 1 into a constexpr), C's dtype (None: the input dtype) and
# whether BATCH is a runtime value (3-D reduce_batch) or the constexpr 1 of a 2-D GEMM.
# The weight gradient reads transposed views of contiguous activations (a = dY^T, b = X^T),
# so its unit strides are along M and N: it also covers the dgrad layout (b = W^T).
GEMM_VARIANTS = {
    "gemm": dict(
        flags=dict(HAS_BIAS=True, ACTIVATION=0, HAS_RESIDUAL=False, ACCUMULATE=False, REDUCE_BATCH=False, SWIGLU=False),
        unit_strides=("stride_ak", "stride_bk", "stride_cn"),
        out_dtype=None,
        batched=False,
    ),
    "gemm+swiglu": dict(
        flags=dict(HAS_BIAS=True, ACTIVATION=0, HAS_RESIDUAL=False, ACCUMULATE=False, REDUCE_BATCH=False, SWIGLU=True),
        unit_strides=("stride_ak", "stride_bk", "stride_cn", "stride_hn"),
        out_dtype=None,
        batched=False,
    ),
    "gemm+bias+gelu+residual": dict(
        flags=dict(HAS_BIAS=True, ACTIVATION=1, HAS_RESIDUAL=True, ACCUMULATE=False, REDUCE_BATCH=False, SWIGLU=False),
        unit_strides=("stride_ak", "stride_bk", "stride_cn", "stride_rn"),
        out_dtype=None,
        batched=False,
    ),
    "wgrad-accumulate": dict(
        flags=dict(HAS_BIAS=False, ACTIVATION=0, HAS_RESIDUAL=False, ACCUMULATE=True, REDUCE_BATCH=True, SWIGLU=False),
        unit_strides=("stride_am", "stride_bn", "stride_cn"),
        out_dtype="fp32",
        batched=True,
    ),
}
# (batch, row, column) strides of a, b, c, the residual and the SwiGLU output h
GEMM_STRIDES = (
    "stride_ab stride_am stride_ak stride_bb stride_bn stride_bk stride_cb stride_cm stride_cn "
    "stride_rb stride_rm stride_rn stride_hb stride_hm stride_hn"
).split()


def _gemm_launch(variant):
    spec = GEMM_VARIANTS[variant]
    flags = spec["flags"]

    def launch(dtype):
        out = spec["out_dtype"] or dtype
        args = dict(
            a_ptr=Ptr(dtype),
            b_ptr=Ptr(dtype),
            c_ptr=Ptr(out),
            # the launcher passes `out` in place of an absent bias / residual / SwiGLU output
            bias_ptr=Ptr(dtype if flags["HAS_BIAS"] else out),
            res_ptr=Ptr(dtype if flags["HAS_RESIDUAL"] else out),
            h_ptr=Ptr(dtype if flags["SWIGLU"] else out),
            M=DIV16, N=DIV16, K=DIV16, BATCH=ANY if spec["batched"] else 1, scale=1.0,
        )  # fmt: skip
        args.update({name: 1 if name in spec["unit_strides"] else DIV16 for name in GEMM_STRIDES})
        return args, dict(flags, UPCAST=False, INPUT_PRECISION="ieee", INT64_OFFSETS=False)

    return launch


def _gemm_configs(matmul, cc):
    configs = matmul.SM80_CONFIGS if cc == 80 else matmul.SM90_CONFIGS
    return [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in configs]


def _gemm_tma_launch(variant):
    """The TMA kernel (sm_90 and later) launched as the pointer kernel's `variant`: K-major operands,
    or (the weight gradient) both read through their unit stride along the rows."""
    base = _gemm_launch(variant)
    wgrad = GEMM_VARIANTS[variant]["batched"]

    def launch(dtype):
        args, flags = base(dtype)
        layout = dict(A_K_MAJOR=not wgrad, B_K_MAJOR=not wgrad, A_SHARED=not wgrad, B_SHARED=not wgrad)
        return args, dict(flags, **layout, NUM_SMS=132)

    return launch


def _gemm_tma_configs(variant):
    flags = GEMM_VARIANTS[variant]["flags"]

    def configs(matmul, cc):  # Ampere has no TMA: the pointer kernel runs there
        chosen = matmul.tma_configs(matmul.TMA_CONFIGS, matmul.light_epilogue(flags)) if cc >= 90 else []
        return [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in chosen]

    return configs


# -- elementwise and reduction kernels -----------------------------------------------------------


def _swiglu_fwd_launch(dtype):
    """`swiglu(gate, up)` on the layout the backward reads (the layers fuse the forward into the
    GEMM's epilogue): gate / up the column halves y[:, 0::2] / y[:, 1::2] of an interleaved
    (M, 2f) [gate, up] output (up starts one element in: not 16-byte aligned), h a new (M, f)."""
    args = dict(
        gate_ptr=Ptr(dtype), up_ptr=Ptr(dtype, aligned=False), h_ptr=Ptr(dtype), M=DIV16, N=DIV16,
        stride_gm=DIV16, stride_gn=2, stride_um=DIV16, stride_un=2, stride_hm=DIV16, stride_hn=1,
    )  # fmt: skip
    return args, dict(INT64_OFFSETS=False)


def _swiglu_bwd_launch(dtype):
    """The general strided kernel, on a layout the paired one does not take: dh contiguous
    (M, f); gate / up the stride-2 halves of an interleaved (M, 2f) y; dgate / dup new (M, f)."""
    args = dict(
        dh_ptr=Ptr(dtype), gate_ptr=Ptr(dtype), up_ptr=Ptr(dtype, aligned=False),
        dgate_ptr=Ptr(dtype), dup_ptr=Ptr(dtype), M=DIV16, N=DIV16,
        stride_dhm=DIV16, stride_dhn=1, stride_gm=DIV16, stride_gn=2, stride_um=DIV16, stride_un=2,
        stride_dgm=DIV16, stride_dgn=1, stride_dum=DIV16, stride_dun=1,
    )  # fmt: skip
    return args, dict(INT64_OFFSETS=False)


def _swiglu_bwd_pairs_launch(dtype):
    """As ColumnSwiGLUFn.backward launches it: dh contiguous (M, f), the saved GEMM output y and
    the new dy both (M, 2f) with interleaved [gate, up] columns, read and written as pairs."""
    args = dict(
        dh_ptr=Ptr(dtype), y_ptr=Ptr(dtype), dy_ptr=Ptr(dtype), M=DIV16, N=DIV16,
        stride_dhm=DIV16, stride_dhn=1, stride_ym=DIV16, stride_dym=DIV16,
    )  # fmt: skip
    return args, dict(INT64_OFFSETS=False)


def _vocab_ce_launch(dtype):
    """logits (R, V_local) contiguous (the LM head's output, reshaped), target (R,) int64 global
    ids, stats a new fp32 (R, 4); vocab_start = rank * V_local."""
    args = dict(
        logits_ptr=Ptr(dtype), target_ptr=Ptr("i64"), stats_ptr=Ptr("fp32"),
        R=DIV16, V=DIV16, vocab_start=DIV16, stride_lr=DIV16, stride_lv=1, stride_t=1,
    )  # fmt: skip
    return args, {}


def _vocab_ce_grad_launch(dtype):
    """The fused LM-head loss's chunk of logits (R, V_local) contiguous, overwritten in place;
    target (R,) int64, lse and scale (R,) fp32."""
    args = dict(
        logits_ptr=Ptr(dtype), target_ptr=Ptr("i64"), lse_ptr=Ptr("fp32"), scale_ptr=Ptr("fp32"),
        R=DIV16, V=DIV16, vocab_start=DIV16, stride_lr=DIV16, stride_lv=1, stride_t=1,
    )  # fmt: skip
    return args, {}


def _rms_norm_fwd_launch(dtype):
    """x (R, N) contiguous rows of the hidden states, the weight (N,) in x's dtype, y a new (R, N),
    rstd a new fp32 (R,); one row per program."""
    args = dict(
        x_ptr=Ptr(dtype), w_ptr=Ptr(dtype), y_ptr=Ptr(dtype), rstd_ptr=Ptr("fp32"),
        R=DIV16, N=DIV16, stride_x=DIV16, stride_y=DIV16, eps=1e-6,
    )  # fmt: skip
    return args, {}


def _rms_norm_bwd_launch(dtype):
    """dy, x contiguous (R, N), the weight, rstd fp32 (R,), dx a new (R, N), the fp32 (programs, N)
    dweight partials; each program a run of rows (any count)."""
    args = dict(
        dy_ptr=Ptr(dtype), x_ptr=Ptr(dtype), w_ptr=Ptr(dtype), rstd_ptr=Ptr("fp32"), dx_ptr=Ptr(dtype),
        dw_ptr=Ptr("fp32"), R=DIV16, N=DIV16, stride_dy=DIV16, stride_x=DIV16, stride_dx=DIV16, rows_per_program=ANY,
    )  # fmt: skip
    return args, {}


# Hidden sizes the report compiles the norm for: Llama-3-8B's, Llama-3-70B's, a small model's.
NORM_WIDTHS = (4096, 8192, 2048)


def _rms_norm_configs(backward):
    return lambda rms_norm, cc: [rms_norm.gpu_config(n, rows_per_program=not backward) for n in NORM_WIDTHS]


# The launcher picks its tile from the shard size: every shard over 2048 columns gets the 4096
# tile on 8 warps, smaller ones a tile of at most 2048 on 4 warps (2048 is the heaviest of those).
VOCAB_SHARDS = (4096, 2048)


def _vocab_ce_configs(vocab_ce, cc):
    configs = []
    for meta, warps in map(vocab_ce._gpu_config, VOCAB_SHARDS):
        if dict(meta, num_warps=warps) not in configs:
            configs.append(dict(meta, num_warps=warps))
    return configs


def _grad_stats_launch(unscale):
    def launch(dtype):
        """One launch per dtype group: the int64 tables of data pointers and of blocks, inv_scale
        fp32 [1] (the partials in its place without UNSCALE) and the fp32 partials, all from the
        caching allocator, with 16-byte aligned gradients; n_blocks is any count."""
        args = dict(
            ptr_table_ptr=Ptr("i64"), block_table_ptr=Ptr("i64"), inv_scale_ptr=Ptr("fp32"), partials_ptr=Ptr("fp32"),
            n_blocks=ANY,
        )  # fmt: skip
        return args, dict(DTYPE=_tl_dtype(dtype), UNSCALE=unscale, ALIGNED=True, EMULATE_BF16=False)

    return launch


# -- grouped GEMM over experts (kernels/grouped_matmul.py) ----------------------------------------

# The launches of the experts' MLP (grouped_mlp): x and the weights contiguous, the index tensors
# int64 (torch's), the tile table int32, the routing weights fp32. "dgrad" reads a transposed
# weight view (E, H, 2F) of the contiguous (E, 2F, H): unit stride along N.
GROUPED_VARIANTS = {
    "grouped+swiglu": (dict(HAS_GATHER=True, HAS_SCATTER=False, HAS_SCALE=False, SWIGLU=True, STORE_PRE=True),
                       ("stride_xk", "stride_wk", "stride_on", "stride_pn")),
    "grouped+scale+scatter": (dict(HAS_GATHER=False, HAS_SCATTER=True, HAS_SCALE=True, SWIGLU=False, STORE_PRE=False),
                              ("stride_xk", "stride_wk", "stride_on")),
    "grouped-dgrad+scatter": (dict(HAS_GATHER=False, HAS_SCATTER=True, HAS_SCALE=False, SWIGLU=False, STORE_PRE=False),
                              ("stride_xk", "stride_wn", "stride_on")),
}  # fmt: skip
GROUPED_STRIDES = "stride_xm stride_xk stride_we stride_wn stride_wk stride_om stride_on stride_pm stride_pn".split()


def _grouped_launch(variant):
    flags, unit = GROUPED_VARIANTS[variant]

    def launch(dtype):
        index = Ptr("i64")
        args = dict(
            x_ptr=Ptr(dtype), w_ptr=Ptr(dtype), out_ptr=Ptr(dtype), pre_ptr=Ptr(dtype), gather_ptr=index,
            scatter_ptr=index, scale_ptr=Ptr("fp32" if flags["HAS_SCALE"] else dtype), tile_expert_ptr=Ptr("i32"),
            tile_start_ptr=Ptr("i32"), tile_end_ptr=Ptr("i32"), N=DIV16, K=DIV16,
        )  # fmt: skip
        args.update({name: 1 if name in unit else DIV16 for name in GROUPED_STRIDES})
        return args, dict(flags, UPCAST=False, INPUT_PRECISION="ieee")

    return launch


def _grouped_weight_grad_launch(dtype):
    """dW of gate|up: dy (P, 2F) and x (R, H) contiguous, x's rows through the gather index, dW a
    new fp32 (E, 2F, H); the down projection's is the same without the index."""
    args = dict(
        dy_ptr=Ptr(dtype), x_ptr=Ptr(dtype), dw_ptr=Ptr("fp32"), gather_ptr=Ptr("i64"),
        offsets_ptr=Ptr("i32"), N=DIV16, K=DIV16, stride_dym=DIV16, stride_dyn=1, stride_xm=DIV16, stride_xk=1,
        stride_we=DIV16, stride_wn=DIV16, stride_wk=1,
    )  # fmt: skip
    return args, dict(HAS_GATHER=True, UPCAST=False, INPUT_PRECISION="ieee")


def _grouped_configs(module, cc, configs=None):
    configs = configs or (module.SM80_CONFIGS if cc == 80 else module.SM90_CONFIGS)
    return [dict(c.kwargs, BLOCK_M=module.BLOCK_M, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in configs if c.arch == cc]  # fmt: skip


def _weight_grad_configs(module, cc):
    return _grouped_configs(module, cc, module.WGRAD_CONFIGS)


# -- flash attention (kernels/flash_attention.py) ------------------------------------------------

# (kernel, head size, flags): each kernel at head sizes 64 and 128 (causal, as the models run it;
# the forward also with a sliding window and softcapping at 128). Every tensor is a (B, H,
# S, D) view with unit stride along D (HF's transposed q); metadata and tile lists int32.
FLASH_VARIANTS = {
    "flash-fwd-d64": ("_flash_fwd_kernel", 64, False),
    "flash-fwd-d128": ("_flash_fwd_kernel", 128, False),
    "flash-fwd-d128+window+softcap": ("_flash_fwd_kernel", 128, True),
    "flash-dkdv-d64": ("_flash_dkdv_kernel", 64, False),
    "flash-dkdv-d128": ("_flash_dkdv_kernel", 128, False),
    "flash-dq-d64": ("_flash_dq_kernel", 64, False),
    "flash-dq-d128": ("_flash_dq_kernel", 128, False),
}
FLASH_STRIDES = ("stride_qb stride_qh stride_qm stride_kb stride_kh stride_kn stride_vb stride_vh stride_vn").split()


def _flash_launch(variant):
    kernel, head_dim, extras = FLASH_VARIANTS[variant]

    def launch(dtype):
        meta = dict(qpos_ptr=Ptr("i32"), qdoc_ptr=Ptr("i32"), kpos_ptr=Ptr("i32"), kdoc_ptr=Ptr("i32"),
                    list_ptr=Ptr("i32"), whole_ptr=Ptr("i32"), meet_ptr=Ptr("i32"))  # fmt: skip
        if kernel == "_flash_fwd_kernel":
            tensors = dict(q_ptr=Ptr(dtype), k_ptr=Ptr(dtype), v_ptr=Ptr(dtype), o_ptr=Ptr(dtype), lse_ptr=Ptr("fp32"))
            last = ("stride_ob", "stride_oh", "stride_om")
        else:
            tensors = dict(q_ptr=Ptr(dtype), k_ptr=Ptr(dtype), v_ptr=Ptr(dtype), do_ptr=Ptr(dtype),
                           lse_ptr=Ptr("fp32"), delta_ptr=Ptr("fp32"))  # fmt: skip
            tensors.update(
                dict(dk_ptr=Ptr("fp32"), dv_ptr=Ptr("fp32")) if "dkdv" in kernel else dict(dq_ptr=Ptr("fp32"))
            )
            last = ("stride_dob", "stride_doh", "stride_dom")
        # window 0 (none) is a multiple of 16 to the JIT; a real window any int
        tiles = "TILES_M" if "dkdv" in kernel else "TILES_N"  # the length of each row of the tile lists
        args = dict(tensors, **meta, H=ANY, N_REP=ANY, M=DIV16, N=DIV16, D=head_dim, scale=0.125, softcap=30.0,
                    window=ANY if extras else DIV16, **{tiles: ANY})  # fmt: skip
        args.update({name: DIV16 for name in (*FLASH_STRIDES, *last)})
        flags = dict(CAUSAL=True, HAS_WINDOW=extras, HAS_SOFTCAP=extras, UPCAST=False, INPUT_PRECISION="ieee",
                     BLOCK_D=head_dim)  # fmt: skip
        return args, flags

    return launch


def _flash_configs(variant):
    kernel, head_dim, _ = FLASH_VARIANTS[variant]

    def configs(module, cc):
        name = {"_flash_fwd_kernel": "fwd", "_flash_dkdv_kernel": "dkdv", "_flash_dq_kernel": "dq"}[kernel]
        return [module._gpu_config(name, head_dim, cc)]

    return configs


def _flash_schedule_launch(dtype):
    """tile_schedule's launch (the attention's dtype does not reach it): int32 metadata and lists."""
    args = dict(rpos_ptr=Ptr("i32"), rdoc_ptr=Ptr("i32"), cpos_ptr=Ptr("i32"), cdoc_ptr=Ptr("i32"),
                order_ptr=Ptr("i32"), whole_ptr=Ptr("i32"), meet_ptr=Ptr("i32"), R=DIV16, C=DIV16, TILES_C=ANY,
                window=DIV16)  # fmt: skip
    return args, dict(ROWS_ARE_QUERIES=True, CAUSAL=True, HAS_WINDOW=False)


def _flash_schedule_configs(module, cc):
    return [dict(BLOCK_R=128, BLOCK_C=64, CHUNK=64, num_warps=4, num_stages=3)]  # Triton's defaults; 4096 tokens


KERNELS = {
    **{
        name: KernelSpec("matmul", "_matmul_kernel", _gemm_launch(name), _gemm_configs, ("fp16", "bf16"), True)
        for name in GEMM_VARIANTS
    },
    **{
        f"tma-{name}": KernelSpec(
            "matmul",
            "_matmul_tma_kernel",
            _gemm_tma_launch(name),
            _gemm_tma_configs(name),
            ("fp16", "bf16"),
            True,
            True,
        )  # fmt: skip
        for name in GEMM_VARIANTS
    },
    "swiglu-fwd": KernelSpec("swiglu", "_swiglu_fwd_kernel", _swiglu_fwd_launch, _gpu_config, DTYPES),
    "swiglu-bwd": KernelSpec("swiglu", "_swiglu_bwd_kernel", _swiglu_bwd_launch, _gpu_config, DTYPES),
    "swiglu-bwd-pairs": KernelSpec("swiglu", "_swiglu_bwd_pairs_kernel", _swiglu_bwd_pairs_launch, _gpu_config, DTYPES),
    "vocab-ce-stats": KernelSpec("vocab_ce", "_vocab_ce_stats_kernel", _vocab_ce_launch, _vocab_ce_configs, DTYPES),
    "vocab-ce-grad": KernelSpec("vocab_ce", "_vocab_ce_grad_kernel", _vocab_ce_grad_launch, _vocab_ce_configs, DTYPES),
    "rms-norm-fwd": KernelSpec(
        "rms_norm", "_rms_norm_fwd_kernel", _rms_norm_fwd_launch, _rms_norm_configs(False), DTYPES
    ),
    "rms-norm-bwd": KernelSpec(
        "rms_norm", "_rms_norm_bwd_kernel", _rms_norm_bwd_launch, _rms_norm_configs(True), DTYPES
    ),
    # DynamicLossScaler.unscale_ (UNSCALE), and statistics only (inv_scale None)
    "grad-stats+unscale": KernelSpec(
        "grad_stats", "_unscale_stats_kernel", _grad_stats_launch(True), _gpu_config, DTYPES
    ),
    "grad-stats": KernelSpec("grad_stats", "_unscale_stats_kernel", _grad_stats_launch(False), _gpu_config, DTYPES),
    **{
        name: KernelSpec(
            "grouped_matmul", "_grouped_kernel", _grouped_launch(name), _grouped_configs, ("fp16", "bf16"), True
        )  # fmt: skip
        for name in GROUPED_VARIANTS
    },
    "grouped-wgrad": KernelSpec(
        "grouped_matmul",
        "_weight_grad_kernel",
        _grouped_weight_grad_launch,
        _weight_grad_configs,
        ("fp16", "bf16"),
        True,
    ),  # fmt: skip
    **{
        name: KernelSpec(
            "flash_attention",
            FLASH_VARIANTS[name][0],
            _flash_launch(name),
            _flash_configs(name),
            ("fp16", "bf16"),
            True,
        )  # fmt: skip
        for name in FLASH_VARIANTS
    },
    "flash-schedule": KernelSpec(
        "flash_attention", "_schedule_kernel", _flash_schedule_launch, _flash_schedule_configs, ("fp32",)
    ),  # int32 metadata whatever the attention's dtype: one row
}
