"""GPU readiness without a GPU: every kernel config in kernels/ (GEMM, SwiGLU, vocab cross-entropy
statistics, gradient unscale + statistics) compiles for sm_80 / sm_90a in every dtype it is
launched with, does not spill and fits shared memory; the GEMMs use tensor cores. Compiles run in
a subprocess: the suite's interpreter mode (TRITON_INTERPRET=1) replaces @triton.jit functions
with objects that cannot compile."""

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from tplayers.tools import compile_report as cr
from tplayers.tools.kernel_launches import FLASH_VARIANTS, GROUPED_VARIANTS

pytestmark = pytest.mark.compile

TMA_GEMMS = {f"tma-{name}" for name in cr.GEMM_VARIANTS}  # Hopper's persistent TMA kernel, sm_90a only
GEMMS = set(cr.GEMM_VARIANTS) | TMA_GEMMS | {*GROUPED_VARIANTS, "grouped-wgrad"}  # the experts' grouped GEMM too
TENSOR_CORES = GEMMS | set(FLASH_VARIANTS)  # flash attention's q k^T and p v too


@pytest.fixture(scope="module")
def toolchain():
    try:
        cr.tool_dir()
    except cr.ToolchainMissing as e:
        pytest.skip(f"no CUDA toolchain in the triton wheel: {e}")


@pytest.fixture(scope="module")
def rows(toolchain):
    return cr.run_in_subprocess()


def _name(row):
    return f"{row['kernel']} {row['arch']} {row['dtype']} {row['blocks']} warps={row['num_warps']}"


def _run(script, timeout=600):
    """Run `script` without TRITON_INTERPRET and return the JSON of its last output line."""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=cr.subprocess_env(), timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_config_compiles_ok(rows):
    bad = [f"{_name(r)}: {r['error']}" for r in rows if not r["ok"]]
    assert not bad, "\n".join(bad)


def test_report_covers_every_kernel_config_and_dtype(rows):
    assert {r["kernel"] for r in rows} == set(cr.KERNELS)
    for kernel, spec in cr.KERNELS.items():
        for cc, arch in cr.ARCHS.items():
            configs = cr.configs_for(kernel, cc)
            expected = {
                (cr._blocks(c), c["num_warps"], c.get("num_stages", 3), d) for c in configs for d in spec.dtypes
            }
            got = [
                (r["blocks"], r["num_warps"], r["num_stages"], r["dtype"])
                for r in rows
                if r["kernel"] == kernel and r["arch"] == arch
            ]
            assert sorted(got) == sorted(expected), (kernel, arch)
    # the elementwise and reduction kernels also run on fp32 (fp32 models, fp32 gradients, fp32 logits)
    assert all("fp32" in spec.dtypes for kernel, spec in cr.KERNELS.items() if kernel not in TENSOR_CORES)


def test_no_spills_shared_fits_and_resident(rows):
    for r in rows:
        name = _name(r)
        assert r["stack"] == 0, name
        assert 0 < r["registers"] <= 255, name
        assert r["shared"] <= cr.SMEM_PER_BLOCK[80 if r["arch"] == "sm_80" else 90], name
        assert r["blocks_per_sm"] >= 1 and r["occupancy_limit"], name


def test_tensor_cores_in_gemms_and_attention_only(rows):
    assert {k for k, spec in cr.KERNELS.items() if spec.tensor_cores} == TENSOR_CORES
    for r in rows:
        name = _name(r)
        tensor_core_ops = r["hmma"] if r["arch"] == "sm_80" else r["hgmma"]
        if r["kernel"] in FLASH_VARIANTS:
            assert tensor_core_ops > 0, name
        elif r["kernel"] in GEMMS:
            assert tensor_core_ops > 0, name
            # The K loop is pipelined through shared memory with the config's tiles: at least
            # num_stages - 1 buffers of A (BLOCK_M x BLOCK_K) and B (BLOCK_K x BLOCK_N), 2-byte inputs.
            tile = dict(kv.split("=") for kv in r["blocks"].split())
            stage_bytes = (int(tile["BLOCK_M"]) + int(tile["BLOCK_N"])) * int(tile["BLOCK_K"]) * 2
            assert r["shared"] >= (r["num_stages"] - 1) * stage_bytes, name
        else:  # no tl.dot: ok without any tensor-core instruction
            assert r["ok"] and r["hmma"] == r["hgmma"] == 0, name


def test_checker_flags_bad_gemm_configs(toolchain):
    """Negative control: one config spills and overflows shared memory, one only overflows it."""
    bad_configs = ["--config", "128,128,128,4,4", "--config", "64,64,256,4,5"]
    spilling, too_big = cr.run_in_subprocess("--arch", "80", "--dtype", "fp16", "--kernel", "gemm", *bad_configs)
    assert not spilling["ok"] and spilling["stack"] > 0 and "spills" in spilling["error"]
    assert not too_big["ok"] and too_big["stack"] == 0 and too_big["shared"] > cr.SMEM_PER_BLOCK[80]
    assert "shared" in too_big["error"]


