"""Benchmark: pipeline schedules on local ranks, tplayers' against torch's own driving the same
kind of stages, and the measured bubble against the formula.

Per schedule (GPipe, 1F1B) and micro-batch count m, on p local ranks (p = 2 by default, one
thread each), an MLP stack split into p stages, each micro-batch `rows` rows (the batch grows with m, as a
pipeline's global batch does):
    tplayers   `tplayers.PipelineStage` + `tplayers.ScheduleGPipe` / `Schedule1F1B`
    torch      torch.distributed.pipelining's PipelineStage + schedule, the loss divided by m and
               scale_grads=False, so both compute the same gradients
Measured: the step time (median over rounds of the slowest rank), and the bubble as the idle
share of tplayers' step, 1 - compute / step time, compute being the time inside the stage's own
forward and backward calls during the step (`tplayers.pipeline.trace`), averaged over the ranks;
against `tplayers.plan.bubble_fraction` as a share of the step, (p - 1) / (m + p - 1). The
formula prices the sends at zero: the model is wide enough that they are small beside a
micro-batch's compute.

CPU: `python bench/pipeline.py [--quick] [--pp 2] [--out bench/out]`. Writes
<out>/pipeline.csv and <out>/pipeline.png (bubble vs micro-batches, one line per schedule) and
prints a table with the ratios.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from linear import figure, save_figure, time_round_robin, write_outputs  # bench/linear.py: shared timing, CSV
from torch import nn

import tplayers
from tplayers.pipeline import trace
from tplayers.plan import bubble_fraction

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
FIELDS = (
    "op", "provider", "mode", "shape", "device", "pp", "microbatches", "time_ms", "ratio_to_torch",
    "bubble_measured", "bubble_formula", "bubble_ratio",
)  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, few rounds (smoke test)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages = local CPU ranks")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default 6, quick 2)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = p.parse_args(argv)
    args.width, args.layers, args.rows = (64, 4, 8) if args.quick else (512, 8, 512)  # rows per micro-batch
    args.microbatches = (2, 4) if args.quick else (2, 4, 8, 16)
    args.reps = args.reps if args.reps is not None else (2 if args.quick else 6)
    return args


def stack(args):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh()) for _ in range(args.layers)])


def mse(out, target):
    return (out - target).square().mean()


def stage_module(args, rank, pp):
    per = args.layers // pp
    return stack(args)[rank * per : (rank + 1) * per]


def measured_bubble(schedule, args_, kwargs, reps):
    """Idle share of `reps` traced steps, averaged over the ranks."""
    with trace(schedule) as t:
        for _ in range(reps):
            schedule.step(*args_, **kwargs)
    idle = torch.tensor([t.bubble], dtype=torch.float64)
    dist.all_reduce(idle)
    return idle.item() / dist.get_world_size()


def worker(rank, pp, args):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    torch.set_num_threads(1)
    tplayers.set_backend("torch")
    group = dist.group.WORLD
    rows, shape = [], f"mlp:w{args.width}L{args.layers}mb{args.rows}"
    for m in args.microbatches:
        gen = torch.Generator().manual_seed(m)
        x, y = (torch.randn(m * args.rows, args.width, generator=gen) for _ in range(2))
        fns, schedules = {}, {}
        for name, cls in SCHEDULES.items():
            ours = tplayers.PipelineStage(stage_module(args, rank, pp), rank, pp, group=group)
            schedules["tplayers", name] = getattr(tplayers, cls)(ours, m, mse)
            theirs = PipelineStage(stage_module(args, rank, pp), rank, pp, torch.device("cpu"), group=group)
            schedules["torch", name] = getattr(torch_schedules, cls)(
                theirs, m, loss_fn=lambda o, t, m=m: mse(o, t) / m, scale_grads=False
            )
        args_ = (x,) if rank == 0 else ()
        kwargs = {"target": y} if rank == pp - 1 else {}
        for key, schedule in schedules.items():
            fns[key] = lambda s=schedule, a=args_, k=kwargs: s.step(*a, **k)
        times = time_round_robin(fns, torch.device("cpu"), 1, args.reps)
        bubbles = {name: measured_bubble(schedules["tplayers", name], args_, kwargs, args.reps) for name in SCHEDULES}
        for (provider, name), t in times.items():
            formula = bubble_fraction(pp, m, name)
            rows.append(
                dict(
                    op="pipeline_step",
                    provider=provider,
                    mode=name,
                    shape=shape,
                    device="cpu",
                    pp=pp,
                    microbatches=m,
                    time_ms=1e3 * t,
                    bubble_measured=bubbles[name] if provider == "tplayers" else float("nan"),
                    bubble_formula=formula / (1 + formula),
                )  # fmt: skip
            )
    return rows


def add_ratios(rows):
    by = {(r["mode"], r["microbatches"], r["provider"]): r for r in rows}
    for r in rows:
        r["ratio_to_torch"] = r["time_ms"] / by[r["mode"], r["microbatches"], "torch"]["time_ms"]
        r["bubble_ratio"] = r["bubble_measured"] / r["bubble_formula"]
    return rows


def print_table(rows):
    print(f"\nPipeline step (fwd+bwd), pp={rows[0]['pp']}, cpu, {rows[0]['shape']}")
    head = f"{'schedule':<8} {'m':>3} {'provider':<9} {'ms':>9} {'/torch':>7} {'bubble':>7} {'formula':>8} {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['mode']:<8} {r['microbatches']:>3} {r['provider']:<9} {r['time_ms']:9.1f} {r['ratio_to_torch']:7.3f} "
            f"{r['bubble_measured']:7.3f} {r['bubble_formula']:8.3f} {r['bubble_ratio']:6.2f}"
        )


def plot(rows, path):
    fig, ax = figure(figsize=(6, 4))
    for name in SCHEDULES:
        mine = [r for r in rows if r["mode"] == name and r["provider"] == "tplayers"]
        ms = [r["microbatches"] for r in mine]
        ax.plot(ms, [r["bubble_measured"] for r in mine], marker="o", label=f"{name} measured (tplayers)")
    first = [r for r in rows if r["mode"] == "gpipe" and r["provider"] == "tplayers"]
    ax.plot([r["microbatches"] for r in first], [r["bubble_formula"] for r in first], "k--", label="(p-1)/(m+p-1)")
    ax.set(xlabel="micro-batches", ylabel="bubble (idle share of the step)", title=f"pp={rows[0]['pp']}, cpu")
    ax.legend(fontsize="small")
    save_figure(fig, path)


def main(argv=None):
    args = parse_args(argv)
    rows = add_ratios(tplayers.launch(worker, args.pp, args)[0])
    return write_outputs(rows, args.out, "pipeline", FIELDS, plot, print_table)


if __name__ == "__main__":
    main()
