"""Benchmark: context-parallel attention, tplayers' against torch's own ring on the same ranks.

Causal GQA attention (B = 1, 8 query / 2 key-value heads of 64, fp32) over S tokens split across cp
local ranks in the head-tail layout both use (rank r holds chunks r and 2cp - 1 - r), forward and
backward, per sequence length:
    ring / allgather / ulysses   tplayers.functional.context (K / V sent as they are: 2 heads)
    torch ring                   torch's `_templated_ring_attention` (+ its backward) with the CPU
                                 flash-attention op, which needs K / V expanded to the 8 query heads
Measured per rank: the step time (median over rounds of the slowest rank), the bytes sent
(tplayers: counted; torch's ring: its (cp - 1) hops of the expanded K / V forward, K / V and their
gradients backward), and the peak memory of the step (the process's resident-set growth over a
run of that provider alone, in a fresh process). The outputs are checked against each other.

CPU: `python bench/context.py [--quick] [--cp 2] [--out bench/out]`. Writes <out>/context.csv and
<out>/context.png (time and peak memory against sequence length) and prints the ratios to
torch's ring.
"""

import argparse
import resource
from pathlib import Path

import torch
import torch.distributed as dist
from linear import figure, save_figure, time_round_robin, write_outputs  # bench/linear.py: shared timing, CSV

import tplayers
from tplayers.functional import comm
from tplayers.functional.context import AttentionOptions, context_attention
from tplayers.functional.context_layout import balanced_layout

PROVIDERS = ("ring", "allgather", "ulysses", "torch ring")
FIELDS = ("op", "provider", "shape", "device", "cp", "seq", "time_ms", "ratio_to_torch", "sent_mb", "peak_mb",
          "peak_ratio_to_torch", "max_abs_diff")  # fmt: skip
B, H, KH, D = 1, 8, 2, 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short sequences, few rounds (smoke test)")
    p.add_argument("--cp", type=int, default=2, help="context-parallel ranks (local CPU processes)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = p.parse_args(argv)
    args.seqs = (64, 128) if args.quick else (512, 1024, 2048, 4096)
    args.reps = 2 if args.quick else 5
    return args


def _inputs(S, rank, cp):
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, h, S, D, generator=g) for h in (H, KH, KH, H))
    layout = balanced_layout(B, S, cp, rank)
    local = [layout.take(t.transpose(1, 2)).transpose(1, 2).contiguous() for t in (q, k, v, do)]
    return layout, local


def _ours(method, layout, q, k, v, do, group):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        out = context_attention(*leaves, layout, group, AttentionOptions(scale=D**-0.5), method)
        out.backward(do)
        return out

    return step


def _torch_ring(q, k, v, do, group):
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    k, v = (t.repeat_interleave(H // KH, dim=1) for t in (k, v))  # its CPU op takes no GQA

    def step():
        out, lse = ring._templated_ring_attention(
            group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=True
        )[:2]
        ring._templated_ring_attention_backward(
            group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward, do, "grad_out", q, k, v,
            out, lse, is_causal=True, dropout_p=0.0,
        )  # fmt: skip
        return out

    return step


def _steps(S, rank, cp, group):
    layout, (q, k, v, do) = _inputs(S, rank, cp)
    steps = {m: _ours(m, layout, q, k, v, do, group) for m in PROVIDERS[:3]}
    steps["torch ring"] = _torch_ring(q, k, v, do, group)
    return steps


def timing_worker(rank, cp, args):
    torch.set_num_threads(1)
    rows = []
    for S in args.seqs:
        steps = _steps(S, rank, cp, dist.group.WORLD)
        outs = {name: step() for name, step in steps.items()}
        diff = max((outs[n] - outs["torch ring"]).abs().max().item() for n in PROVIDERS[:3])
        sent = {}
        for name in PROVIDERS[:3]:
            with comm.count_bytes() as counted:
                steps[name]()
            sent[name] = counted.by_axis()["cp"]
        expanded = 2 * B * H * (S // cp) * D * 4  # K and V at the query heads, fp32
        sent["torch ring"] = (cp - 1) * expanded + (cp - 1) * expanded + cp * expanded  # fwd, bwd K / V, dK / dV
        times = time_round_robin(steps, torch.device("cpu"), warmup=1, reps=args.reps)
        for name in PROVIDERS:
            rows.append(dict(op="causal attention fwd+bwd", provider=name, shape=f"B{B} H{H} KH{KH} D{D}",
                             device="cpu (gloo)", cp=cp, seq=S, time_ms=1e3 * times[name], sent_mb=sent[name] / 1e6,
                             max_abs_diff=diff))  # fmt: skip
    return rows


def memory_worker(rank, cp, S, name):
    """The resident-set growth of `name`'s step at S tokens, in this fresh process (MB), after a
    step at 4 x cp tokens has loaded what the provider loads once (libraries, kernels)."""
    torch.set_num_threads(1)
    _steps(4 * cp, rank, cp, dist.group.WORLD)[name]()
    step = _steps(S, rank, cp, dist.group.WORLD)[name]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def add_ratios(rows, peaks):
    base = {(r["seq"]): r for r in rows if r["provider"] == "torch ring"}
    for r in rows:
        r["ratio_to_torch"] = r["time_ms"] / base[r["seq"]]["time_ms"]
        r["peak_mb"] = peaks[r["provider"], r["seq"]]
        torch_peak = peaks["torch ring", r["seq"]]
        r["peak_ratio_to_torch"] = r["peak_mb"] / torch_peak if torch_peak else float("nan")
    return rows


def plot(rows, path):
    fig, (left, right) = figure(1, 2, figsize=(10, 4))
    for name in PROVIDERS:
        mine = [r for r in rows if r["provider"] == name]
        seqs = [r["seq"] for r in mine]
        left.plot(seqs, [r["time_ms"] for r in mine], marker="o", label=name)
        right.plot(seqs, [r["peak_mb"] for r in mine], marker="o", label=name)
    for ax, what in ((left, "step time per rank (ms)"), (right, "peak memory growth per rank (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(what)
        ax.legend()
    left.set_title(f"causal attention fwd+bwd, cp = {rows[0]['cp']}")
    save_figure(fig, path)


def print_table(rows):
    head = ("provider", "seq", "ms", "/torch", "sent MB", "peak MB", "/torch", "max diff")
    print(f"{head[0]:<12}" + "".join(f" {h:>8}" for h in head[1:]))
    for r in rows:
        cells = (r["seq"], f"{r['time_ms']:.2f}", f"{r['ratio_to_torch']:.2f}", f"{r['sent_mb']:.2f}",
                 f"{r['peak_mb']:.1f}", f"{r['peak_ratio_to_torch']:.2f}", f"{r['max_abs_diff']:.1e}")  # fmt: skip
        print(f"{r['provider']:<12}" + "".join(f" {c:>8}" for c in cells))


def main(argv=None):
    args = parse_args(argv)
    rows = tplayers.launch(timing_worker, args.cp, args)[0]
    peaks = {(name, S): max(tplayers.launch(memory_worker, args.cp, S, name)) for S in args.seqs for name in PROVIDERS}
    rows = add_ratios(rows, peaks)
    return write_outputs(rows, args.out, "context", FIELDS, plot, print_table)


if __name__ == "__main__":
    main()
