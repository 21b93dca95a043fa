"""`tplayers bench`: run the benchmark scripts in `bench/` and merge their results into one CSV
(keyed by op, provider, mode, shape, device, version) and one PNG.

    tplayers bench [--quick] [--only linear --only amp] [--out bench/out] [--bench-dir bench]
    tplayers bench --kernels [--quick] [--no-tests] [--out bench/out]
    tplayers bench --step [--quick] [--out bench/out] [-- <bench/step.py flags: --layers 8 --vocab 32000 ...>]

`--step` runs bench/step.py alone: one HF training step on one GPU, plain HF against Liger
Kernel against `parallelize` at TP 1 on both backends, into `<out>/step/` (a tiny shape on CPU
without a GPU). `--kernels` runs bench/kernels.py alone: on one CUDA GPU the suite's kernel tests there first
(`pytest -m kernel`, compiled), then every Triton kernel against torch's own op (checked, then
timed with triton.testing.do_bench), into `<out>/kernels/` (its CSV, PNG, table and
kernel_tests.txt; no merged bench.csv). Without a GPU it says so and runs the same checks on tiny
shapes in Triton's interpreter.

Each script runs in its own process, as it would by hand (linear.py under torchrun with one rank
per GPU when two or more GPUs are visible, else on local CPU ranks), and writes its own CSV and
PNG into `<out>/<script>/`; this command then writes `<out>/bench.csv` and `<out>/bench.png`.
Every row carries its ratio to the script's baseline (DTensor for the layers, torch's ops for
the AMP pass, PyTorch's DTensor TP + fully_shard recipe for ZeRO, torch's own schedules for
the pipeline): ratios, not absolute times,
compare across noisy machines; TFLOP/s (the layers, and on GPUs the fused GEMM + collective ops
against torch.matmul and torch's symm_mem ops) and GB/s (the AMP pass) where the script
measures them. For the overlapped layers it also says, per shape and mode, whether overlap paid
off in this run (it does not always: a comm-GEMM fusion loses where the GEMM is too small to
hide the transfer).
"""

import csv
import importlib.metadata
import subprocess
import sys
from pathlib import Path

SCRIPTS = ("linear", "overlap", "transformer", "amp", "zero", "pipeline", "checkpoint", "compress", "grid", "moe")
FIELDS = (
    "op", "provider", "mode", "shape", "device", "version", "time_ms", "baseline", "ratio_to_baseline",
    "tflops_per_rank", "gbps", "overlap_pays_off", "auto_took", "auto_vs_faster", "script",
)  # fmt: skip
# Run-to-run noise of one time ratio on a busy machine (measured +-3-5% on 2 CPU cores): an
# overlap on/off ratio within it is reported as "even", not as a win or a loss.
OVERLAP_NOISE = 0.03
# Per script: (column with the ratio, the provider it is relative to, how its rows map to FIELDS)
RATIO_OF = {
    "linear": ("ratio_to_dtensor", "dtensor"),
    "overlap": ("ratio_to_faster", "the faster of overlap on / off"),
    "transformer": ("ratio_to_dtensor", "dtensor"),
    "amp": ("ratio_vs_torch", "torch"),
    "zero": ("ratio_to_torch", "torch recipe (DTensor TP + fully_shard)"),
    "pipeline": ("ratio_to_torch", "torch"),
    "checkpoint": ("ratio_to_single_writer", "single-writer"),
    "compress": ("bytes_ratio", "fp32"),  # dp bytes over the uncompressed reduction's
    "grid": ("time_ratio", "1d tp4"),  # the 2 x 2 grid (and the planner's q x q) over 1-D TP
    "moe": ("time_ratio", "tplayers-ep"),  # experts split over TP, and HF's expert parallelism, over ours
}


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes, few repetitions (a smoke run)")
    parser.add_argument(
        "--kernels", action="store_true", help="only bench/kernels.py: each Triton kernel against torch's op on a GPU"
    )
    parser.add_argument("--no-tests", action="store_true", help="with --kernels on a GPU: skip the kernel tests there")
    parser.add_argument(
        "--step", action="store_true", help="only bench/step.py: an HF training step, plain HF vs Liger vs parallelize"
    )
    parser.add_argument("step_flags", nargs="*", help="with --step, after --: bench/step.py's own flags")
    parser.add_argument("--only", action="append", choices=SCRIPTS, help="run only these scripts (repeatable)")
    parser.add_argument("--reps", type=int, help="timed rounds, passed to every script")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: <bench-dir>/out)")
    parser.add_argument(
        "--bench-dir", type=Path, default=None, help="folder of the scripts (default: the checkout's bench/)"
    )
    calibration = parser.add_argument_group("--calibrate: measure the overlap cost model's constants instead")
    calibration.add_argument("--calibrate", action="store_true", help="write the overlap costs file (no benchmarks)")
    calibration.add_argument("--tp", type=int, default=2, help="local ranks to calibrate on")
    calibration.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    calibration.add_argument("--rounds", type=int, default=3, help="calibration runs (each constant's median)")
    calibration.add_argument("--costs-file", type=Path, default=None, help="default: $TPLAYERS_OVERLAP_COSTS or "
                             "~/.cache/tplayers/overlap_costs.json")  # fmt: skip


