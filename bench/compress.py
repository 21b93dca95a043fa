"""Benchmark: data-parallel gradient compression (`tplayers.data_parallel(compress=...)`), per
compressor and model size, side by side in one run: the data-parallel bytes one step sends
(measured with `tplayers.count_bytes`, 2 local replicas at ZeRO stage 0), the time the
compression itself adds per step ("time_ms") (the compressor's math on one process: quantize, sum,
requantize, dequantize; select and scatter; or PowerSGD's two products, QR and product back; no
communication), and the link bandwidth below
which it pays: bytes saved / time added. gloo's wall-clock times say nothing about a GPU link,
so no speedup is claimed from them; the break-even bandwidth is what to compare with a link.

CPU: `python bench/compress.py [--quick] [--out bench/out]` (or `tplayers bench --only compress`)
starts the ranks itself.
Writes <out>/compress.csv and <out>/compress.png and prints a table.
"""

import argparse
import time
from pathlib import Path

import torch
from linear import figure, save_figure, write_outputs  # bench/linear.py: shared CSV / PNG helpers

import tplayers
from tplayers.data_parallel import compress

SPECS = (None, "bf16", "int8", "topk:0.1", "topk:0.01", "powersgd:rank=4")
SIZES = (2**16, 2**20, 2**22)  # parameters of one (64, size / 64) weight, one DDP bucket
QUICK_SIZES = (2**12, 2**16)
FIELDS = ("op", "provider", "shape", "device", "params", "dp_bytes", "bytes_ratio", "time_ms", "break_even_GBps")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = p.parse_args(argv)
    args.sizes = QUICK_SIZES if args.quick else SIZES
    return args


def measured_bytes(rank, world, sizes):
    """{(spec, size): dp bytes of one step} on 2 replicas (the second step: DDP's buckets settled)."""
    out = {}
    for size in sizes:
        for spec in SPECS:
            torch.manual_seed(0)
            model = torch.nn.Linear(size // 64, 64, bias=False)  # weight (64, size / 64)
            tplayers.data_parallel(model, compress=spec, bucket_cap_mb=1024)
            x = torch.randn(4, size // 64)
            for _step in range(2):
                with tplayers.count_bytes() as sent:
                    model(x).square().mean().backward()
                model.weight.grad = None
            out[spec, size] = sent.by_axis()["dp"]
    return out


def compression_seconds(spec, size, reps, n=2):
    """The compressor's own math for one bucket of `size` entries over n replicas (one process)."""
    if spec is None:
        return 0.0
    compression = tplayers.Compression.parse(spec)
    values = [torch.randn(size, generator=torch.Generator().manual_seed(r)) for r in range(n)]

    def once():
        return compress.simulate(compression, values, [(64, size // 64)])

    once()
    start = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - start) / reps / n  # per replica


def run(args):
    measured = tplayers.launch(measured_bytes, 2, args.sizes)[0]
    rows = []
    for size in args.sizes:
        plain = measured[None, size]
        for spec in SPECS:
            seconds = compression_seconds(spec, size, args.reps)
            saved = plain - measured[spec, size]
            rows.append(
                dict(
                    op="dp_gradient_mean",
                    provider=spec or "fp32",
                    shape=f"bucket={size}",
                    device="cpu",
                    params=size,
                    dp_bytes=measured[spec, size],
                    bytes_ratio=measured[spec, size] / plain,
                    time_ms=1e3 * seconds,
                    break_even_GBps=(saved / seconds / 1e9) if seconds else float("nan"),
                )  # fmt: skip
            )
    return rows


def plot(rows, path):
    fig, (left, right) = figure(1, 2, figsize=(11, 4))
    for spec in SPECS:
        mine = [r for r in rows if r["provider"] == (spec or "fp32")]
        left.plot([r["params"] for r in mine], [r["bytes_ratio"] for r in mine], "o-", label=spec or "fp32")
        if spec:
            right.plot([r["params"] for r in mine], [r["break_even_GBps"] for r in mine], "o-", label=spec)
    left.set(xscale="log", xlabel="parameters in the bucket", ylabel="dp bytes / fp32's", title="bytes per step")
    right.set(xscale="log", yscale="log", xlabel="parameters in the bucket", ylabel="GB/s",
              title="pays below this link bandwidth (CPU math)")  # fmt: skip
    left.legend()
    right.legend()
    save_figure(fig, path)


def print_table(rows):
    print(f"{'compressor':>16} {'params':>9} {'dp bytes':>11} {'ratio':>6} {'math ms':>8} {'pays below GB/s':>16}")
    for r in rows:
        print(f"{r['provider']:>16} {r['params']:>9} {r['dp_bytes']:>11} {r['bytes_ratio']:>6.3f} "
              f"{r['time_ms']:>8.2f} {r['break_even_GBps']:>16.2f}")  # fmt: skip


def main(argv=None):
    args = parse_args(argv)
    return write_outputs(run(args), args.out, "compress", FIELDS, plot, print_table)


if __name__ == "__main__":
    main()