_BAD_ROWS = """
import json
from tplayers.tools import compile_report as cr
print(json.dumps(cr.compile_rows([
    ("swiglu-fwd", 80, "fp32", dict(BLOCK_M=32, BLOCK_N=128, num_warps=1)),
    ("gemm", 80, "fp32", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)),
])))
"""


def test_checker_flags_spilling_elementwise_and_gemm_without_tensor_cores(toolchain):
    """Negative controls: a 32x128 fp32 SwiGLU tile on one warp (128 elements a thread) spills,
    flagged for that alone, not for lacking tensor cores; an fp32 GEMM at IEEE precision runs on
    FMAs, flagged as no HMMA."""
    spilling, fma_gemm = _run(_BAD_ROWS)
    assert not spilling["ok"] and spilling["stack"] > 0 and spilling["error"].startswith("spills")
    assert "HMMA" not in spilling["error"]
    assert not fma_gemm["ok"] and fma_gemm["hmma"] == 0 and fma_gemm["error"] == "no HMMA"


def test_tma_gemm_loads_through_the_accelerator_on_hopper_only(rows):
    """The TMA kernel's rows are sm_90a's (Ampere runs the pointer kernel), each with TMA loads and
    wgmma; the 128x256 tile the pointer kernel's budget rules out is among the plain GEMM's."""
    tma_rows = [r for r in rows if r["kernel"] in TMA_GEMMS]
    assert tma_rows and all(r["arch"] == "sm_90a" and r["tma"] > 0 and r["hgmma"] > 0 for r in tma_rows)
    assert any(r["kernel"] == "tma-gemm" and "BLOCK_M=128 BLOCK_N=256" in r["blocks"] for r in tma_rows)
    assert all(r["tma"] == 0 for r in rows if r["kernel"] in cr.GEMM_VARIANTS)  # the pointer kernel's plain loads


_NO_TMA = """
import dataclasses, json
from tplayers.tools import compile_report as cr
cr.KERNELS["gemm"] = dataclasses.replace(cr.KERNELS["gemm"], tma=True)  # the pointer kernel, said to use TMA
print(json.dumps(cr.compile_row(("gemm", 90, "bf16", cr.configs_for("gemm", 90)[0]))))
"""


def test_checker_flags_a_tma_kernel_without_tma_loads(toolchain):
    """Negative control: the pointer kernel checked as a TMA kernel is flagged for it."""
    row = _run(_NO_TMA)
    assert not row["ok"] and row["tma"] == 0 and "no UTMALDG" in row["error"]


def test_config_option_and_spec_mismatch():
    assert cr._config("64,64,32,4,3") == dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
    assert cr._config("BLOCK_M=16,BLOCK_N=128,num_warps=4") == dict(BLOCK_M=16, BLOCK_N=128, num_warps=4)
    for bad in ("64,64,32", "BLOCK_M=x", "BLOCK_M"):
        with pytest.raises(argparse.ArgumentTypeError):
            cr._config(bad)

    class Kernel:  # a kernel whose parameters no longer match its KERNELS row
        __name__ = "_swiglu_bwd_kernel"
        arg_names = ["dh_ptr", "gate_ptr", "new_ptr", "M", "N", "BLOCK_M", "BLOCK_N"]

    with pytest.raises(cr.SpecMismatch, match="new_ptr"):
        cr.specialise(Kernel(), "swiglu-bwd", "fp16", dict(BLOCK_M=16, BLOCK_N=128))


def test_kernel_that_does_not_import_is_a_failed_row(toolchain, monkeypatch):
    broken = dataclasses.replace(cr.KERNELS["swiglu-fwd"], module="no_such_module")
    monkeypatch.setitem(cr.KERNELS, "broken", broken)
    rows = cr.compile_report(archs=(80,), kernels=("broken",))
    assert [r["dtype"] for r in rows] == list(broken.dtypes)
    assert all(not r["ok"] and r["error"].startswith("ModuleNotFoundError") for r in rows)


