"""Ahead-of-time compile report for every Triton kernel in kernels/: GPU readiness checked without a GPU.

KERNELS (`tplayers.tools.kernel_launches`) is one table: each row is a kernel launched one way
(the GEMM's four epilogue variants, the SwiGLU epilogue forward and backward, the vocab-parallel
cross-entropy statistics and gradient passes, the RMSNorm forward and backward, the fused gradient
unscale + statistics pass with and without the unscale, the experts' grouped GEMM's three launches
and its weight gradient), with the arguments
its launcher passes, its configs for sm_80 / sm_90a and the dtypes it is launched with. Every
(kernel, arch, config, dtype) is compiled with `triton.compile` for its target, specialised as
the JIT would specialise that launch, and the cubin is inspected with the wheel's `cuobjdump`
for registers, stack (spills), shared memory and tensor-core instructions (HMMA on sm_80, HGMMA
= wgmma on sm_90a) and tensor-memory-accelerator loads (UTMALDG). A row is ok when its cubin is
for its arch, nothing spills, its shared memory fits one block, for the GEMM rows (plain and
grouped) tensor-core instructions were emitted (the elementwise and reduction kernels have no
tl.dot), and for the TMA GEMM (sm_90a only) TMA loads too.

    python -m tplayers.tools.compile_report [--kernel K] [--arch CC] [--dtype D] [--csv PATH] [--json]
    (exit code 1 if a row is not ok)
"""

import argparse
import csv
import importlib
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

from tplayers.tools.kernel_launches import DTYPES, GEMM_VARIANTS, KERNELS, KernelSpec, Ptr  # noqa: F401 (re-exported)

ARCHS = {80: "sm_80", 90: "sm_90a"}
TENSOR_CORE_OP = {80: "HMMA", 90: "HGMMA"}
# Per-SM shared memory; CUDA reserves 1 KiB of it per resident block, hence the per-block limit.
SMEM_PER_SM = {80: 164 * 1024, 90: 228 * 1024}
SMEM_RESERVED_PER_BLOCK = 1024
SMEM_PER_BLOCK = {cc: smem - SMEM_RESERVED_PER_BLOCK for cc, smem in SMEM_PER_SM.items()}
REGS_PER_SM, WARPS_PER_SM, BLOCKS_PER_SM = 65536, 64, 32
# Config keys that are compile options, not constexpr arguments of the kernel.
OPTIONS = ("num_warps", "num_stages")
COLUMNS = [
    "kernel", "arch", "dtype", "blocks", "num_warps", "num_stages",
    "registers", "stack", "shared", "hmma", "hgmma", "tma", "blocks_per_sm", "occupancy_limit", "ok", "error",
]  # fmt: skip


class ToolchainMissing(RuntimeError):
    """The triton wheel ships no ptxas / cuobjdump: nothing can be compiled for a GPU here."""


class SpecMismatch(RuntimeError):
    """A KERNELS row no longer describes its kernel's parameters (the kernel changed)."""


# -- compiling and inspecting --------------------------------------------------------------------


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


