"""Benchmark: overlap="auto" against both forced paths over a grid of token counts, from decode
(one token per sequence) to the comm-heavy transformer shape.

The block is bench/linear.py's Column -> GeLU -> Row MLP, forward + backward, at its comm-heavy
hidden / ffn sizes; the batch is fixed and the sequence grows, so M = batch x seq runs from
the batch size (decode) up. Modes "tp" and "tp+sp" (SP from seq = TP size up).

Providers, timed side by side in one run on the same ranks (round robin, slowest rank, median):
    auto        the layers' default: per op and shape, the cost model's path, or where the model
                is unsure (or uncalibrated on this machine) the path it timed on the first calls
    auto-model  auto with measuring off (`set_overlap_measuring(False)`): the cost model alone
    on          overlap=True: the ring everywhere
    off         overlap=False: one plain collective per op
auto's trial calls run before the timing (the steady state is what a training run sees). Per
point: which path auto took for each op and why (from tplayers.functional.overlap_choices:
measured / model / recorded), which forced path was faster, auto / the faster one, and the
model's predicted on / off ratio beside the measured one; the geomean and the worst of auto /
faster per mode. auto measures afresh in every run: the run's own costs file
(<out>/overlap_costs.json: this machine's calibrated constants, if any, without measured choices).

CPU: `python bench/overlap.py [--quick] [--tp 2] [--out bench/out]` starts the ranks itself;
`torchrun --nproc-per-node N bench/overlap.py` on GPUs. Writes <out>/overlap.csv and
<out>/overlap.png (time of the three against M, per mode) and prints a table.
"""

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from linear import (
    Shape,
    figure,
    fwd_bwd,
    launch_or_torchrun,
    paths_taken,
    reference_block,
    save_figure,
    time_once,
    time_round_robin,
    tplayers_block,
    write_outputs,
)

import tplayers
from tplayers.functional import auto_overlap, cost_model, overlap_choices, set_overlap_measuring
from tplayers.functional.overlap import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

BATCH = 4
SEQS = (1, 4, 16, 64, 256, 1024)  # decode ... bench/linear.py's comm-heavy shape (b4 s1024 h2048 f1024)
HIDDEN, FFN = 2048, 1024
QUICK = dict(seqs=(1, 8, 64, 256), hidden=256, ffn=64)  # linear.py's quick comm shape at the top
PROVIDERS = {"auto": "auto", "auto-model": "auto", "on": True, "off": False}
MEASURING = {"auto": True, "auto-model": False}  # measuring on / off per auto provider
MODES = ("tp", "tp+sp")
FIELDS = (
    "op", "provider", "mode", "shape", "tokens", "device", "tp", "threads", "time_ms", "auto_took", "auto_why",
    "model_took", "faster_forced", "ratio_to_faster", "measured_on_off", "predicted_on_off", "reps",
)  # fmt: skip
# The bars auto (measuring) is held to, over the points of a run: auto / the faster forced path.
GEOMEAN_BAR, WORST_BAR = 1.03, 1.10
MAX_REPS = 100


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes, few rounds (smoke test)")
    p.add_argument("--tp", type=int, default=2, help="local ranks (ignored under torchrun)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--reps", type=int, default=None, help="fewest timed rounds per point (default 7, quick 3)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per provider and point: small shapes get more rounds (default 2)")  # fmt: skip
    p.add_argument("--ops", action="store_true", help="also each op alone: the cost model against measurement per op")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = p.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 7)
    args.budget = args.budget if args.budget is not None else (0.2 if args.quick else 2.0)
    args.warmup = 1
    grid = QUICK if args.quick else dict(seqs=SEQS, hidden=HIDDEN, ffn=FFN)
    args.shapes = [Shape(f"s{s}", BATCH, s, grid["hidden"], grid["ffn"]) for s in grid["seqs"]]
    return args


def bench_point(shape, mode, device, dtype, args):
    n, r = dist.get_world_size(), dist.get_rank()
    sp = mode == "tp+sp"
    ref = reference_block(shape, device, dtype)
    x_full = torch.randn(shape.batch, shape.seq, shape.hidden, device=device, dtype=dtype)
    dy_full = torch.randn_like(x_full)
    x, dy = (x_full.chunk(n, dim=1)[r], dy_full.chunk(n, dim=1)[r]) if sp else (x_full, dy_full)
    # One block whose layers switch mode before each call: the three providers share weights,
    # buffers and memory layout, so what differs between them is the path alone (separate blocks
    # differed by up to 8 % on the same path here).
    block = tplayers_block(ref, sp, "auto")
    x, dy = x.detach().clone().contiguous().requires_grad_(), dy.contiguous()

    def run(overlap):
        block[0].overlap = block[2].overlap = overlap
        fwd_bwd(block, x, dy)

    fns = {name: measuring_as(name, lambda o=o: run(o)) for name, o in PROVIDERS.items()}
    tokens = shape.batch * shape.seq
    return time_providers(fns, device, args, op="mlp_fwd_bwd", mode=mode, shape=str(shape), tokens=tokens)


