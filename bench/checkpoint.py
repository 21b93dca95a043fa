"""Benchmark: sharded checkpoints against one writer, on local ranks.

A Llama-style HF model at a few sizes, tensor-parallel over p local ranks (p = 2 by default):
    tplayers       `tplayers.save_checkpoint` / `load_checkpoint` of the weights: every rank writes
                   and reads its own shards in parallel (DCP); the load staged (all or nothing)
    tplayers-unstaged  `load_checkpoint(..., staged=False)`: each chunk written as it arrives
    single-writer  the gathered state dict (`tplayers.gather_state_dict`) `torch.save`d by rank 0
                   and fsync'd (the sharded save syncs its files too: a checkpoint that a crash
                   can lose is not one); loaded by rank 0 with `torch.load`, sent to every rank,
                   `load_full_state_dict`
Measured per size and provider: the time of a save and of a load (median over rounds of the
slowest rank), the throughput in GB/s of the model's bytes (total, and per rank), and each
rank's peak of bytes allocated during the call above what it held before (the CPU profiler's
memory events), against its own shards ("peak / shards").

CPU: `python bench/checkpoint.py [--quick] [--ranks 2] [--out bench/out]`. Writes
<out>/checkpoint.csv and <out>/checkpoint.png and prints a table with the ratios.
"""

import argparse
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from linear import figure, save_figure, time_round_robin, write_outputs  # bench/linear.py: shared timing, CSV
from zero import peak_step_bytes  # bench/zero.py: peak bytes allocated during a call

import tplayers

FIELDS = (
    "op", "provider", "mode", "shape", "device", "ranks", "model_mb", "time_ms", "gbps_total", "gbps_per_rank",
    "ratio_to_single_writer", "throughput_ratio", "peak_mb", "shards_mb", "peak_to_shards",
)  # fmt: skip
SIZES = {"h256-l4": (256, 4), "h512-l4": (512, 4), "h1024-l4": (1024, 4)}
QUICK_SIZES = {"h64-l2": (64, 2)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one tiny model, few rounds (smoke test)")
    p.add_argument("--ranks", type=int, default=2, help="local CPU ranks = tensor-parallel size")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default 3, quick 1)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = p.parse_args(argv)
    args.sizes = QUICK_SIZES if args.quick else SIZES
    args.reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    return args


def model_of(hidden, layers):
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=4 * hidden,
                             num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                             max_position_embeddings=128)  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def providers(model, path, rank):
    """{(provider, save / load): the call} for one model."""

    def ours_save():
        tplayers.save_checkpoint(path / "sharded", model=model)

    def ours_load(staged=True):
        tplayers.load_checkpoint(path / "sharded", model=model, staged=staged)

    def single_save():
        full = tplayers.gather_state_dict(model)
        if rank == 0:
            with open(path / "single.pt", "wb") as f:
                torch.save(full, f)
                f.flush()
                os.fsync(f.fileno())  # on disk, as DCP's writer makes its files before the rename
        dist.barrier()

    def single_load():
        box = [torch.load(path / "single.pt", weights_only=True) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        tplayers.load_full_state_dict(model, box[0])

    return {
        ("tplayers", "save"): ours_save,
        ("single-writer", "save"): single_save,
        ("tplayers", "load"): ours_load,
        ("tplayers-unstaged", "load"): lambda: ours_load(staged=False),
        ("single-writer", "load"): single_load,
    }


def worker(rank, world, args, root):
    torch.set_num_threads(1)
    group = dist.group.WORLD
    rows = []
    for name, (hidden, layers) in args.sizes.items():
        model = tplayers.parallelize(model_of(hidden, layers), group=group, verify=False)
        full_bytes = sum(v.numel() * v.element_size() for v in tplayers.gather_state_dict(model).values())
        shards = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        path = Path(root) / name

        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        fns = providers(model, path, rank)
        fns["tplayers", "save"](), fns["single-writer", "save"]()  # warm files and caches; loads need them
        times = time_round_robin(fns, torch.device("cpu"), 0, args.reps)
        for (provider, mode), fn in fns.items():
            peak = torch.tensor([peak_step_bytes(fn)], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the most loaded rank
            t = times[provider, mode]
            rows.append(dict(
                op="checkpoint", provider=provider, mode=mode, shape=name, device="cpu", ranks=world,
                model_mb=full_bytes / 2**20, time_ms=1e3 * t, gbps_total=full_bytes / t / 1e9,
                gbps_per_rank=full_bytes / t / 1e9 / world, peak_mb=peak.item() / 2**20, shards_mb=shards / 2**20,
                peak_to_shards=peak.item() / shards,
            ))  # fmt: skip
    return rows


def add_ratios(rows):
    by = {(r["shape"], r["mode"], r["provider"]): r for r in rows}
    for r in rows:
        base = by[r["shape"], r["mode"], "single-writer"]
        r["ratio_to_single_writer"] = r["time_ms"] / base["time_ms"]
        r["throughput_ratio"] = base["time_ms"] / r["time_ms"]
    return rows


def print_table(rows):
    print(f"\nCheckpoint save / load of the weights, {rows[0]['ranks']} local ranks (TP), cpu")
    head = f"{'model':<10} {'MB':>7} {'mode':<5} {'provider':<17} {'ms':>9} {'GB/s':>7} {'x single':>8} "
    head += f"{'peak/shards':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['shape']:<10} {r['model_mb']:7.1f} {r['mode']:<5} {r['provider']:<17} {r['time_ms']:9.1f} "
            f"{r['gbps_total']:7.3f} {r['throughput_ratio']:8.2f} {r['peak_to_shards']:11.2f}"
        )


def plot(rows, path):
    fig, axes = figure(1, 2, figsize=(10, 4))
    for ax, mode in zip(axes, ("save", "load"), strict=True):
        for provider in ("tplayers", "tplayers-unstaged", "single-writer"):
            mine = [r for r in rows if r["mode"] == mode and r["provider"] == provider]
            if not mine:
                continue
            ax.plot([r["model_mb"] for r in mine], [r["gbps_total"] for r in mine], marker="o", label=provider)
        ax.set(xlabel="model (MB)", ylabel="GB/s (total)", title=f"{mode}, {rows[0]['ranks']} ranks, cpu", xscale="log")
        ax.legend(fontsize="small")
    save_figure(fig, path)


def main(argv=None):
    args = parse_args(argv)
    root = tempfile.mkdtemp(prefix="tplayers-bench-checkpoint-")
    try:
        rows = add_ratios(tplayers.launch(worker, args.ranks, args, root)[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return write_outputs(rows, args.out, "checkpoint", FIELDS, plot, print_table)


if __name__ == "__main__":
    main()