def kernel_module(name):
    """kernels/<name>.py, installed as tplayers.kernels or from a source checkout on PYTHONPATH."""
    try:
        return importlib.import_module(f"tplayers.kernels.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("tplayers.kernels", f"tplayers.kernels.{name}"):
            raise
        return importlib.import_module(f"kernels.{name}")


def kernel_fn(kernel):
    """The @triton.jit function of KERNELS[kernel]."""
    spec = KERNELS[kernel]
    return getattr(kernel_module(spec.module), spec.attr)


def configs_for(kernel, cc):
    """The launcher's configs of KERNELS[kernel] for `cc`: dicts of constexprs and options."""
    spec = KERNELS[kernel]
    return spec.configs(kernel_module(spec.module), cc)


def specialise(fn, kernel, dtype, config):
    """signature, constexprs and attrs as triton 3.9's JIT builds them for KERNELS[kernel]'s launch.

    The JIT turns int arguments equal to 1 into constexprs and marks pointers aligned to 16 bytes
    and ints divisible by 16 with tt.divisibility=16 (floats are never specialised). Raises
    SpecMismatch if the table's arguments are not exactly the kernel's parameters.
    """
    args, constexprs = KERNELS[kernel].launch(dtype)
    constexprs = dict(constexprs, **{k: v for k, v in config.items() if k not in OPTIONS})
    given = args.keys() | constexprs.keys()
    missing, unknown = set(fn.arg_names) - given, given - set(fn.arg_names)
    both = args.keys() & constexprs.keys()
    if missing or unknown or both:
        problems = [("not given", missing), ("not parameters", unknown), ("given twice", both)]
        raise SpecMismatch(
            f"{kernel}: the launch table and config do not match {fn.__name__}'s parameters: "
            + "; ".join(f"{what} {sorted(names)}" for what, names in problems if names)
        )
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        value = args.get(name)
        if name in constexprs or (type(value) is int and value == 1):
            constexprs.setdefault(name, value)
            signature[name] = "constexpr"
        elif isinstance(value, Ptr):
            signature[name] = "*" + value.dtype
            if value.aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif type(value) is float:
            signature[name] = "fp32"
        elif type(value) is int:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise SpecMismatch(f"{kernel}: argument {name} = {value!r} is not a Ptr, int or float")
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
        "tma": len(re.findall(r"\bUTMALDG\b", text)),  # tensor-memory-accelerator loads
    }


def _blocks(config):
    return " ".join(f"{k}={v}" for k, v in config.items() if k not in OPTIONS)


def _failed_row(kernel, cc, dtype, config, error):
    row = dict(kernel=kernel, arch=ARCHS[cc], dtype=dtype, blocks=_blocks(config), ok=False)
    row.update({k: config.get(k, "") for k in OPTIONS})
    first_line = (str(error).strip().splitlines() or [""])[0]
    row["error"] = f"{type(error).__name__}: {first_line}"
    return row


def compile_row(job):
    """Compile one (kernel, cc, dtype, config) and return its report row."""
    kernel, cc, dtype, config = job
    try:
        import triton
        from triton.backends.compiler import GPUTarget

        fn = kernel_fn(kernel)
        if not isinstance(fn, triton.JITFunction):
            raise RuntimeError(f"{fn} is not a JITFunction: triton was imported with TRITON_INTERPRET")
        src = triton.compiler.ASTSource(fn, *specialise(fn, kernel, dtype, config))
        options = {k: config[k] for k in OPTIONS if k in config}  # the rest: triton's defaults, as at launch
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
        info = inspect_cubin(compiled.asm["cubin"], tool_dir())
    except Exception as e:  # a config that does not compile is a failed row, not a crash
        return _failed_row(kernel, cc, dtype, config, e)
    meta = compiled.metadata
    # Triton's shared memory is dynamic (metadata.shared, requested at launch): cuobjdump's SHARED
    # is only the static part ptxas adds (1 KiB on sm_90a). A block needs both.
    shared = meta.shared + info["static_shared"]
    blocks, limiter = occupancy(cc, info["registers"], shared, meta.num_warps)
    row = dict(kernel=kernel, arch=ARCHS[cc], dtype=dtype, blocks=_blocks(config))
    row.update(num_warps=meta.num_warps, num_stages=meta.num_stages, registers=info["registers"])
    row.update(stack=info["stack"], shared=shared, hmma=info["hmma"], hgmma=info["hgmma"], tma=info["tma"])
    row.update(blocks_per_sm=blocks, occupancy_limit=limiter)
    problems = []
    if info["sass_arch"] != ARCHS[cc]:
        problems.append(f"cubin is {info['sass_arch']}")
    if KERNELS[kernel].tensor_cores and info[TENSOR_CORE_OP[cc].lower()] == 0:
        problems.append(f"no {TENSOR_CORE_OP[cc]}")
    if KERNELS[kernel].tma and info["tma"] == 0:
        problems.append("no UTMALDG (TMA loads)")
    if info["stack"]:
        problems.append(f"spills ({info['stack']} B stack)")
    if shared > SMEM_PER_BLOCK[cc]:
        problems.append(f"shared {shared} B > {SMEM_PER_BLOCK[cc]} B")
    row["ok"], row["error"] = not problems, "; ".join(problems)
    return row


