"""Benchmark: one HF training step on one GPU, plain HF against Liger Kernel against `parallelize`.

An HF Llama (shape from the flags; the default: 8 layers, hidden 2048, GQA 16 / 8 heads,
intermediate 5632, vocabulary 128256, batch 4 x 2048 tokens, bf16 weights, AdamW) takes
training steps of `model(input_ids=ids, labels=ids).loss.backward(); optimizer.step()`, the loss
being the model's own, through each provider:
    hf                plain transformers (sdpa attention, cuBLAS GEMMs)
    liger             HF with Liger Kernel's `apply_liger_kernel_to_llama` (its fused RMSNorm,
                      RoPE, SwiGLU and linear cross-entropy), where liger-kernel is importable
    tplayers-triton   `tplayers.parallelize` at TP 1, Triton backend
    tplayers-torch    `tplayers.parallelize` at TP 1, torch backend (cuBLAS for every GEMM)
Each provider runs in its own process (Liger patches the HF classes in place), on the same
weights and batch (one seed). Per provider: ms / step (median of the timed steps after the
warm-up), tokens / s, peak memory allocated over the timed steps, and the first step's loss
beside plain HF's; for the tplayers rows, the torch profiler's top kernels by GPU time over one
step (<out>/step_<provider>_kernels.txt).

    python bench/step.py [--layers 8 --hidden 2048 ...] [--quick] [--out bench/out/step]
    (or: tplayers bench --step)

Writes <out>/step.csv and <out>/step.png and prints a table; ratios are to plain HF's time and
memory in this run (compare ratios, not times, across machines). Without a CUDA GPU it runs a
tiny shape on CPU (the Triton backend in Triton's interpreter), a check of the script: the
times mean nothing, Liger is left out (its kernels need a GPU) and the peak is glibc's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROVIDERS = ("hf", "liger", "tplayers-triton", "tplayers-torch")
FIELDS = (
    "provider", "shape", "device", "dtype", "ms_per_step", "tokens_per_s", "peak_gib", "loss", "loss_minus_hf",
    "time_vs_hf", "memory_vs_hf", "time_vs_liger", "memory_vs_liger", "note",
)  # fmt: skip
CPU_SHAPE = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, batch=2, seq=32,
                 dtype="fp32", steps=2, warmup=1)  # fmt: skip
PROFILED_KERNELS = 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, optimizer state)")
    p.add_argument("--quick", action="store_true", help="2 layers, 3 timed steps (a smoke run)")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--no-profile", action="store_true", help="skip the tplayers rows' kernel profile")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "step")
    p.add_argument("--provider", choices=PROVIDERS, help=argparse.SUPPRESS)  # one provider, in a child process
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.steps, args.warmup = min(args.layers, 2), 3, 2
    return args


# -- one provider, in its own process -----------------------------------------------------------


def _dtype(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _build(args, device):
    """The Llama of the flags on `device`, the same weights in every process (seed 0)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 128), tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(_dtype(args.dtype)).train()


