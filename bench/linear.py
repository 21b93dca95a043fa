"""Benchmark: forward + backward of a Column -> GeLU -> Row MLP block, tplayers vs DTensor TP.

Providers, timed side by side in one run on the same ranks:
    tplayers             ColumnParallelLinear / RowParallelLinear.from_linear, their default
                         overlap="auto" (per op and shape, the path the cost model expects faster)
    tplayers-overlap     the same layers with overlap=True (the ring everywhere)
    tplayers-no-overlap  the same layers with overlap=False (one plain collective per op)
    dtensor              PyTorch's parallelize_module with ColwiseParallel / RowwiseParallel
    unsharded            the nn.Linear block on one rank (for scaling efficiency)
Modes: "tp" (input (B, S, H) replicated) and "tp+sp" (input (B, S/n, H) sharded along the
sequence; DTensor gets Shard(1) input / output layouts).

CPU (default): `python bench/linear.py [--quick] [--tp 2] [--threads 1] [--out bench/out]`
starts the ranks itself (tplayers.launch, gloo). GPU: `torchrun --nproc-per-node N
bench/linear.py` (NCCL, one GPU per rank); it also times the forward all_gather_matmul /
matmul_reduce_scatter against torch.matmul and torch's symm_mem fused ops, in TFLOP/s.

Writes <out>/linear.csv and <out>/linear.png and prints a table of ratios. Ratios below 1
favour tplayers; scaling efficiency = unsharded time / tp / TP time.
"""

import argparse
import copy
import csv
import os
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import tplayers
from tplayers.functional import overlap_choices
from tplayers.functional.overlap import all_gather_matmul, matmul_reduce_scatter
from tplayers.testing import tolerance


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    seq: int
    hidden: int
    ffn: int

    def __str__(self):
        return f"{self.name}:b{self.batch}s{self.seq}h{self.hidden}f{self.ffn}"

    @property
    def flops(self):
        """fwd + bwd of both GEMMs: 3 passes (y, dx, dW) of 2 * tokens * hidden * ffn each."""
        return 2 * 3 * 2 * self.batch * self.seq * self.hidden * self.ffn


SHAPES = [Shape("compute", 4, 512, 512, 2048), Shape("comm", 4, 1024, 2048, 1024)]
QUICK_SHAPES = [Shape("compute", 2, 64, 64, 256), Shape("comm", 2, 128, 256, 64)]
MODES = ("tp", "tp+sp")
PROVIDERS = ("tplayers", "tplayers-overlap", "tplayers-no-overlap", "dtensor", "unsharded")
FORCED = {"tplayers-overlap": True, "tplayers-no-overlap": False}
FIELDS = (
    "kernel", "provider", "mode", "shape", "device", "threads", "tp", "time_ms", "ratio_to_dtensor",
    "ratio_overlap_on_off", "auto_took", "auto_vs_faster", "scaling_efficiency", "bytes_per_rank", "tflops_per_rank",
)  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes, few iterations (smoke test)")
    p.add_argument("--tp", type=int, default=2, help="TP size = local ranks (ignored under torchrun)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 3, quick 1)")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default 10, quick 3)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default float32 on CPU, bfloat16 on GPU")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = p.parse_args(argv)
    args.shapes = QUICK_SHAPES if args.quick else SHAPES
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.reps = args.reps if args.reps is not None else (3 if args.quick else 10)
    return args


# ---- blocks -------------------------------------------------------------------------------


