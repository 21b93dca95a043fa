"""Benchmark: 2-D tensor parallelism (a tp_r x tp_c grid, `tplayers.nn.GridLinear`) against 1-D
on the same ranks and the same MLP block (SwiGLU `ParallelMLP`, forward + backward), side by
side in one run: bytes each rank sends (`tplayers.count_bytes`, equal to the planner's
`grid_mlp_bytes` / `line_mlp_bytes`) and time (round robin, slowest rank, median); then the
planner's table of the bytes per rank of a Llama-7B MLP on q x q grids against 1-D TP of the
same size, 4 to 256 GPUs per tensor-parallel group, and the time on an H100 cluster with the
grid's tp_c axis inside a node (NVLink) and tp_r across nodes, against 1-D spanning nodes;
last, for whole models, the planner's search at 16-512 H100s: the fastest layout with a grid
against the fastest 1-D one (TP x PP x DP x ZeRO, every micro-batching the search tries), which
says where a grid wins.

gloo's wall-clock times on a CPU say nothing about GPU links: compare the ratios of one run, and
read the planner's table for clusters.

CPU: `python bench/grid.py [--quick] [--out bench/out]` (or `tplayers bench --only grid`)
starts 4 ranks itself. Writes <out>/grid.csv and <out>/grid.png and prints both tables.
"""

import argparse
import math
from pathlib import Path

import torch
from linear import figure, save_figure, time_round_robin, write_outputs

import tplayers
from tplayers.functional.collectives import own_slice
from tplayers.plan import ClusterSpec, ModelSpec, search
from tplayers.plan.comm import line_mlp_bytes
from tplayers.plan.grid import grid_mlp_bytes

RANKS = 4
SHAPE = dict(tokens=1024, hidden=512, ffn=1408)
QUICK = dict(tokens=64, hidden=64, ffn=176)
LLAMA_7B = dict(tokens=4096, hidden=4096, ffn=11008)  # one sequence of 4096 tokens
FIELDS = ("op", "provider", "shape", "device", "tp", "grid", "gpus", "bytes", "bytes_ratio", "time_ms",
          "time_ratio", "source", "layout")  # fmt: skip
# (model preset, seq_len override or None): whole models for the planner's search
SEARCHED = (("llama3-8b", None), ("llama3-70b", 1024), ("llama3-70b", None), ("llama3-405b", None))
SEARCHED_GPUS = (16, 64, 256, 512)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    return p.parse_args(argv)


def measure(rank, world, shape, reps):
    """{provider: (bytes this rank sent per step, median seconds)} for 1-D TP 4 and the 2 x 2 grid,
    without and with the sequence split over tp_r (the same bytes: reduce-scatter + all-gather in
    place of each all-reduce)."""
    tokens, hidden, ffn = shape["tokens"], shape["hidden"], shape["ffn"]
    torch.manual_seed(0)
    full = [torch.nn.Linear(hidden, ffn, bias=False), torch.nn.Linear(hidden, ffn, bias=False),
            torch.nn.Linear(ffn, hidden, bias=False)]  # fmt: skip
    x = torch.randn(1, tokens, hidden)
    line = tplayers.nn.ParallelMLP.from_modules(*full, group=tplayers.init_mesh(tp=RANKS)["tp"])
    mesh = tplayers.init_mesh(tp=(2, 2))["tp_r", "tp_c"]
    grid = tplayers.nn.ParallelMLP.from_modules(*full, group=mesh)
    grid_sp = tplayers.nn.ParallelMLP.from_modules(*full, group=mesh, sequence_parallel=True)
    col = own_slice(x, -1, mesh.get_group("tp_c"))
    inputs = {"1d tp4": x.clone().requires_grad_(), "grid 2x2": col.clone().requires_grad_(),
              "grid 2x2 sp": own_slice(col, 1, mesh.get_group("tp_r")).clone().requires_grad_()}  # fmt: skip
    models = {"1d tp4": line, "grid 2x2": grid, "grid 2x2 sp": grid_sp}

    def step(name):
        return lambda: models[name](inputs[name]).sum().backward()

    sent = {}
    for name in models:
        with tplayers.count_bytes() as counted:
            step(name)()
        sent[name] = counted.total()
    times = time_round_robin({name: step(name) for name in models}, torch.device("cpu"), 2, reps)
    return {name: (sent[name], times[name]) for name in models}