def compile_rows(jobs, workers=None):
    """compile_row over `jobs` in fresh processes, in parallel; rows in the order of `jobs`."""
    tool_dir()  # fail early and clearly without ptxas
    if not jobs:
        return []
    workers = workers or min(len(jobs), os.cpu_count() or 1, 8)
    # Spawned processes inherit the environment and import the kernel modules, which import
    # triton, so TRITON_INTERPRET must be gone before they start.
    saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated to silence its warning
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            return list(pool.map(compile_row, jobs))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compile_report(archs=tuple(ARCHS), dtypes=DTYPES, kernels=tuple(KERNELS), configs=None, workers=None):
    """One row per (kernel, arch, config, dtype), for the dtypes in `dtypes` each kernel is
    launched with; `configs` replaces every kernel's own configs (meant for one kernel)."""
    tool_dir()
    planned = []  # jobs, and rows of kernels whose configs could not even be read
    for cc in archs:
        for kernel in kernels:
            kernel_dtypes = [d for d in KERNELS[kernel].dtypes if d in dtypes]
            try:
                kernel_configs = configs or configs_for(kernel, cc)
            except Exception as e:  # e.g. a kernel module that does not import
                planned += [_failed_row(kernel, cc, dtype, {}, e) for dtype in kernel_dtypes]
                continue
            planned += [(kernel, cc, dtype, config) for config in kernel_configs for dtype in kernel_dtypes]
    compiled = iter(compile_rows([p for p in planned if isinstance(p, tuple)], workers))
    return [next(compiled) if isinstance(p, tuple) else p for p in planned]


def subprocess_env():
    """This environment without TRITON_INTERPRET, with `tplayers` importable from a checkout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated to silence its warning
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def run_in_subprocess(*args, timeout=900):
    """Run `python -m tplayers.tools.compile_report --json ARGS` without TRITON_INTERPRET; return its rows."""
    tool_dir()
    proc = subprocess.run(
        [sys.executable, "-m", "tplayers.tools.compile_report", "--json", *args],
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

    widths = {col: max([len(col), *(len(cell(r, col)) for r in rows)]) for col in COLUMNS}
    lines = ["  ".join(col.ljust(widths[col]) for col in COLUMNS)]
    lines += ["  ".join(cell(r, col).ljust(widths[col]) for col in COLUMNS) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


CONFIG_SYNTAX = "a config is BM,BN,BK,WARPS,STAGES (a GEMM) or NAME=INT,... e.g. BLOCK_M=16,BLOCK_N=128,num_warps=4"


def _config(text):
    """A GEMM config BM,BN,BK,WARPS,STAGES (GROUP_M=8), or NAME=VALUE,... for any kernel."""
    try:
        if "=" not in text:
            bm, bn, bk, warps, stages = (int(v) for v in text.split(","))
            return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
        return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(CONFIG_SYNTAX) from None


def add_arguments(parser):
    parser.add_argument("--csv", metavar="PATH", help="also write the rows as CSV")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--arch", type=int, choices=sorted(ARCHS), action="append", help="default: all")
    parser.add_argument(
        "--dtype", choices=DTYPES, action="append",
        help="default: all; each kernel only for the dtypes it is launched with (the GEMM: fp16, bf16)",
    )  # fmt: skip
    parser.add_argument("--kernel", choices=list(KERNELS), action="append", help="default: all")
    parser.add_argument(
        "--config", type=_config, action="append", metavar="BM,BN,BK,WARPS,STAGES | NAME=INT,...",
        help="compile these configs instead of the kernels' own (use with one --kernel): a GEMM config "
        "(GROUP_M=8), or the kernel's constexprs and num_warps / num_stages, e.g. BLOCK_M=16,BLOCK_N=128,num_warps=4",
    )  # fmt: skip
    parser.add_argument("--workers", type=int, help="parallel compiles (default: CPU count, at most 8)")
    return parser


def run(args):
    """Run the report for parsed `args`; exit code 1 if any row is not ok."""
    rows = compile_report(
        archs=tuple(args.arch or ARCHS),
        dtypes=tuple(args.dtype or DTYPES),
        kernels=tuple(args.kernel or KERNELS),
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