def measuring_as(provider, fn):
    """`fn` run with auto's measuring on or off as `provider` asks (forced providers: as it is)."""
    if provider not in MEASURING:
        return fn

    def run():
        set_overlap_measuring(MEASURING[provider])
        try:
            fn()
        finally:
            set_overlap_measuring(None)

    return run


def time_providers(fns, device, args, **row):
    """Rows of fns {"auto", "auto-model", "on", "off"} timed side by side: what each auto chose
    (from one recorded call after auto's trial), which forced path was faster, auto / faster,
    measured and predicted on / off."""
    fns["auto"]()  # auto's trial calls, until every op's shape is decided (alike on every rank)
    while auto_overlap.trials_in_progress():
        fns["auto"]()
    with overlap_choices() as choices:
        fns["auto"]()
    with overlap_choices() as model_choices:
        fns["auto-model"]()
    # Rounds enough to fill the budget (a small shape's time varies by +-20 % round to round here).
    once = torch.tensor([time_once(fns["off"], device)], dtype=torch.float64)
    dist.all_reduce(once, op=dist.ReduceOp.MAX)
    reps = min(max(args.reps, int(args.budget / once.item())), MAX_REPS)
    times = time_round_robin(fns, device, args.warmup, reps)
    predicted = sum(c.predicted_ring_s for c in choices) / sum(c.predicted_plain_s for c in choices) if choices else 1
    faster = min(("on", "off"), key=times.get)
    why = "/".join(sorted({c.source for c in choices})) or "-"
    common = dict(
        row, auto_took=paths_taken(choices), auto_why=why, model_took=paths_taken(model_choices),
        faster_forced=faster, reps=reps, measured_on_off=times["on"] / times["off"], predicted_on_off=predicted,
    )  # fmt: skip
    # auto_took / auto_why of each auto provider's own row: what that provider took, and why
    own = {"auto-model": dict(auto_took=common["model_took"], auto_why="model")}
    return [
        dict(common, provider=name, time_ms=1e3 * t, ratio_to_faster=t / times[faster], **own.get(name, {}))
        for name, t in times.items()
    ]