def _init_group(device):
    """A process group of one for tplayers (nccl on CUDA, gloo on CPU), as torchrun would give."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def _model(args, provider, device):
    if provider == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()  # patches the HF Llama classes: before the model is built
    model = _build(args, device)
    if provider.startswith("tplayers"):
        import tplayers

        _init_group(device)
        tplayers.set_backend(provider.split("-")[1])
        tplayers.parallelize(model)
    return model


def _profile(step, device, path):
    """The top kernels by device time over one step, written to `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=PROFILED_KERNELS))


def run_provider(args) -> dict:
    """Build, warm up, time and (tplayers) profile one provider; its row."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda and args.provider == "tplayers-triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    model = _model(args, args.provider, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    first = float(step().detach())
    for _ in range(args.warmup - 1):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        meter = None
    else:
        from tplayers.testing import memory

        meter = memory.peak_bytes() if memory.available() else None
    times = []
    with meter if meter is not None else _nothing():
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if cuda else (meter.bytes if meter is not None else float("nan"))
    if args.provider.startswith("tplayers") and not args.no_profile:
        _profile(step, device, args.out / f"step_{args.provider}_kernels.txt")
    ms = 1e3 * statistics.median(times)
    return dict(
        provider=args.provider, ms_per_step=ms, tokens_per_s=args.batch * args.seq / (ms / 1e3),
        peak_gib=peak / 2**30, loss=first,
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
    )  # fmt: skip


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- the parent: every provider, side by side ----------------------------------------------------


def _available(provider, cuda) -> str | None:
    """Why `provider` cannot run here, or None."""
    if provider != "liger":
        return None
    if not cuda:
        return "Liger Kernel's kernels need a CUDA GPU"
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "liger-kernel is not installed (pip install 'tplayers[bench]')"
    return None


def _child(args, provider) -> dict:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "batch", "seq", "dtype",
                      "steps", "warmup")]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        cmd = [
            sys.executable,
            __file__,
            *flags,
            "--provider",
            provider,
            "--result",
            str(result),
            "--out",
            str(args.out),
        ]
        cmd += ["--no-profile"] if args.no_profile else []
        done = subprocess.run(cmd)
        if done.returncode != 0 or not result.is_file():
            return dict(provider=provider, note=f"failed (exit code {done.returncode})")
        return json.loads(result.read_text())


def plot(rows, path, title):
    from linear import figure, save_figure

    done = [r for r in rows if "ms_per_step" in r]
    fig, (left, right) = figure(1, 2, figsize=(10, 3.2))
    names = [r["provider"] for r in done]
    colours = ["tab:gray", "tab:orange", "tab:blue", "tab:green"][: len(done)]
    left.barh(names, [r["ms_per_step"] for r in done], color=colours)
    left.set_xlabel("ms / step (lower is better)")
    right.barh(names, [r["peak_gib"] for r in done], color=colours)
    right.set_xlabel("peak memory allocated, GiB")
    for ax in (left, right):
        ax.invert_yaxis()
    fig.suptitle(title, fontsize="medium")
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.provider is not None:  # a child: one provider
        args.out.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(run_provider(args)))
        return 0
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        print("bench/step.py: no CUDA GPU; a tiny shape on CPU checks the script (the times mean nothing)",
              file=sys.stderr)  # fmt: skip
        for k, v in CPU_SHAPE.items():
            setattr(args, k, v)
    shape = (f"L{args.layers} H{args.hidden} heads{args.heads}/{args.kv_heads} I{args.intermediate} V{args.vocab} "
             f"B{args.batch}xS{args.seq}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for provider in args.providers:
        why = _available(provider, cuda)
        print(f"== {provider}" + (f": skipped ({why})" if why else ""), flush=True)
        rows.append(dict(provider=provider, note=why) if why else _child(args, provider))
    base = {r["provider"]: r for r in rows if "ms_per_step" in r}
    for r in rows:
        r.update(shape=shape, dtype=args.dtype)
        r.setdefault("device", next(iter(base.values()), {}).get("device", ""))
        for ref in ("hf", "liger"):
            if "ms_per_step" in r and ref in base:
                r[f"time_vs_{ref}"] = r["ms_per_step"] / base[ref]["ms_per_step"]
                r[f"memory_vs_{ref}"] = r["peak_gib"] / base[ref]["peak_gib"]
        if "loss" in r and "hf" in base:
            r["loss_minus_hf"] = r["loss"] - base["hf"]["loss"]
    from linear import write_csv

    write_csv(rows, args.out / "step.csv", FIELDS)
    title = f"one training step, {shape} {args.dtype}, {rows[0].get('device', '')}"
    plot(rows, args.out / "step.png", title)
    print(f"\n{title}")
    print(f"{'provider':<18}{'ms/step':>10}{'tokens/s':>12}{'peak GiB':>10}{'vs HF':>8}{'vs Liger':>10}"
          f"{'mem vs Liger':>14}{'loss - HF':>12}")  # fmt: skip
    for r in rows:
        if "ms_per_step" not in r:
            print(f"{r['provider']:<18}{r.get('note', '')}")
            continue
        fmt = lambda k, spec, r=r: format(r[k], spec) if k in r else format("-", spec.split(".")[0])
        print(f"{r['provider']:<18}{r['ms_per_step']:>10.1f}{r['tokens_per_s']:>12.0f}{r['peak_gib']:>10.3g}"
              f"{fmt('time_vs_hf', '>8.3f')}{fmt('time_vs_liger', '>10.3f')}{fmt('memory_vs_liger', '>14.3f')}"
              f"{fmt('loss_minus_hf', '>12.2e')}")  # fmt: skip
    print(f"\nwrote {args.out / 'step.csv'} and {args.out / 'step.png'}")
    failed = [r["provider"] for r in rows if str(r.get("note", "")).startswith("failed")]
    if failed:
        print(f"bench/step.py: {', '.join(failed)} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