def _bench_dir(given, scripts=SCRIPTS) -> Path:
    path = given if given is not None else Path(__file__).resolve().parents[2] / "bench"
    missing = [s for s in scripts if not (path / f"{s}.py").is_file()]
    if missing:
        raise ValueError(f"no benchmark scripts {missing} in {path}: run from a checkout or pass --bench-dir")
    return path


def _versions() -> str:
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    return " ".join(f"{p}={version(p)}" for p in ("tplayers", "torch", "triton"))


def _command(script: Path, args, out: Path) -> list:
    flags = [
        "--out",
        str(out),
        *(["--quick"] if args.quick else []),
        *(["--reps", str(args.reps)] if args.reps else []),
    ]
    if script.stem == "linear":
        import torch

        gpus = torch.cuda.device_count()
        if gpus >= 2:  # NCCL, one rank per GPU: the fused-op and TFLOP/s rows exist only there
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                    str(script), *flags]  # fmt: skip
    return [sys.executable, str(script), *flags]


def _overlap_verdict(on_off) -> str:
    """'yes' / 'no' when overlap on/off is outside run-to-run noise (OVERLAP_NOISE), else 'even'."""
    if on_off in ("", None):
        return ""
    ratio = float(on_off)
    return "yes" if ratio < 1 - OVERLAP_NOISE else "no" if ratio > 1 + OVERLAP_NOISE else "even"


def _auto_vs_faster(name, row) -> str:
    """overlap="auto"'s time over the faster forced path's, on the rows of the auto provider."""
    if name == "overlap":
        return row["ratio_to_faster"] if row["provider"] == "auto" else ""
    return row.get("auto_vs_faster", "")


def _auto_said(row) -> str:
    """'ring (1.004: as fast)': the path auto took, its time over the faster forced path's, and
    whether that is as fast (within OVERLAP_NOISE) or slower."""
    if not row["auto_took"]:
        return ""
    ratio = row["auto_vs_faster"]
    if ratio in ("", None):
        return row["auto_took"]
    verdict = "as fast" if float(ratio) <= 1 + OVERLAP_NOISE else "slower"
    return f"{row['auto_took']} ({float(ratio):.3f}: {verdict})"


