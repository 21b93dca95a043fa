"""Benchmark: unscale + non-finite check + gradient clipping over a model's gradients, the fused
pass (`unscale_and_stats_`) against torch's GradScaler + clip_grad_norm_ ops.

Providers, each a full "unscale, then clip to max_norm" step over the same gradients:
    torch            torch._amp_foreach_non_finite_check_and_unscale_ (read + write), then
                     torch.nn.utils.clip_grad_norm_(foreach=True): a norm pass (read) and the
                     multiply by the clip coefficient (read + write)
    tplayers-scaler  what a tplayers training step runs: DynamicLossScaler.clip_grad_norm_
                     (unscale, overflow flag, clip); the fused kernel on CUDA, torch's unscale op
                     plus one norm pass on CPU
    tplayers-ref     unscale_and_stats_ref (torch's unscale op, then three norm passes) + multiply
    tplayers-triton  unscale_and_stats_ (unscale + all statistics in one read + write, one launch
                     per dtype) + multiply; only where CUDA is available
Every provider multiplies by the clip coefficient, as clip_grad_norm_ always does, so the steps
do the same work. The gradients are those of a Llama-style decoder (per layer q/k/v/o,
gate/up/down and two norms; embedding, final norm and an untied lm_head), all of one dtype.

    python bench/amp.py [--quick] [--reps N] [--warmup N] [--threads N] [--out bench/out]

Writes <out>/amp.csv and <out>/amp.png and prints a table. Each time is the median over reps of
one call, the providers interleaved round-robin; the gradients are reset from a saved copy
before every call, outside the timed region. Ratios below 1 favour tplayers. GB/s counts the
bytes each provider's own passes read and write (see BYTES_PER_ELEMENT_PASS); on a GPU it is
also given as a fraction of the memory bandwidth from the device properties.
"""

import argparse
import importlib.metadata
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from linear import figure, save_figure, sync, write_csv  # bench/linear.py: shared sync, CSV, figures
from tplayers.kernels.grad_stats_ref import unscale_and_stats_ref

from tplayers.train.scaler import DynamicLossScaler


@dataclass(frozen=True)
class Decoder:
    name: str
    hidden: int
    layers: int
    ffn: int
    kv_hidden: int  # kv_heads * head_dim: grouped-query attention makes k / v narrower
    vocab: int

    def shapes(self):
        """Every parameter's shape, in module order, weights as nn.Linear (out, in)."""
        h, f, kv = self.hidden, self.ffn, self.kv_hidden
        layer = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
        return [(self.vocab, h)] + layer * self.layers + [(h,), (self.vocab, h)]

    def __str__(self):
        return f"{self.name}:h{self.hidden}l{self.layers}f{self.ffn}kv{self.kv_hidden}v{self.vocab}"


CONFIGS = [
    Decoder("small", hidden=512, layers=4, ffn=1376, kv_hidden=512, vocab=32000),
    Decoder("medium", hidden=1024, layers=8, ffn=2752, kv_hidden=256, vocab=32000),
]
QUICK_CONFIGS = [Decoder("tiny", hidden=128, layers=2, ffn=344, kv_hidden=64, vocab=4096)]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PROVIDERS = ("torch", "tplayers-scaler", "tplayers-ref", "tplayers-triton")
# Reads + writes of the whole gradient list per step: torch = unscale (2) + norm (1) + multiply
# (2); the reference = unscale (2) + three norms (3) + multiply (2); the fused kernel = one pass
# (2) + multiply (2).
# tplayers-scaler is the fused pass on CUDA (4) and torch's ops on CPU (5).
BYTES_PER_ELEMENT_PASS = {"torch": 5, "tplayers-ref": 7, "tplayers-triton": 4}
LOSS_SCALE = 2.0**16
MAX_NORM = 1.0
FIELDS = (
    "op", "provider", "dtype", "config", "n_tensors", "numel", "time_ms", "ratio_vs_torch", "bytes",
    "gbps", "peak_gbps", "fraction_of_peak", "device", "threads", "torch", "triton",
)  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one tiny decoder, few reps (smoke test)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 2, quick 1)")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default 10 on CPU, 50 on GPU; quick 3)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = p.parse_args(argv)
    args.configs = QUICK_CONFIGS if args.quick else CONFIGS
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    default_reps = 50 if torch.cuda.is_available() else 10
    args.reps = args.reps if args.reps is not None else (3 if args.quick else default_reps)
    return args


