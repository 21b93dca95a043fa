"""Ahead-of-time compile report for the GEMM kernel: GPU readiness checked without a GPU.

Every config in SM80_CONFIGS / SM90_CONFIGS is compiled with `triton.compile` for its target
(sm_80, sm_90a), for each input dtype and for the three specialisations the layers launch.
The cubin is inspected with the wheel's `cuobjdump` for registers, stack (spills), shared
memory and tensor-core instructions (HMMA on sm_80, HGMMA = wgmma on sm_90a).

    python -m tplayers.compile_report [--csv PATH] [--json]     (exit code 1 if a row is not ok)
"""

import argparse
import csv
import importlib.util
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

DTYPES = ("fp16", "bf16")
ARCHS = {80: "sm_80", 90: "sm_90a"}
TENSOR_CORE_OP = {80: "HMMA", 90: "HGMMA"}
# Per-SM shared memory; CUDA reserves 1 KiB of it per resident block, hence the per-block limit.
SMEM_PER_SM = {80: 164 * 1024, 90: 228 * 1024}
SMEM_RESERVED_PER_BLOCK = 1024
SMEM_PER_BLOCK = {cc: smem - SMEM_RESERVED_PER_BLOCK for cc, smem in SMEM_PER_SM.items()}
REGS_PER_SM, WARPS_PER_SM, BLOCKS_PER_SM = 65536, 64, 32

