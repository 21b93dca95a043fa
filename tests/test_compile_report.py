"""GPU readiness without a GPU: every GEMM config compiles for sm_80 / sm_90a, uses tensor cores,
does not spill and fits shared memory. Compiles run in a subprocess: the suite's interpreter
mode (TRITON_INTERPRET=1) replaces @triton.jit functions with objects that cannot compile."""

import json
import subprocess
import sys

import pytest

from tplayers import compile_report as cr

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def toolchain():
    try:
        cr.tool_dir()
    except cr.ToolchainMissing as e:
        pytest.skip(f"no CUDA toolchain in the triton wheel: {e}")


@pytest.fixture(scope="module")
def rows(toolchain):
    return cr.run_in_subprocess()


def _config_key(row):
    return (row["BLOCK_M"], row["BLOCK_N"], row["BLOCK_K"], row["num_warps"], row["num_stages"])


def _name(row):
    return f"{row['kernel']} {row['arch']} {row['dtype']} {_config_key(row)}"


def test_every_config_compiles_ok(rows):
    bad = [f"{_name(r)}: {r['error']}" for r in rows if not r["ok"]]
    assert not bad, "\n".join(bad)


def test_report_covers_every_config_kernel_and_dtype(rows):
    for cc, arch in cr.ARCHS.items():
        configs = {(bm, bn, bk, w, s) for bm, bn, bk, _, w, s in cr.configs_for(cc)}
        arch_rows = [r for r in rows if r["arch"] == arch]
        assert {_config_key(r) for r in arch_rows} == configs
        assert len(arch_rows) == len(configs) * len(cr.DTYPES) * len(cr.VARIANTS)


def test_tensor_cores_no_spills_and_real_tiles(rows):
    for r in rows:
        name = _name(r)
        if r["arch"] == "sm_80":
            assert r["hmma"] > 0, name
        else:
            assert r["hgmma"] > 0, name
        assert r["stack"] == 0, name
        # The K loop is pipelined through shared memory with the config's tiles: at least
        # num_stages - 1 buffers of A (BLOCK_M x BLOCK_K) and B (BLOCK_K x BLOCK_N), 2-byte inputs.
        stage_bytes = (r["BLOCK_M"] + r["BLOCK_N"]) * r["BLOCK_K"] * 2
        assert r["shared"] >= (r["num_stages"] - 1) * stage_bytes, name
        assert r["blocks_per_sm"] >= 1, name


def test_checker_flags_bad_configs(toolchain):
    """Negative control: one config spills and overflows shared memory, one only overflows it."""
    bad_configs = ["--config", "128,128,128,4,4", "--config", "64,64,256,4,5"]
    spilling, too_big = cr.run_in_subprocess("--arch", "80", "--dtype", "fp16", "--kernel", "gemm", *bad_configs)
    assert not spilling["ok"] and spilling["stack"] > 0 and "spills" in spilling["error"]
    assert not too_big["ok"] and too_big["stack"] == 0 and too_big["shared"] > cr.SMEM_PER_BLOCK[80]
    assert "shared" in too_big["error"]


# Builds each report kernel's arguments the way the layers will (contiguous tensors and their
# transposed views), asks triton's own JIT binder how it specialises them and prints where
# `specialise` differs.
_JIT_CHECK = """
import json, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from tplayers import compile_report as cr

kernel = cr._matmul_module()._matmul_kernel
backend = make_backend(GPUTarget("cuda", 90, 32))
binder = create_function_from_signature(kernel.signature, kernel.params, backend)
flag_names = {p.name for p in kernel.params if p.is_constexpr}
t = lambda *shape, dtype=torch.float16: torch.empty(shape, dtype=dtype)
s3 = lambda x: (0, *x.stride()) if x.dim() == 2 else x.stride()
M, N, K, B = 256, 128, 64, 3
a, w, out = t(M, K), t(N, K), t(M, N)
dy, x, dw = t(B, M, N), t(B, M, K), t(N, K, dtype=torch.float32)
launches = {  # a, b, c, bias, residual, swiglu h, BATCH
    "gemm": (a, w, out, t(N), None, None, 1),
    "gemm+swiglu": (a, w, out, t(N), None, t(M, N // 2), 1),
    "gemm+bias+gelu+residual": (a, w, out, t(N), t(M, N), None, 1),
    "wgrad-accumulate": (dy.mT, x.mT, dw, None, None, None, B),
}
diffs = {}
for name, (a, b, c, bias, res, h, batch) in launches.items():
    signature, constexprs, attrs = cr.specialise(kernel, name, "fp16", (64, 64, 32, 8, 4, 3))
    args = (a, b, c, c if bias is None else bias, c if res is None else res, c if h is None else h,
            a.shape[-2], b.shape[-2], a.shape[-1], batch, 1.0,
            *s3(a), *s3(b), *s3(c), *(s3(res) if res is not None else (0, 0, 0)),
            *(s3(h) if h is not None else (0, 0, 0)))
    flags = {k: v for k, v in constexprs.items() if k in flag_names}
    bound, spec, options = binder(*args, **flags, num_warps=4, num_stages=3)
    _, jit_sig, jit_ce, jit_attrs = kernel._pack_args(backend, dict(flags), bound, spec, options)
    jit_ce = {kernel.arg_names[k[0]]: v for k, v in jit_ce.items()}
    jit_attrs = {k: v for k, v in jit_attrs.items() if v}
    diffs[name] = [what for what, ours, jit in [("signature", signature, jit_sig),
                   ("constexprs", constexprs, jit_ce), ("attrs", attrs, jit_attrs)] if ours != jit]
print(json.dumps(diffs))
"""


def test_specialisation_matches_triton_jit(toolchain):
    cmd = [sys.executable, "-c", _JIT_CHECK]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cr.subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(diffs) == set(cr.VARIANTS)
    assert not any(diffs.values()), diffs
