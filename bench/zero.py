"""Benchmark: one training step (forward, backward, AdamW) of a tiny HF Llama on a (dp, tp) mesh
of local ranks, TP 2 x DP 2 by default: tplayers' TP with its ZeRO stages against PyTorch's
own recipe.

Providers, timed side by side in one run on the same ranks:
    tplayers-zero0/2/3   `tplayers.parallelize` over "tp", then `tplayers.data_parallel` over "dp"
                         at that stage (0: composable DDP; 2, 3: FSDP2 underneath)
    torch-zero2/3        PyTorch's recipe (torchtitan's): DTensor `parallelize_module` TP with the
                         Llama plan of bench/transformer.py, then `fully_shard` per block and the
                         root over "dp" (2: reshard_after_forward=False)
Per provider: the step time (median over rounds of the slowest rank), the model-state bytes each
rank holds (parameters, gradients, optimizer state, measured on the tensors) and the peak of
the bytes allocated during a step above that (the CPU profiler's memory events), and their
ratios to the torch recipe at the same stage ("ratio_to_torch"; ZeRO-0 is compared with torch's
ZeRO-2).

CPU: `python bench/zero.py [--quick] [--dp 2] [--tp 2] [--out bench/out]` starts the ranks itself.
Writes <out>/zero.csv and <out>/zero.png and prints a table.
"""

import argparse
import copy
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from linear import figure, save_figure, time_round_robin, write_outputs  # bench/linear.py: shared timing, CSV
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformer import QUICK_SHAPES, SHAPES, dtensor_model, finish_grad, reference_model

import tplayers

PROVIDERS = ("tplayers-zero0", "tplayers-zero2", "tplayers-zero3", "torch-zero2", "torch-zero3")
FIELDS = (
    "op", "provider", "mode", "shape", "device", "dp", "tp", "time_ms", "ratio_to_torch", "state_bytes",
    "peak_step_bytes", "state_ratio_to_torch", "peak_ratio_to_torch",
)  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few iterations (smoke test)")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default 6, quick 2)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = p.parse_args(argv)
    args.shapes = QUICK_SHAPES if args.quick else SHAPES
    args.reps = args.reps if args.reps is not None else (2 if args.quick else 6)
    return args


def build(provider, ref, mesh):
    stage = int(provider[-1])
    if provider.startswith("tplayers"):
        model = tplayers.parallelize(copy.deepcopy(ref), group=mesh["tp"], verify=False)
        tplayers.data_parallel(model, group=mesh["dp"], zero_stage=stage)
    else:
        model = dtensor_model(ref, mesh["tp"], sp=False)
        for block in model.model.layers:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=stage == 3)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=stage == 3)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model, opt, ids):
    model(input_ids=ids, labels=ids).loss.backward()
    for p in model.parameters():
        finish_grad(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(model, opt):
    """Parameters + one gradient per parameter + optimizer state, as this rank holds them."""
    size = lambda t: _local(t).numel() * _local(t).element_size()  # noqa: E731
    params = sum(size(p) for p in model.parameters())
    state = sum(size(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    return 2 * params + state


def peak_step_bytes(fn):
    """The peak, over one call of fn, of the bytes allocated since it started (CPU profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    # each op's own allocations (self_cpu_memory_usage > 0) and frees ("[memory]" events, < 0), in time order
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def worker(rank, world_size, args):
    torch.set_num_threads(args.threads)
    tplayers.set_backend("torch")
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    rows = []
    for shape in args.shapes:
        ref = reference_model(shape)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, shape.vocab, (args.dp * shape.batch, shape.seq), generator=gen)
        mine = ids.chunk(args.dp)[mesh["dp"].get_local_rank()]
        built = {name: build(name, ref, mesh) for name in PROVIDERS}
        fns = {name: (lambda m=m, o=o, x=mine: train_step(m, o, x)) for name, (m, o) in built.items()}
        times = time_round_robin(fns, torch.device("cpu"), 1, args.reps)
        for name in PROVIDERS:
            measured = torch.tensor([state_bytes(*built[name]), peak_step_bytes(fns[name])], dtype=torch.float64)
            dist.all_reduce(measured, op=dist.ReduceOp.MAX)  # the most loaded rank
            rows.append(
                dict(
                    op="llama_train_step",
                    provider=name,
                    mode=f"zero{name[-1]}",
                    shape=str(shape),
                    device="cpu",
                    dp=args.dp,
                    tp=args.tp,
                    time_ms=1e3 * times[name],
                    state_bytes=int(measured[0]),
                    peak_step_bytes=int(measured[1]),
                )  # fmt: skip
            )
    return rows


def add_ratios(rows):
    by = {(r["shape"], r["provider"]): r for r in rows}
    for r in rows:
        stage = max(int(r["provider"][-1]), 2)
        torch_row = by[r["shape"], f"torch-zero{stage}"]
        r["ratio_to_torch"] = r["time_ms"] / torch_row["time_ms"]
        r["state_ratio_to_torch"] = r["state_bytes"] / torch_row["state_bytes"]
        r["peak_ratio_to_torch"] = r["peak_step_bytes"] / max(torch_row["peak_step_bytes"], 1)
    return rows


def print_table(rows):
    print(f"\nLlama train step (fwd+bwd+AdamW), dp={rows[0]['dp']} x tp={rows[0]['tp']}, cpu")
    head = f"{'provider':<16} {'ms':>9} {'/torch':>7} {'state KB':>9} {'/torch':>7} {'peak KB':>9} {'/torch':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['provider']:<16} {r['time_ms']:9.1f} {r['ratio_to_torch']:7.3f} {r['state_bytes'] / 1024:9.1f} "
            f"{r['state_ratio_to_torch']:7.3f} {r['peak_step_bytes'] / 1024:9.1f} {r['peak_ratio_to_torch']:7.3f}"
        )


def plot(rows, path):
    names = [r["provider"] for r in rows]
    series = {
        "time / torch": [r["ratio_to_torch"] for r in rows],
        "model state / torch": [r["state_ratio_to_torch"] for r in rows],
        "step peak / torch": [r["peak_ratio_to_torch"] for r in rows],
    }
    width = 0.8 / len(series)
    fig, ax = figure(figsize=(9, 4))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([g + (i - 1) * width for g in range(len(names))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(names)), names, fontsize="small")
    ax.set_ylabel("ratio to torch's recipe at the same stage (lower is better)")
    ax.set_title(f"HF Llama train step, dp={rows[0]['dp']} x tp={rows[0]['tp']}, cpu")
    ax.legend(fontsize="small")
    save_figure(fig, path)


def main(argv=None):
    args = parse_args(argv)
    rows = add_ratios(tplayers.launch(worker, args.dp * args.tp, args)[0])
    return write_outputs(rows, args.out, "zero", FIELDS, plot, print_table)


if __name__ == "__main__":
    main()