# The three specialisations the layers launch: constexpr flags, which strides are 1 (the JIT
# turns an int argument equal to 1 into a constexpr), C's dtype (None: the input dtype) and
# whether BATCH is a runtime value (3-D reduce_batch) or the constexpr 1 of a 2-D GEMM.
# The weight gradient reads transposed views of contiguous activations (a = dY^T, b = X^T),
# so its unit strides are along M and N: it also covers the dgrad layout (b = W^T).
VARIANTS = {
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
COLUMNS = [
    "kernel", "arch", "dtype", "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages",
    "registers", "stack", "shared", "hmma", "hgmma", "blocks_per_sm", "occupancy_limit", "ok", "error",
]  # fmt: skip


class ToolchainMissing(RuntimeError):
    """The triton wheel ships no ptxas / cuobjdump: nothing can be compiled for a GPU here."""


def tool_dir():
    """The wheel's CUDA tools, found without importing triton (it may be in interpreter mode)."""
    spec = importlib.util.find_spec("triton")
    if spec is None:
        raise ToolchainMissing("triton is not installed")
    bin_dir = Path(spec.submodule_search_locations[0]) / "backends" / "nvidia" / "bin"
    for tool in ("ptxas", "cuobjdump"):
        if not os.access(bin_dir / tool, os.X_OK):
            raise ToolchainMissing(f"the triton wheel has no {tool} in {bin_dir}: cannot compile for a GPU")
    return bin_dir


def _matmul_module():
    try:
        from tplayers.kernels import matmul
    except ImportError:  # a source checkout on PYTHONPATH, not installed
        from kernels import matmul
    return matmul


def configs_for(cc):
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) of the configs for `cc`."""
    matmul = _matmul_module()
    configs = matmul.SM80_CONFIGS if cc == 80 else matmul.SM90_CONFIGS
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
    return [(*(c.kwargs[k] for k in keys), c.num_warps, c.num_stages) for c in configs]


def specialise(kernel_fn, variant, dtype, config):
    """signature, constexprs and attrs as triton 3.9's JIT builds them for such a launch.

    The JIT turns int arguments equal to 1 into constexprs and marks pointers aligned to 16 bytes
    and ints divisible by 16 with tt.divisibility=16 (floats are never specialised). We assume
    16-byte aligned tensors and M, N, K and non-unit strides divisible by 16 (hidden sizes and
    token counts are); stride 0 (a 2-D operand's batch stride, an absent residual) is too.
    """
    spec = VARIANTS[variant]
    bm, bn, bk, group_m, _, _ = config
    out = spec["out_dtype"] or dtype
    pointers = {
        "a_ptr": dtype,
        "b_ptr": dtype,
        "c_ptr": out,
        # the launcher passes `out` in place of an absent bias / residual
        "bias_ptr": dtype if spec["flags"]["HAS_BIAS"] else out,
        "res_ptr": dtype if spec["flags"]["HAS_RESIDUAL"] else out,
        "h_ptr": dtype if spec["flags"]["SWIGLU"] else out,
    }
    tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m)
    constexprs = dict(spec["flags"], UPCAST=False, INPUT_PRECISION="ieee", INT64_OFFSETS=False, **tiles)
    constexprs.update({name: 1 for name in spec["unit_strides"]})
    if not spec["batched"]:
        constexprs["BATCH"] = 1
    signature, attrs = {}, {}
    for i, name in enumerate(kernel_fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name != "BATCH":  # a batch count is anything
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def occupancy(cc, registers, shared, num_warps):
    """Resident blocks per SM and the resource that limits them (registers in units of 8/thread)."""
    regs_per_block = -(-max(registers, 1) // 8) * 8 * 32 * num_warps
    fits = shared <= SMEM_PER_BLOCK[cc]
    limits = {
        "registers": REGS_PER_SM // regs_per_block,
        "shared": SMEM_PER_SM[cc] // (shared + SMEM_RESERVED_PER_BLOCK) if fits else 0,
        "warps": WARPS_PER_SM // num_warps,
        "blocks": BLOCKS_PER_SM,
    }
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


def inspect_cubin(cubin, bin_dir):
    """REG / STACK / static SHARED and tensor-core instruction counts from cuobjdump."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run(
            [bin_dir / "cuobjdump", "--dump-resource-usage", "--dump-sass", path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usage = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {
        "sass_arch": re.search(r"code for (sm_\w+)", text).group(1),
        "registers": int(usage["REG"]),
        "stack": int(usage["STACK"]) + int(usage["LOCAL"]),  # spills land in either
        "static_shared": int(usage["SHARED"]),
        "hmma": len(re.findall(r"\bHMMA\.", text)),
        "hgmma": len(re.findall(r"\bHGMMA\.", text)),
    }


def compile_row(job):
    """Compile one (kernel, cc, dtype, config) and return its report row."""
    variant, cc, dtype, config = job
    bm, bn, bk, _, num_warps, num_stages = config
    row = dict(kernel=variant, arch=ARCHS[cc], dtype=dtype, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    row.update(num_warps=num_warps, num_stages=num_stages, ok=False, error="")
    try:
        import triton
        from triton.backends.compiler import GPUTarget

        kernel_fn = _matmul_module()._matmul_kernel
        if not isinstance(kernel_fn, triton.JITFunction):
            raise RuntimeError("_matmul_kernel is not a JITFunction: triton was imported with TRITON_INTERPRET")
        src = triton.compiler.ASTSource(kernel_fn, *specialise(kernel_fn, variant, dtype, config))
        compiled = triton.compile(
            src, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
        )
        info = inspect_cubin(compiled.asm["cubin"], tool_dir())
    except Exception as e:  # a config that does not compile is a failed row, not a crash
        first_line = (str(e).strip().splitlines() or [""])[0]
        row["error"] = f"{type(e).__name__}: {first_line}"
        return row
    # Triton's shared memory is dynamic (metadata.shared, requested at launch): cuobjdump's SHARED
    # is only the static part ptxas adds (1 KiB on sm_90a). A block needs both.
    shared = compiled.metadata.shared + info["static_shared"]
    blocks, limiter = occupancy(cc, info["registers"], shared, num_warps)
    row.update(registers=info["registers"], stack=info["stack"], shared=shared, hmma=info["hmma"])
    row.update(hgmma=info["hgmma"], blocks_per_sm=blocks, occupancy_limit=limiter)
    problems = []
    if info["sass_arch"] != ARCHS[cc]:
        problems.append(f"cubin is {info['sass_arch']}")
    if info[TENSOR_CORE_OP[cc].lower()] == 0:
        problems.append(f"no {TENSOR_CORE_OP[cc]}")
    if info["stack"]:
        problems.append(f"spills ({info['stack']} B stack)")
    if shared > SMEM_PER_BLOCK[cc]:
        problems.append(f"shared {shared} B > {SMEM_PER_BLOCK[cc]} B")
    row["ok"], row["error"] = not problems, "; ".join(problems)
    return row


def compile_report(archs=(80, 90), dtypes=DTYPES, kernels=tuple(VARIANTS), configs=None, workers=None):
    """One row per (kernel, arch, config, dtype); `configs` overrides the kernel's config lists."""
    tool_dir()  # fail early and clearly without ptxas
    jobs = [
        (variant, cc, dtype, config)
        for cc in archs
        for config in (configs or configs_for(cc))
        for dtype in dtypes
        for variant in kernels
    ]
    workers = workers or min(len(jobs), os.cpu_count() or 1, 8)
    # Fresh (spawned) processes compile in parallel. They inherit the environment and import the
    # kernel module, which imports triton, so TRITON_INTERPRET must be gone before they start.
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            return list(pool.map(compile_row, jobs))
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret


def subprocess_env():
    """This environment without TRITON_INTERPRET, with `tplayers` importable from a checkout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated to silence its warning
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def run_in_subprocess(*args, timeout=600):
    """Run `python -m tplayers.compile_report --json ARGS` without TRITON_INTERPRET; return its rows."""
    tool_dir()
    proc = subprocess.run(
        [sys.executable, "-m", "tplayers.compile_report", "--json", *args],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=timeout,
    )
    if proc.returncode not in (0, 1):  # 1 only means some row is not ok
        raise RuntimeError(f"compile report failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def format_table(rows):
    def cell(row, col):
        value = row.get(col, "")
        return "ok" if value is True else "FAIL" if value is False else str(value)

    widths = {col: max(len(col), *(len(cell(r, col)) for r in rows)) for col in COLUMNS}
    lines = ["  ".join(col.ljust(widths[col]) for col in COLUMNS)]
    lines += ["  ".join(cell(r, col).ljust(widths[col]) for col in COLUMNS) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _config(text):
    values = tuple(int(v) for v in text.split(","))
    if len(values) != 5:
        raise argparse.ArgumentTypeError("a config is BLOCK_M,BLOCK_N,BLOCK_K,NUM_WARPS,NUM_STAGES")
    bm, bn, bk, warps, stages = values
    return (bm, bn, bk, 8, warps, stages)


def add_arguments(parser):
    parser.add_argument("--csv", metavar="PATH", help="also write the rows as CSV")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--arch", type=int, choices=sorted(ARCHS), action="append", help="default: all")
    parser.add_argument("--dtype", choices=DTYPES, action="append", help="default: all")
    parser.add_argument("--kernel", choices=list(VARIANTS), action="append", help="default: all")
    parser.add_argument(
        "--config", type=_config, action="append", metavar="BM,BN,BK,WARPS,STAGES",
        help="compile these configs instead of SM80_CONFIGS / SM90_CONFIGS (GROUP_M=8)",
    )  # fmt: skip
    parser.add_argument("--workers", type=int, help="parallel compiles (default: CPU count, at most 8)")
    return parser


def run(args):
    """Run the report for parsed `args`; exit code 1 if any row is not ok."""
    rows = compile_report(
        archs=tuple(args.arch or ARCHS),
        dtypes=tuple(args.dtype or DTYPES),
        kernels=tuple(args.kernel or VARIANTS),
        configs=args.config,
        workers=args.workers,
    )
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0 if all(row["ok"] for row in rows) else 1


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tplayers compile-report", description=__doc__.splitlines()[0])
    return run(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