def planner_rows(shape, bytes_per=2):
    """Bytes per rank of one MLP and its time on H100 links: q x q grids against 1-D TP."""
    cluster = ClusterSpec.preset("h100", num_gpus=512)
    rows = []
    for q in (2, 4, 8, 16):
        gpus = q * q
        grid = grid_mlp_bytes(shape["tokens"], shape["hidden"], shape["ffn"], q, q, bytes_per)
        line = line_mlp_bytes(shape["tokens"], shape["hidden"], gpus, bytes_per)
        # the grid: tp_c inside a node where it fits, tp_r across; 1-D: inside a node up to 8 GPUs
        inter, intra = cluster.inter_node_bandwidth, cluster.intra_node_bandwidth
        c_bw = intra if q <= cluster.gpus_per_node else inter
        r_bw = intra if gpus <= cluster.gpus_per_node else inter
        grid_s = grid["tp_c"] / c_bw + grid["tp_r"] / r_bw
        line_s = line / (intra if gpus <= cluster.gpus_per_node else inter)
        common = dict(op="mlp_fwd_bwd", shape="llama-7b mlp, 4096 tokens", device="h100 (planner)", gpus=gpus,
                      source="planner")  # fmt: skip
        rows.append(dict(common, provider="1d", tp=gpus, grid="", bytes=line, bytes_ratio=1.0, time_ms=1e3 * line_s,
                         time_ratio=1.0))  # fmt: skip
        rows.append(dict(common, provider="grid", tp=gpus, grid=f"{q}x{q}", bytes=sum(grid.values()),
                         bytes_ratio=sum(grid.values()) / line, time_ms=1e3 * grid_s,
                         time_ratio=grid_s / line_s))  # fmt: skip
    return rows


def search_rows(models, gpu_counts):
    """The planner's fastest grid layout against its fastest 1-D layout, global batch = GPUs."""
    rows = []
    for name, seq_len in models:
        model = ModelSpec.preset(name, **({"seq_len": seq_len} if seq_len else {}))
        for gpus in gpu_counts:
            ranked = search(model, ClusterSpec.preset("h100-80gb", num_gpus=gpus), gpus, "bf16-adam",
                            micro_batches=(1, 2, 4))  # fmt: skip
            line = next((est for layout, est in ranked if not layout.tp_grid), None)
            grid = next((est for layout, est in ranked if layout.tp_grid), None)
            if line is None or grid is None:
                continue
            common = dict(op="train_step", shape=f"{name} s{model.seq_len}", device="h100-80gb (planner)", gpus=gpus,
                          source="planner search", bytes=float("nan"), bytes_ratio=float("nan"))  # fmt: skip
            for provider, est in (("best 1d", line), ("best grid", grid)):
                rows.append(dict(common, provider=provider, tp=est.layout.tp, layout=est.layout.describe(),
                                 grid="{}x{}".format(*est.layout.tp_grid) if est.layout.tp_grid else "",
                                 time_ms=1e3 * est.step_time_s,
                                 time_ratio=est.step_time_s / line.step_time_s))  # fmt: skip
    return rows