def merge(name: str, rows: list, versions: str) -> list:
    """One script's CSV rows in the common schema."""
    ratio_column, baseline = RATIO_OF[name]
    merged = []
    for row in rows:
        on_off = row.get("ratio_overlap_on_off", "")
        merged.append(
            dict(
                op=row.get("kernel") or row.get("op"),
                provider=row["provider"],
                mode=row.get("mode") or row.get("dtype", ""),
                shape=row.get("shape") or row.get("config", ""),
                device=row["device"],
                version=versions,
                time_ms=row["time_ms"],
                baseline=baseline,
                ratio_to_baseline=row.get(ratio_column, ""),
                tflops_per_rank=row.get("tflops_per_rank", ""),
                gbps=row.get("gbps", ""),
                overlap_pays_off=_overlap_verdict(on_off),
                auto_took=row.get("auto_took", ""),
                auto_vs_faster=_auto_vs_faster(name, row),
                script=name,
            )
        )
    return merged


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scripts = list(dict.fromkeys(r["script"] for r in rows))
    fig, axes = plt.subplots(1, len(scripts), figsize=(5.5 * len(scripts), 4.2), squeeze=False)
    for ax, name in zip(axes[0], scripts, strict=True):
        mine = [r for r in rows if r["script"] == name and r["ratio_to_baseline"] not in ("", None)]
        groups = list(dict.fromkeys((r["op"], r["shape"], r["mode"]) for r in mine))
        providers = [p for p in dict.fromkeys(r["provider"] for r in mine) if p != mine[0]["baseline"]]
        width = 0.8 / max(len(providers), 1)
        value = {(r["op"], r["shape"], r["mode"], r["provider"]): float(r["ratio_to_baseline"]) for r in mine}
        for i, provider in enumerate(providers):
            xs = [g + (i - (len(providers) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, [value.get((*g, provider), 0.0) for g in groups], width, label=provider)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(groups)), [f"{s.split(':')[0]}\n{m}" for _, s, m in groups], fontsize="small")
        ax.set_title(f"{name}: time / {mine[0]['baseline'] if mine else '?'}")
        ax.set_ylabel("ratio (lower is better)")
        ax.legend(fontsize="x-small")
    fig.suptitle(f"tplayers bench on {rows[0]['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(rows: list) -> str:
    lines = [
        f"{'script':<12}{'op':<16}{'shape':<36}{'mode':<10}{'provider':<22}{'ratio':>8}  overlap pays off  "
        "auto took (auto / faster forced)"
    ]
    for r in rows:
        if r["provider"] == r["baseline"]:
            continue
        ratio = r["ratio_to_baseline"]
        ratio = f"{float(ratio):8.3f}" if ratio not in ("", None) else f"{'-':>8}"
        lines.append(
            f"{r['script']:<12}{r['op']:<16}{r['shape'][:35]:<36}{r['mode']:<10}{r['provider']:<22}{ratio}  "
            f"{r['overlap_pays_off']:<18}{_auto_said(r)}"
        )
    return "\n".join(lines)


def run_kernels(args) -> int:
    """`--kernels`: bench/kernels.py alone on this machine's CUDA GPU (or in Triton's interpreter
    without one), into <out>/kernels/."""
    if args.only or args.reps or args.calibrate:
        raise ValueError("--kernels runs bench/kernels.py alone, timed by triton.testing.do_bench: "
                         "leave out --only, --reps and --calibrate")  # fmt: skip
    bench_dir = _bench_dir(args.bench_dir, ("kernels",))
    out = (args.out if args.out is not None else bench_dir / "out") / "kernels"
    command = _command(bench_dir / "kernels.py", args, out) + (["--no-tests"] if args.no_tests else [])
    print(f"== kernels: {' '.join(command)}", flush=True)
    return subprocess.run(command, cwd=bench_dir).returncode


def run_step(args) -> int:
    """`--step`: bench/step.py alone, into <out>/step/."""
    if args.only or args.reps or args.calibrate or args.kernels:
        raise ValueError("--step runs bench/step.py alone: leave out --kernels, --only, --reps and --calibrate")
    bench_dir = _bench_dir(args.bench_dir, ("step",))
    out = (args.out if args.out is not None else bench_dir / "out") / "step"
    command = [sys.executable, str(bench_dir / "step.py"), "--out", str(out), *(["--quick"] if args.quick else []),
               *args.step_flags]  # fmt: skip
    print(f"== step: {' '.join(command)}", flush=True)
    return subprocess.run(command, cwd=bench_dir).returncode


def run(args) -> int:
    if args.no_tests and not args.kernels:
        raise ValueError("--no-tests belongs to --kernels (the kernel tests it runs on a GPU first)")
    if args.step_flags and not args.step:
        raise ValueError(f"{args.step_flags} are bench/step.py's flags: they go with --step")
    if args.step:
        return run_step(args)
    if args.kernels:
        return run_kernels(args)
    if args.calibrate:
        from tplayers.tools import calibrate

        return calibrate.run(args)
    bench_dir = _bench_dir(args.bench_dir)
    out = args.out if args.out is not None else bench_dir / "out"
    versions = _versions()
    merged = []
    for name in args.only or SCRIPTS:
        script_out = out / name
        script_out.mkdir(parents=True, exist_ok=True)
        print(f"== {name}: {' '.join(_command(bench_dir / f'{name}.py', args, script_out))}", flush=True)
        done = subprocess.run(_command(bench_dir / f"{name}.py", args, script_out), cwd=bench_dir)
        if done.returncode != 0:
            print(f"tplayers bench: {name}.py failed with exit code {done.returncode}", file=sys.stderr)
            return 1
        with open(script_out / f"{name}.csv", newline="") as f:
            merged += merge(name, list(csv.DictReader(f)), versions)
    with open(out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(merged)
    plot(merged, out / "bench.png")
    print(summary(merged))
    print(f"wrote {out / 'bench.csv'} and {out / 'bench.png'}")
    return 0