def bench_ops(tokens, device, dtype, args):
    """Each op alone (forward) at `tokens` rows, on the block's GEMM shapes: the model per op."""
    n, group = dist.get_world_size(), dist.group.WORLD
    hidden, ffn = args.shapes[0].hidden, args.shapes[0].ffn // n
    m = max(tokens, n) // n * n
    x_shard = torch.randn(1, m // n, hidden, device=device, dtype=dtype)
    w_col, h = torch.randn(ffn, hidden, device=device, dtype=dtype), torch.randn(1, m, ffn, device=device, dtype=dtype)
    w_row = torch.randn(hidden, ffn, device=device, dtype=dtype)
    ops = {
        "all_gather_matmul": lambda overlap: all_gather_matmul(x_shard, w_col, group, overlap=overlap),
        "matmul_reduce_scatter": lambda overlap: matmul_reduce_scatter(h, w_row, group, overlap=overlap),
        "matmul_all_reduce": lambda overlap: matmul_all_reduce(h[0], w_row, group, overlap=overlap),
    }
    rows = []
    for op, call in ops.items():
        fns = {name: measuring_as(name, lambda call=call, o=o: call(o)) for name, o in PROVIDERS.items()}
        k, n_out = (hidden, ffn) if op == "all_gather_matmul" else (ffn, hidden)
        rows += time_providers(fns, device, args, op=op, mode="op", shape=f"m{m}k{k}n{n_out}", tokens=m)
    return rows


def worker(rank, world_size, args):
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tplayers.set_backend("auto" if cuda else "torch")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for mode in MODES:
        for shape in args.shapes:
            if mode == "tp+sp":
                if shape.seq < world_size:
                    continue  # a sequence shorter than the TP size cannot be split along it
                # SP splits the sequence evenly: the nearest length that does (TP 3: 4 -> 6)
                shape = dataclasses.replace(shape, seq=-(-shape.seq // world_size) * world_size)
            rows += bench_point(shape, mode, device, dtype, args)
    if args.ops:
        for shape in args.shapes:
            rows += bench_ops(shape.batch * shape.seq, device, dtype, args)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    for row in rows:
        row.update(device=name, tp=world_size, threads=args.threads)
    return rows


def fresh_costs_file(out: Path) -> Path:
    """This run's costs file: the machine's calibrated constants (if any), no measured choices, so
    auto measures every point afresh; the ranks inherit it through the environment."""
    source = cost_model.costs_file()
    entries = json.loads(source.read_text()) if source.is_file() else {}
    path = out / "overlap_costs.json"
    out.mkdir(parents=True, exist_ok=True)
    kept = {key: value for key, value in entries.items() if not key.startswith("measured/")}
    path.write_text(json.dumps(kept, indent=2) + "\n")
    os.environ[cost_model.COSTS_ENV] = str(path)
    return path


def same_route(rows) -> int:
    """How many of `rows` took the faster forced path's route in every op: there, auto / faster
    differs from 1 only by the run's noise between two timings of one path."""
    route = {"on": "ring", "off": "plain"}
    return sum(r["auto_took"] == route[r["faster_forced"]] for r in rows)


def print_table(rows):
    auto = [r for r in rows if r["provider"] == "auto" and r["mode"] in MODES]
    ops = [r for r in rows if r["provider"] == "auto" and r["mode"] == "op"]
    t = {(r["mode"], r["shape"], r["provider"]): r["time_ms"] for r in rows}
    r0 = rows[0]
    print(f"\nMLP fwd+bwd, overlap auto / auto-model / on / off, tp={r0['tp']}, threads={r0['threads']}, "
          f"device={r0['device']}")  # fmt: skip
    head = (
        f"{'mode':<6} {'shape':<24} {'M':>6} {'auto ms':>9} {'model ms':>9} {'on ms':>9} {'off ms':>9} "
        f"{'auto took':<12} {'why':<9} {'model took':<12} {'faster':<6} {'auto/f':>7} {'model/f':>7} {'on/off':>7} "
        f"{'model':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in auto:
        key = (r["mode"], r["shape"])
        print(
            f"{r['mode']:<6} {r['shape']:<24} {r['tokens']:>6} {t[(*key, 'auto')]:9.2f} {t[(*key, 'auto-model')]:9.2f} "
            f"{t[(*key, 'on')]:9.2f} {t[(*key, 'off')]:9.2f} {r['auto_took']:<12} {r['auto_why']:<9} "
            f"{r['model_took']:<12} {r['faster_forced']:<6} {r['ratio_to_faster']:7.3f} "
            f"{t[(*key, 'auto-model')] / t[(*key, r['faster_forced'])]:7.3f} {r['measured_on_off']:7.3f} "
            f"{r['predicted_on_off']:7.3f}"
        )
    print()
    for mode in MODES:
        for provider in MEASURING:
            mine = [r for r in rows if r["provider"] == provider and r["mode"] == mode]
            if mine:
                ratios = [r["ratio_to_faster"] for r in mine]
                geomean = statistics.geometric_mean(ratios)
                print(f"{mode:<6} {provider:<10} / faster forced path: geomean {geomean:.3f}, worst "
                      f"{max(ratios):.3f} over {len(ratios)} points (bars: {GEOMEAN_BAR}, {WORST_BAR}); "
                      f"{same_route(mine)} of them on the faster path's route")  # fmt: skip
    if ops:
        print("\neach op alone (forward)")
        print(f"{'':<24} {'op':<22} {'M':>6} {'on/off':>7} {'model':>7} {'auto took':<10} {'auto/faster':>11}")
        for r in ops:
            print(f"{'':<24} {r['op']:<22} {r['tokens']:>6} {r['measured_on_off']:7.3f} {r['predicted_on_off']:7.3f} "
                  f"{r['auto_took']:<10} {r['ratio_to_faster']:11.3f}")  # fmt: skip
        agree = sum((r["measured_on_off"] < 1) == (r["auto_took"] == "ring") for r in ops)
        print(f"auto took the measured faster path for {agree} of {len(ops)} (op, M)")


def plot(rows, path):
    fig, axes = figure(1, len(MODES), figsize=(6 * len(MODES), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], MODES, strict=True):
        if not any(r["mode"] == mode for r in rows):
            ax.set_visible(False)  # no point of this mode was run
            continue
        for provider, style in (("on", "s--"), ("off", "o--"), ("auto-model", "+:"), ("auto", "x-")):
            mine = [r for r in rows if r["mode"] == mode and r["provider"] == provider]
            ax.plot([r["tokens"] for r in mine], [r["time_ms"] for r in mine], style, label=f"overlap={provider}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens M = batch x seq")
        ax.set_ylabel("fwd+bwd ms (slowest rank, median)")
        ax.set_title(f"{mode}, tp={rows[0]['tp']}, {rows[0]['device']}")
        ax.legend(fontsize="small")
    save_figure(fig, path)


def main(argv=None):
    args = parse_args(argv)
    fresh_costs_file(args.out)
    rows = launch_or_torchrun(worker, args, args.tp)
    if rows is None:
        return None
    return write_outputs(rows, args.out, "overlap", FIELDS, plot, print_table)


if __name__ == "__main__":
    main()
