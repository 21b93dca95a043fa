"""The `tplayers` command: `demo` (the main job), `plan`, `bench` and `compile-report`."""

import argparse
import os
import sys


def _demo(args) -> int:
    if args.backend == "triton":  # the demo's ranks are CPU processes: Triton's interpreter runs the kernels
        os.environ["TRITON_INTERPRET"] = "1"
    from tplayers.tools.demo import DemoConfig, run_demo, summary, write_report

    cfg = DemoConfig(
        tp=args.tp, dp=args.dp, pp=args.pp, cp=args.cp, zero=args.zero, steps=args.steps, layers=args.layers,
        hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn,
        batch=args.batch, seq=args.seq, sequence_parallel=args.sequence_parallel,
        overlap=OVERLAP_FLAGS[args.overlap], backend=args.backend, seed=args.seed,
        dtype=args.dtype, micro_batches=args.micro_batches, max_grad_norm=args.max_grad_norm,
        save=args.save, save_every=args.save_every, keep=args.keep, resume=args.resume,
    )  # fmt: skip
    report = run_demo(cfg)
    paths = write_report(report, args.out)
    print(summary(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


OVERLAP_FLAGS = {"auto": "auto", "on": True, "off": False}


def tp_size(text: str):
    from tplayers.plan.cli import tp_size as parse

    return parse(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tplayers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a Llama-style model with TP on local CPU ranks, compared with unsharded")
    demo.add_argument(
        "--tp", type=tp_size, default=2, help="tensor-parallel size (local ranks), or RxC: a 2-D grid of them (2x2)"
    )
    demo.add_argument("--dp", type=int, default=1, help="data-parallel replicas (local ranks: dp x tp)")
    demo.add_argument("--pp", type=int, default=1, help="pipeline stages (local ranks: dp x pp x tp)")
    demo.add_argument("--cp", type=int, default=1, help="context-parallel ranks: the sequence split through attention")
    demo.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over the replicas")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--layers", type=int, default=2)
    demo.add_argument("--hidden", type=int, default=64)
    demo.add_argument("--heads", type=int, default=4)
    demo.add_argument("--kv-heads", type=int, default=2)
    demo.add_argument("--ffn", type=int, default=128)
    demo.add_argument("--batch", type=int, default=8)
    demo.add_argument("--seq", type=int, default=64)
    demo.add_argument("--sequence-parallel", action="store_true")
    demo.add_argument(
        "--overlap", choices=list(OVERLAP_FLAGS), default="auto",
        help="ring overlap of the TP collectives: per op and shape (auto), always (on) or never (off)",
    )  # fmt: skip
    demo.add_argument("--no-overlap", dest="overlap", action="store_const", const="off", help="--overlap off")
    demo.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
        help="parameter dtype of the TP model; 16-bit uses fp32 master weights, fp16 also loss scaling",
    )  # fmt: skip
    demo.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps per batch")
    demo.add_argument("--max-grad-norm", type=float, default=1.0, help="global gradient clipping")
    demo.add_argument("--out", default="demo_out", help="folder for loss.csv / loss.png")
    demo.add_argument("--save", help="folder for sharded checkpoints (tplayers.save_checkpoint)")
    demo.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    demo.add_argument("--keep", type=int, default=2, help="checkpoints kept in --save: the last ones")
    demo.add_argument("--resume", help="go on from the last checkpoint --save wrote there, at this (any) layout")
    demo.set_defaults(run=_demo)

    from tplayers.plan import cli as plan_cli
    from tplayers.tools import bench as bench_cli
    from tplayers.tools import compile_report

    bench = sub.add_parser(
        "bench",
        help="run the benchmark scripts in bench/ into one CSV and PNG (--kernels: Triton against torch on a GPU)",
    )
    bench_cli.add_arguments(bench)
    bench.set_defaults(run=bench_cli.run)

    planner = sub.add_parser("plan", help="memory / communication / time estimates for TP x PP x DP x ZeRO layouts")
    plan_cli.add_arguments(planner)
    planner.set_defaults(run=plan_cli.run)

    report = sub.add_parser("compile-report", help="compile every kernel config for sm_80 / sm_90a")
    compile_report.add_arguments(report)
    report.set_defaults(run=compile_report.run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as e:
        print(f"tplayers {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