def run(args):
    shape = QUICK if args.quick else SHAPE
    measured = tplayers.launch(measure, RANKS, shape, args.reps)[0]
    grid_bytes = sum(grid_mlp_bytes(shape["tokens"], shape["hidden"], shape["ffn"], 2, 2, 4).values())
    planned = {"1d tp4": line_mlp_bytes(shape["tokens"], shape["hidden"], RANKS, 4), "grid 2x2": grid_bytes,
               "grid 2x2 sp": grid_bytes}  # fmt: skip
    base_bytes, base_time = measured["1d tp4"]
    rows = []
    for name, (sent, seconds) in measured.items():
        if not math.isclose(sent, planned[name]):
            raise AssertionError(f"{name}: measured {sent} bytes, the planner says {planned[name]}")
        rows.append(dict(op="mlp_fwd_bwd", provider=name, shape="t{tokens} h{hidden} f{ffn}".format(**shape),
                         device="cpu (gloo)", tp=RANKS, grid="2x2" if "grid" in name else "", gpus=RANKS, bytes=sent,
                         bytes_ratio=sent / base_bytes, time_ms=1e3 * seconds, time_ratio=seconds / base_time,
                         source="measured"))  # fmt: skip
    searched = search_rows(SEARCHED[:1], SEARCHED_GPUS[:1]) if args.quick else search_rows(SEARCHED, SEARCHED_GPUS)
    return rows + planner_rows(LLAMA_7B) + searched


def plot(rows, path):
    fig, (left, right, third) = figure(1, 3, figsize=(16, 4))
    measured = [r for r in rows if r["source"] == "measured"]
    left.bar([r["provider"] for r in measured], [r["bytes_ratio"] for r in measured], label="bytes")
    left.plot([r["provider"] for r in measured], [r["time_ratio"] for r in measured], "ko", label="time (gloo)")
    left.set(ylabel="over 1-D TP 4", title="MLP fwd+bwd on 4 CPU ranks")
    left.legend()
    grid = [r for r in rows if r["source"] == "planner" and r["provider"] == "grid"]
    right.plot([r["gpus"] for r in grid], [r["bytes_ratio"] for r in grid], "o-", label="bytes")
    right.plot([r["gpus"] for r in grid], [r["time_ratio"] for r in grid], "s--", label="time (H100 links)")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(xscale="log", xlabel="GPUs in the tensor-parallel group (q x q)", ylabel="grid / 1-D",
              title="planner: Llama-7B MLP, 4096 tokens")  # fmt: skip
    right.legend()
    searched = [r for r in rows if r["source"] == "planner search" and r["provider"] == "best grid"]
    for shape in dict.fromkeys(r["shape"] for r in searched):
        mine = [r for r in searched if r["shape"] == shape]
        third.plot([r["gpus"] for r in mine], [r["time_ratio"] for r in mine], "o-", label=shape)
    third.axhline(1.0, color="grey", lw=0.8)
    gpus = sorted({r["gpus"] for r in searched})
    third.set_xscale("log")
    third.set_xticks(gpus, [str(g) for g in gpus])
    third.minorticks_off()
    third.set(xlabel="GPUs", ylabel="step time, best grid / best 1-D",
              title="planner search, H100 80GB, batch = GPUs")  # fmt: skip
    third.legend()
    save_figure(fig, path)


def print_table(rows):
    print(f"{'source':>9} {'provider':>11} {'gpus':>5} {'grid':>5} {'bytes':>13} {'ratio':>6} {'ms':>9} {'ratio':>6}")
    searched = [r for r in rows if r["source"] == "planner search"]
    for r in rows:
        if r in searched:
            continue
        print(f"{r['source']:>9} {r['provider']:>11} {r['gpus']:>5} {r['grid']:>5} {r['bytes']:>13.0f} "
              f"{r['bytes_ratio']:>6.3f} {r['time_ms']:>9.3f} {r['time_ratio']:>6.3f}")  # fmt: skip
    print(f"\n{'model':<18} {'gpus':>5} {'provider':>10} {'step s':>9} {'/1-D':>6}  layout")
    for r in searched:
        print(f"{r['shape']:<18} {r['gpus']:>5} {r['provider']:>10} {r['time_ms'] / 1e3:>9.3f} "
              f"{r['time_ratio']:>6.3f}  {r['layout']}")  # fmt: skip


def main(argv=None):
    args = parse_args(argv)
    return write_outputs(run(args), args.out, "grid", FIELDS, plot, print_table)


if __name__ == "__main__":
    main()