# ---- the steps ------------------------------------------------------------------------------


def torch_step(grads, holders, inv_scale):
    """GradScaler.unscale_ then clip_grad_norm_, as a training loop calls them."""
    found_inf = torch.zeros(1, device=inv_scale.device)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    total = torch.nn.utils.clip_grad_norm_(holders, MAX_NORM, foreach=True)
    return total, found_inf


def fused_step(unscale_and_stats, grads, inv_scale):
    """One unscale + statistics pass, then clip_grad_norm_'s coefficient and multiply."""
    stats, found_inf = unscale_and_stats(grads, inv_scale)
    total = stats[:, 1].sum().sqrt()  # the 2-norm of all gradients: sum g^2 over tensors, then root
    coef = (MAX_NORM / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef)
    return total, found_inf


def scaler_step(scaler, optimizer):
    """DynamicLossScaler.clip_grad_norm_ (unscale + flag + clip), then update() to reset it."""
    total = scaler.clip_grad_norm_(optimizer, MAX_NORM)
    scaler.update()
    return total, torch.zeros(1)


def holders_for(grads):
    """Stand-ins for the parameters clip_grad_norm_ takes: zero-storage tensors of each grad's
    shape (an expanded scalar) whose .grad is the gradient, so no weights are allocated."""
    holders = []
    for g in grads:
        h = torch.empty((), dtype=g.dtype, device=g.device).expand(g.shape)
        h.grad = g
        holders.append(h)
    return holders


# ---- timing ---------------------------------------------------------------------------------