# Calls each kernel's real launcher the way the library does (the layers' shapes and views) with
# the @triton.jit kernel replaced by a recorder, hands the recorded arguments to triton's own JIT
# binder with our constexprs, and prints where `specialise` differs from what the JIT builds, and
# where our constexprs differ from the launcher's own keyword arguments. The launchers run their
# interpreter path (no CUDA needed): same arguments, but the interpreter's block sizes and
# workarounds (UPCAST, EMULATE_BF16), which are therefore not compared.
_JIT_CHECK = """
import dataclasses, json, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from tplayers.tools import compile_report as cr

INTERPRETER_ONLY = {"UPCAST", "EMULATE_BF16", "NUM_SMS"}  # NUM_SMS: the running GPU's count
TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
M, N, K, B, V = 64, 96, 32, 3, 256

class Recorder:
    def __init__(self):
        self.launches = []
    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))

def launched(kernel, call):
    # the launch of KERNELS[kernel] that `call` makes (its module's other kernels stubbed too)
    spec = cr.KERNELS[kernel]
    module = cr.kernel_module(spec.module)
    attrs = {s.attr for s in cr.KERNELS.values() if s.module == spec.module}
    real, interpret = {a: getattr(module, a) for a in attrs}, module.INTERPRET
    recorders = {a: Recorder() for a in attrs}
    for a in attrs:
        setattr(module, a, recorders[a])
    module.INTERPRET = True
    tma = getattr(module, "TMA_IN_INTERPRETER", None)
    if tma is not None:  # the TMA GEMM's rows: its launcher's path on sm_90
        module.TMA_IN_INTERPRETER = kernel.startswith("tma-")
    try:
        call()
    finally:
        for a in attrs:
            setattr(module, a, real[a])
        module.INTERPRET = interpret
        if tma is not None:
            module.TMA_IN_INTERPRETER = tma
    (launch,) = recorders[spec.attr].launches
    return launch

def calls(dtype):
    t = lambda *shape, dtype=dtype: torch.zeros(shape, dtype=dtype)
    matmul = cr.kernel_module("matmul").matmul
    swiglu = cr.kernel_module("swiglu")
    y, dy = t(M, 2 * N), t(M, 2 * N)  # interleaved [gate, up] GEMM output and its gradient
    grads = [t(1000), t(40, 50), t(30, 20).T]
    vocab_ce_stats = cr.kernel_module("vocab_ce").vocab_ce_stats
    vocab_ce_grad = cr.kernel_module("vocab_ce").vocab_ce_grad
    rows = torch.zeros(M, dtype=torch.float32)
    norm = cr.kernel_module("rms_norm")
    unscale_and_stats_ = cr.kernel_module("grad_stats").unscale_and_stats_
    grouped = cr.kernel_module("grouped_matmul")
    counts, index = torch.tensor([M // 2, M // 2]), torch.arange(M)  # two experts, M pairs
    flash = cr.kernel_module("flash_attention")
    def attention(D, backward=False, **opts):  # HF's (B, H, S, D) q view, 2 query heads per key/value head
        q, k = t(1, M, 2, D).transpose(1, 2), t(1, 1, M, D)
        meta = [torch.zeros(1, M, dtype=torch.int32)] * 4
        if backward:
            return lambda: flash.flash_attention_backward(t(1, 2, M, D), q, k, k, t(1, 2, M, D),
                                                          torch.zeros(1, 2, M), *meta, **opts)
        return lambda: flash.flash_attention(q, k, k, *meta, **opts)
    gemms = {
        "gemm": lambda: matmul(t(M, K), t(N, K), bias=t(N)),
        "gemm+swiglu": lambda: matmul(t(M, K), t(N, K), bias=t(N), swiglu_out=t(M, N // 2)),
        "gemm+bias+gelu+residual": lambda: matmul(t(M, K), t(N, K), bias=t(N), activation="gelu_tanh",
                                                  residual=t(M, N)),
        # dW += sum_b dY_b^T X_b from contiguous (B, M, N) dY and (B, M, K) X
        "wgrad-accumulate": lambda: matmul(t(B, M, N).mT, t(B, M, K).mT, out=t(N, K, dtype=torch.float32),
                                           accumulate=True, reduce_batch=True),
    }
    return {
        **gemms,
        **{f"tma-{name}": call for name, call in gemms.items()},  # the same calls, on Hopper's path
        "swiglu-fwd": lambda: swiglu.swiglu(y[:, 0::2], y[:, 1::2]),
        "swiglu-bwd": lambda: swiglu.swiglu_backward(t(M, N), y[:, 0::2], y[:, 1::2]),
        "swiglu-bwd-pairs": lambda: swiglu.swiglu_backward(t(M, N), y[:, 0::2], y[:, 1::2], dgate=dy[:, 0::2],
                                                           dup=dy[:, 1::2]),
        "vocab-ce-stats": lambda: vocab_ce_stats(t(M, V), torch.zeros(M, dtype=torch.int64), vocab_start=V),
        "rms-norm-fwd": lambda: norm.rms_norm(t(M, K), t(K), 1e-6),
        "rms-norm-bwd": lambda: norm.rms_norm_backward(t(M, K), t(M, K), t(K), rows),
        "vocab-ce-grad": lambda: vocab_ce_grad(t(M, V), torch.zeros(M, dtype=torch.int64), rows, rows, vocab_start=V),
        "grad-stats+unscale": lambda: unscale_and_stats_(grads, torch.ones(1)),
        "grad-stats": lambda: unscale_and_stats_(grads, None),
        # the experts' MLP: gate|up with SwiGLU through the gather index, down scaled into the grid,
        # the input gradient through transposed weights, gate|up's weight gradient
        "grouped+swiglu": lambda: grouped.grouped_matmul(t(M, K), t(2, N, K), counts, gather=index, swiglu=True,
                                                         pre=t(M, N)),
        "grouped+scale+scatter": lambda: grouped.grouped_matmul(t(M, K), t(2, N, K), counts, scatter=index,
                                                                scale=t(M, dtype=torch.float32), out_rows=2 * M),
        "grouped-dgrad+scatter": lambda: grouped.grouped_matmul(t(M, K), t(2, K, N).transpose(1, 2), counts,
                                                                scatter=index, out_rows=2 * M),
        "grouped-wgrad": lambda: grouped.grouped_weight_grad(t(M, N), t(M, K), counts, gather=index),
        "flash-fwd-d64": attention(64),
        "flash-fwd-d128": attention(128),
        "flash-fwd-d128+window+softcap": attention(128, window=5, softcap=30.0),
        "flash-dkdv-d64": attention(64, backward=True),
        "flash-dkdv-d128": attention(128, backward=True),
        "flash-dq-d64": attention(64, backward=True),
        "flash-dq-d128": attention(128, backward=True),
        # 192 tokens: three 64-key tiles (neither 1 nor a multiple of 16, as the table assumes)
        "flash-schedule": lambda: flash.tile_schedule(*[torch.zeros(1, 192, dtype=torch.int32)] * 4, 128, 64, True,
                                                      None),
    }

backend = make_backend(GPUTarget("cuda", 90, 32))

def differences(kernel, dtype, call):
    fn = cr.kernel_fn(kernel)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    param_constexprs = {p.name for p in fn.params if p.is_constexpr}
    config = cr.configs_for(kernel, 90)[0]
    args, kwargs = launched(kernel, call)
    signature, constexprs, attrs = cr.specialise(fn, kernel, dtype, config)
    flags = {k: v for k, v in constexprs.items() if k in param_constexprs}
    bound, sig_spec, options = binder(*args, **flags, num_warps=4, num_stages=3)
    _, jit_sig, jit_ce, jit_attrs = fn._pack_args(backend, dict(flags), bound, sig_spec, options)
    jit_ce = {fn.arg_names[k[0]]: v for k, v in jit_ce.items()}
    jit_attrs = {k: v for k, v in jit_attrs.items() if v}
    launcher = {k: v for k, v in kwargs.items() if k not in INTERPRETER_ONLY and k not in config}
    ours = {k: constexprs.get(k, "missing") for k in launcher}
    return [what for what, a, b in [("signature", signature, jit_sig), ("constexprs", constexprs, jit_ce),
                                    ("attrs", attrs, jit_attrs), ("launcher flags", ours, launcher)] if a != b]

diffs = {f"{kernel} {dtype}": differences(kernel, dtype, calls(TORCH[dtype])[kernel])
         for kernel, spec in cr.KERNELS.items() for dtype in spec.dtypes}
# Negative controls: a table that calls every pointer aligned (the up / dup halves are not), and
# the statistics-only table against the unscaling launch (UNSCALE differs).
launch = cr.KERNELS["swiglu-bwd"].launch
aligned = lambda dtype: ({k: cr.Ptr(v.dtype) if isinstance(v, cr.Ptr) else v for k, v in launch(dtype)[0].items()},
                         launch(dtype)[1])
cr.KERNELS["swiglu-bwd"] = dataclasses.replace(cr.KERNELS["swiglu-bwd"], launch=aligned)
diffs["control: all aligned"] = differences("swiglu-bwd", "fp16", calls(torch.float16)["swiglu-bwd"])
diffs["control: UNSCALE"] = differences("grad-stats", "fp16", calls(torch.float16)["grad-stats+unscale"])
print(json.dumps(diffs))
"""


def test_specialisation_matches_triton_jit(toolchain):
    diffs = _run(_JIT_CHECK, timeout=300)
    assert diffs.pop("control: all aligned") == ["attrs"]
    assert diffs.pop("control: UNSCALE") == ["launcher flags"]
    assert set(diffs) == {f"{k} {d}" for k, spec in cr.KERNELS.items() for d in spec.dtypes}
    assert not any(diffs.values()), {k: v for k, v in diffs.items() if v}