def reference_block(shape, device, dtype):
    """The unsharded block; seeded, so every rank builds the same weights."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(shape.hidden, shape.ffn), nn.GELU(), nn.Linear(shape.ffn, shape.hidden))
    return block.to(device=device, dtype=dtype)


def tplayers_block(ref, sp, overlap):
    return nn.Sequential(
        tplayers.ColumnParallelLinear.from_linear(ref[0], sequence_parallel=sp, overlap=overlap),
        nn.GELU(),
        tplayers.RowParallelLinear.from_linear(ref[2], sequence_parallel=sp, overlap=overlap),
    )


def dtensor_block(ref, mesh, sp):
    # Megatron-style SP: activations outside the block are sharded along the sequence (dim 1).
    layout = Shard(1) if sp else None
    plan = {"0": ColwiseParallel(input_layouts=layout), "2": RowwiseParallel(output_layouts=layout)}
    return parallelize_module(copy.deepcopy(ref), mesh, plan)


def fwd_bwd(block, x, dy):
    x.grad = None
    for p in block.parameters():
        p.grad = None  # a fresh gradient each step, not an accumulating add
    y = block(x)
    y.backward(dy)
    # DTensor returns outputs and gradients whose collectives may still be in flight
    # (AsyncCollectiveTensor); the next layer or the optimizer would wait for them, so we do too.
    for t in (y, x.grad, *(p.grad for p in block.parameters())):
        wait(t)


def wait(t):
    if isinstance(t, DTensor):
        t = t.to_local()
    if isinstance(t, AsyncCollectiveTensor):
        t.wait()


# ---- timing -------------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn, device):
    """Seconds this rank spends in fn, starting together with the other ranks (fn=None: idle)."""
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    if fn is not None:
        fn()
        sync(device)
    return time.perf_counter() - start


def time_round_robin(fns, device, warmup, reps):
    """{name: median over reps of the max over ranks} for fns {name: callable or None}.

    One call of each provider per round, the order rotated every round, so drift and noise on
    the machine fall on all providers alike.
    """
    names = list(fns)
    times = {name: [] for name in names}
    for rnd in range(warmup + reps):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            t = time_once(fns[name], device)
            if rnd >= warmup:
                times[name].append(t)
    result = {}
    for name in names:
        # The step ends when its slowest rank does: max over ranks per repetition, then the median.
        per_rep = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(per_rep, op=dist.ReduceOp.MAX)
        result[name] = statistics.median(per_rep.tolist())
    return result


# ---- the MLP block benchmark ----------------------------------------------------------------


def bench_mlp(shape, mode, mesh, device, dtype, args):
    """Rows for one (shape, mode): every provider's fwd+bwd time, bytes sent by tplayers."""
    n, r = dist.get_world_size(), dist.get_rank()
    sp = mode == "tp+sp"
    if shape.ffn % n or (sp and shape.seq % n):
        raise ValueError(f"{shape}: ffn and (with SP) seq must be divisible by the TP size {n}")
    ref = reference_block(shape, device, dtype)
    x_full = torch.randn(shape.batch, shape.seq, shape.hidden, device=device, dtype=dtype)
    dy_full = torch.randn_like(x_full)
    x_tp, dy_tp = (x_full.chunk(n, dim=1)[r], dy_full.chunk(n, dim=1)[r]) if sp else (x_full, dy_full)
    dy_tp = dy_tp.contiguous()  # as a gradient arriving from the next layer would be
    blocks = {
        "tplayers": tplayers_block(ref, sp, overlap="auto"),
        **{name: tplayers_block(ref, sp, overlap=forced) for name, forced in FORCED.items()},
        "dtensor": dtensor_block(ref, mesh, sp),
    }
    # Each provider gets its own input leaf, so gradients never mix.
    inputs = {name: x_tp.detach().clone().contiguous().requires_grad_() for name in blocks}
    x_ref = x_full.detach().clone().requires_grad_()

    # Compare like with like: every TP block must compute the unsharded block's output.
    with torch.no_grad():
        expected = ref(x_full)
        expected = expected.chunk(n, dim=1)[r] if sp else expected
        # Looser than the tests' table in fp32: this only guards against timing the wrong thing.
        tol = max(tolerance(dtype)["rtol"], 1e-4)
        for name, block in blocks.items():
            torch.testing.assert_close(block(inputs[name]), expected, rtol=tol, atol=tol, msg=name)

    fns = {name: (lambda b=block, x=inputs[name]: fwd_bwd(b, x, dy_tp)) for name, block in blocks.items()}
    # The unsharded block runs on rank 0 alone; the other ranks wait in the barrier.
    fns["unsharded"] = (lambda: fwd_bwd(ref, x_ref, dy_full)) if r == 0 else None
    times = time_round_robin(fns, device, args.warmup, args.reps)

    sent, choices = {}, {}
    for name in ("tplayers", *FORCED):
        with tplayers.count_bytes() as counter, overlap_choices() as choices[name]:
            fns[name]()
        sent[name] = counter.total()
    rows = []
    for name in PROVIDERS:
        per_rank_flops = shape.flops / (1 if name == "unsharded" else n)
        rows.append({
            "kernel": "mlp_fwd_bwd", "provider": name, "mode": mode, "shape": str(shape),
            "time_ms": 1e3 * times[name], "bytes_per_rank": sent.get(name, ""),
            "auto_took": paths_taken(choices["tplayers"]) if name == "tplayers" else "",
            "tflops_per_rank": per_rank_flops / times[name] / 1e12,
        })  # fmt: skip
    return rows