def time_round_robin(fns, reset, device, warmup, reps):
    """{name: median seconds of one call} for fns {name: callable}; `reset()` runs before every
    call, untimed. One call per provider per round, the order rotated every round, so drift and
    noise fall on every provider alike. (Single process: linear.py's version times ranks.)"""
    names = list(fns)
    times = {name: [] for name in names}
    for rnd in range(warmup + reps):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            reset()
            sync(device)
            start = time.perf_counter()
            fns[name]()
            sync(device)
            if rnd >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_bandwidth_gbps(device):
    """DRAM bandwidth from the device properties (double data rate), or None (CPU, old torch)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


# ---- one (config, dtype) --------------------------------------------------------------------


def bench_one(decoder, dtype, device, providers, args):
    gen = torch.Generator(device=device).manual_seed(0)
    # Gradients of a loss scaled by 2**16: ~65 in magnitude (fine in fp16), a clip coefficient < 1.
    saved = [
        torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(1e-3 * LOSS_SCALE).to(dtype)
        for shape in decoder.shapes()
    ]
    grads = [s.clone() for s in saved]
    holders = holders_for(grads)
    inv_scale = torch.full((1,), 1 / LOSS_SCALE, dtype=torch.float32, device=device)
    fns = {"torch": lambda: torch_step(grads, holders, inv_scale)}
    scaler = DynamicLossScaler(init_scale=LOSS_SCALE, growth_interval=10**9, allow_fp16_grads=True)
    optimizer = SimpleNamespace(param_groups=[{"params": holders}])  # all the scaler reads of one
    fns["tplayers-scaler"] = lambda: scaler_step(scaler, optimizer)
    for name, impl in providers.items():
        fns[name] = lambda impl=impl: fused_step(impl, grads, inv_scale)

    def reset():
        torch._foreach_copy_(grads, saved)

    # Like with like: every provider must find the same norm and leave the same gradients.
    reset()
    expected_norm, _ = fns["torch"]()
    expected = [g.clone() for g in grads]
    for name in ["tplayers-scaler", *providers]:
        reset()
        norm, found = fns[name]()
        # torch's clip sums per-tensor norms rounded to the grads' dtype: loose for fp16 / bf16
        rtol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(norm.float(), expected_norm.float(), rtol=rtol, atol=0, msg=name)
        assert found.item() == 0.0, name
        for g, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=rtol, atol=1e-6, msg=name)

    times = time_round_robin(fns, reset, device, args.warmup, args.reps)
    numel = sum(s.numel() for s in saved)
    peak = peak_bandwidth_gbps(device)
    rows = []
    for name, t in times.items():
        passes = BYTES_PER_ELEMENT_PASS.get(name, 4 if device.type == "cuda" else 5)
        nbytes = passes * numel * saved[0].element_size()
        gbps = nbytes / t / 1e9
        rows.append({
            "op": "unscale+clip", "provider": name, "dtype": str(dtype).removeprefix("torch."),
            "config": str(decoder), "n_tensors": len(saved), "numel": numel, "time_ms": 1e3 * t,
            "ratio_vs_torch": t / times["torch"], "bytes": nbytes, "gbps": gbps,
            "peak_gbps": peak or "", "fraction_of_peak": gbps / peak if peak else "",
        })  # fmt: skip
    return rows


# ---- reporting ------------------------------------------------------------------------------


def print_table(rows):
    t = {(r["config"], r["dtype"], r["provider"]): r for r in rows}
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    first = rows[0]
    print(f"\nunscale + clip_grad_norm_ step, device={first['device']}, threads={first['threads']}")
    head = f"{'config':<44} {'dtype':<9} {'Mparams':>8} " + " ".join(f"{p + ' ms':>19}" for p in providers)
    head += " " + " ".join(f"{p.removeprefix('tplayers-') + '/torch':>12}" for p in providers[1:]) + f" {'GB/s':>16}"
    print(head)
    print("-" * len(head))
    for config, dtype in dict.fromkeys((r["config"], r["dtype"]) for r in rows):
        cells = [t[config, dtype, p] for p in providers]
        best = cells[-1]
        bw = f"{best['gbps']:.0f}" + (f" ({best['fraction_of_peak']:.0%})" if best["fraction_of_peak"] != "" else "")
        print(
            f"{config:<44} {dtype:<9} {cells[0]['numel'] / 1e6:8.2f} "
            + " ".join(f"{c['time_ms']:19.3f}" for c in cells)
            + " "
            + " ".join(f"{c['ratio_vs_torch']:12.3f}" for c in cells[1:])
            + f" {bw:>16}"
        )
    print(f"(GB/s of {providers[-1]}, its own bytes read + written; % of the device's peak where known)")


def plot(rows, path):
    groups = list(dict.fromkeys((r["config"], r["dtype"]) for r in rows))
    by_key = {(r["config"], r["dtype"], r["provider"]): r for r in rows}
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    width = 0.8 / len(providers)
    fig, ax = figure(figsize=(1.4 * len(groups) + 3, 4))
    for i, provider in enumerate(providers):
        xs = [g + (i - (len(providers) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [by_key[(*key, provider)]["ratio_vs_torch"] for key in groups], width, label=provider)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{config.split(':')[0]}\n{dtype}" for config, dtype in groups])
    ax.set_ylabel("time / torch (lower is better)")
    ax.set_title(f"unscale + clip_grad_norm_ step, {rows[0]['device']}")
    ax.legend(fontsize="small")
    save_figure(fig, path)


def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    providers = {"tplayers-ref": unscale_and_stats_ref}
    if cuda:  # the kernel is GPU-only here: the interpreter would time numpy, not Triton
        from tplayers.kernels.grad_stats import unscale_and_stats_

        providers["tplayers-triton"] = unscale_and_stats_
    rows = []
    for decoder in args.configs:
        for dtype in DTYPES:
            rows += bench_one(decoder, dtype, device, providers, args)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    for row in rows:
        row.update(device=name, threads=torch.get_num_threads(), torch=torch.__version__, triton=version("triton"))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "amp.csv", FIELDS)
    plot(rows, args.out / "amp.png")
    print_table(rows)
    print(f"\nwrote {args.out / 'amp.csv'} and {args.out / 'amp.png'}")
    return rows


if __name__ == "__main__":
    main()