def paths_taken(choices) -> str:
    """What overlap="auto" chose, from `overlap_choices()`: 'ring' / 'plain' when one path
    everywhere, else per op ('ag:plain rs:ring')."""
    per_op = {}
    for c in choices:
        per_op.setdefault(c.op, set()).add("ring" if c.overlap else "plain")
    paths = set().union(*per_op.values()) if per_op else {"-"}
    if len(paths) == 1:
        return paths.pop()
    short = {"all_gather_matmul": "ag", "matmul_reduce_scatter": "rs", "matmul_all_reduce": "ar"}
    return " ".join(f"{short[op]}:{'/'.join(sorted(p))}" for op, p in per_op.items())


# ---- GPU only: the fused forward ops against torch.matmul and torch's symm_mem ops ----------


def bench_fused_gpu(shape, group, device, dtype, args):
    """TFLOP/s per rank of the forward AllGather+GEMM and GEMM+ReduceScatter of the SP block.

    torch.matmul is the same per-rank GEMM without communication: the ceiling. The symm_mem ops
    are torch's own micro-pipelined versions, timed only where this torch build has them.
    """
    import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem

    n, B, S, H, F = dist.get_world_size(group), shape.batch, shape.seq, shape.hidden, shape.ffn
    group_name = group.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9, a no-op since
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group_name)
    ops = torch.ops.symm_mem
    x_shard = torch.randn(B, S // n, H, device=device, dtype=dtype)
    x_full = torch.randn(B, S, H, device=device, dtype=dtype)
    h_full = torch.randn(B, S, F // n, device=device, dtype=dtype)
    w1 = torch.randn(F // n, H, device=device, dtype=dtype)  # column shard (out/n, in)
    w2 = torch.randn(H, F // n, device=device, dtype=dtype)  # row shard (out, in/n)
    cases = {
        "all_gather_matmul": {
            "tplayers": lambda: all_gather_matmul(x_shard, w1, group),
            "torch.matmul": lambda: torch.matmul(x_full, w1.t()),
        },
        "matmul_reduce_scatter": {
            "tplayers": lambda: matmul_reduce_scatter(h_full, w2, group),
            "torch.matmul": lambda: torch.matmul(h_full, w2.t()),
        },
    }
    symm = {  # kernel -> (op name, call); torch's ops take B as (K, N): the weight transposed
        "all_gather_matmul": (
            "fused_all_gather_matmul",
            lambda: ops.fused_all_gather_matmul(x_shard, [w1.t()], 1, group_name, return_A=False),
        ),
        "matmul_reduce_scatter": (
            "fused_matmul_reduce_scatter",
            lambda: ops.fused_matmul_reduce_scatter(h_full, w2.t(), "sum", 1, group_name),
        ),
    }
    for kernel, (op_name, fn) in symm.items():
        if hasattr(ops, op_name) and runs(fn, op_name):
            cases[kernel]["symm_mem"] = fn
    rows = []
    flops = 2 * B * S * H * F / n
    for kernel, fns in cases.items():
        times = time_round_robin(fns, device, args.warmup, args.reps)
        for name, t in times.items():
            rows.append({
                "kernel": kernel, "provider": name, "mode": "fwd", "shape": str(shape),
                "time_ms": 1e3 * t, "tflops_per_rank": flops / t / 1e12,
            })  # fmt: skip
    return rows


def runs(fn, what):
    """Whether fn runs here; a build or device without support raises the same on every rank."""
    try:
        fn()
    except (RuntimeError, NotImplementedError) as e:
        if dist.get_rank() == 0:
            print(f"skipping {what}: {type(e).__name__}: {str(e)[:100]}")
        return False
    return True


# ---- per rank -------------------------------------------------------------------------------


def worker(rank, world_size, args):
    """Runs on every rank; returns the rows (identical on every rank: times are max-reduced)."""
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # On CPU the torch reference GEMMs, whatever TPLAYERS_BACKEND says (the interpreter is slow).
    tplayers.set_backend("auto" if device.type == "cuda" else "torch")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    mesh = init_device_mesh(device.type, (world_size,))
    rows = []
    for shape in args.shapes:
        for mode in MODES:
            rows += bench_mlp(shape, mode, mesh, device, dtype, args)
        if device.type == "cuda":
            rows += bench_fused_gpu(shape, mesh.get_group(), device, dtype, args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for row in rows:
        row.update(device=name, threads=args.threads, tp=world_size)
    return rows


def run_torchrun_group(worker, args):
    """Under torchrun: `worker(rank, world_size, args)` in one process per GPU (NCCL), or per CPU
    rank (gloo)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        return worker(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()


# ---- reporting ------------------------------------------------------------------------------


def add_ratios(rows):
    """ratio_to_dtensor, overlap on/off and scaling efficiency, within each (shape, mode)."""
    by_key = {(r["kernel"], r["shape"], r["mode"], r["provider"]): r["time_ms"] for r in rows}
    for row in rows:
        key = (row["kernel"], row["shape"], row["mode"])
        dtensor, unsharded = by_key.get((*key, "dtensor")), by_key.get((*key, "unsharded"))
        if dtensor and row["provider"] != "unsharded":
            row["ratio_to_dtensor"] = row["time_ms"] / dtensor
        if unsharded and row["provider"] != "unsharded":
            row["scaling_efficiency"] = unsharded / row["tp"] / row["time_ms"]
        on, off = by_key.get((*key, "tplayers-overlap")), by_key.get((*key, "tplayers-no-overlap"))
        if row["provider"] == "tplayers-overlap" and off:
            row["ratio_overlap_on_off"] = row["time_ms"] / off
        if row["provider"] == "tplayers" and on and off:
            row["auto_vs_faster"] = row["time_ms"] / min(on, off)
    return rows


def figure(*args, **kwargs):
    """plt.subplots on matplotlib's file-only backend (the benchmarks write PNGs, never show them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig, path):
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(rows, out, name, fields, plot, print_table):
    """<out>/<name>.csv and <out>/<name>.png of `rows`, and the printed table (bench/zero.py,
    bench/pipeline.py)."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / f"{name}.csv", fields)
    plot(rows, out / f"{name}.png")
    print_table(rows)
    print(f"\nwrote {out / f'{name}.csv'} and {out / f'{name}.png'}")
    return rows


def write_csv(rows, path, fields=FIELDS):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()})


def print_table(rows):
    mlp = [r for r in rows if r["kernel"] == "mlp_fwd_bwd"]
    t = {(r["shape"], r["mode"], r["provider"]): r for r in mlp}
    print(f"\nMLP fwd+bwd, tp={mlp[0]['tp']}, threads/rank={mlp[0]['threads']}, device={mlp[0]['device']}")
    head = (
        f"{'shape':<26} {'mode':<6} {'auto ms':>8} {'ovl ms':>8} {'no-ovl ms':>9} {'dtensor ms':>10} "
        f"{'unshard ms':>10} {'tpl/dt':>7} {'on/off':>7} {'auto took':<16} {'auto/best':>9} {'eff tpl':>7} "
        f"{'eff dt':>7} {'MB/rank':>8}"
    )
    print(head)
    print("-" * len(head))
    for shape, mode in dict.fromkeys((r["shape"], r["mode"]) for r in mlp):
        auto, on, off = (t[shape, mode, p] for p in ("tplayers", "tplayers-overlap", "tplayers-no-overlap"))
        dt, un = t[shape, mode, "dtensor"], t[shape, mode, "unsharded"]
        print(
            f"{shape:<26} {mode:<6} {auto['time_ms']:8.2f} {on['time_ms']:8.2f} {off['time_ms']:9.2f} "
            f"{dt['time_ms']:10.2f} {un['time_ms']:10.2f} {auto['ratio_to_dtensor']:7.3f} "
            f"{on['ratio_overlap_on_off']:7.3f} {auto['auto_took']:<16} {auto['auto_vs_faster']:9.3f} "
            f"{auto['scaling_efficiency']:7.3f} {dt['scaling_efficiency']:7.3f} {auto['bytes_per_rank'] / 2**20:8.1f}"
        )
    fused = [r for r in rows if r["kernel"] != "mlp_fwd_bwd"]
    for r in fused:
        print(f"{r['kernel']:<22} {r['provider']:<13} {r['shape']:<26} {r['time_ms']:8.3f} ms "
              f"{r['tflops_per_rank']:7.1f} TFLOP/s per rank")  # fmt: skip


def plot(rows, path):
    mlp = {(r["shape"], r["mode"], r["provider"]): r for r in rows if r["kernel"] == "mlp_fwd_bwd"}
    groups = list(dict.fromkeys((shape, mode) for shape, mode, _ in mlp))

    def column(provider, field):
        return [mlp[shape, mode, provider][field] for shape, mode in groups]

    series = {
        "tplayers (auto) / dtensor": column("tplayers", "ratio_to_dtensor"),
        "overlap on / off": column("tplayers-overlap", "ratio_overlap_on_off"),
        "auto / faster of on, off": column("tplayers", "auto_vs_faster"),
    }
    width = 0.8 / len(series)
    fig, ax = figure(figsize=(2.2 * len(groups) + 2, 4))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([g + (i - 1) * width for g in range(len(groups))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{shape.split(':')[0]}\n{mode}" for shape, mode in groups])
    first = next(iter(mlp.values()))
    ax.set_ylabel("time ratio (lower is better)")
    ax.set_title(f"MLP fwd+bwd, tp={first['tp']}, {first['threads']} thread(s)/rank, {first['device']}")
    ax.legend(fontsize="small")
    save_figure(fig, path)


def launch_or_torchrun(worker, args, nprocs):
    """The rows of `worker(rank, world_size, args)`: under torchrun every rank's own (the files
    are rank 0's to write: None elsewhere), else from `nprocs` local ranks (rank 0's)."""
    if "LOCAL_RANK" not in os.environ:
        return tplayers.launch(worker, nprocs, args)[0]
    rows = run_torchrun_group(worker, args)
    return rows if int(os.environ.get("RANK", "0")) == 0 else None


def main(argv=None):
    """Run the benchmark; returns the rows (on torchrun, rank 0 alone writes the files).

    The local ranks are spawned processes that re-import this module by its name, so import it
    from a directory on sys.path (`import linear` with bench/ on the path) or run the file; a
    module loaded from a file path under a made-up name cannot be found by them.
    """
    args = parse_args(argv)
    rows = launch_or_torchrun(worker, args, args.tp)
    if rows is None:
        return None
    return write_outputs(add_ratios(rows), args.out, "linear", FIELDS, plot, print_table)


if __name__ == "__main__":
    main()
