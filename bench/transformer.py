"""Benchmark: forward + backward (loss from labels) of a tiny HF Llama, tplayers vs DTensor TP.

Providers, timed side by side in one run on the same ranks:
    tplayers   `tplayers.parallelize(model, group=...)` on a copy of the HF model
    dtensor    PyTorch's `parallelize_module` on a copy of the same HF model, the torchtitan-style
               Llama plan: q/k/v, gate/up ColwiseParallel; o, down RowwiseParallel; embed_tokens
               RowwiseParallel (vocab split); lm_head ColwiseParallel gathered to full logits;
               attention and MLP inputs through PrepareModuleInput, so their column layers share
               one dx reduction (HF attention reshapes with -1 heads, so local heads just work)
    unsharded  the HF model on one rank (for scaling efficiency)
Modes: "tp" and "tp+sp" (sequence parallel: the residual stream between the blocks' projections
is split along the sequence). For DTensor SP the embedding output stays replicated (HF builds the
causal mask and rotary positions from its sequence length), the first block's input is split
along the sequence, norms get SequenceParallel and the last block hands back a sequence shard
that the final norm (SequenceParallel) and lm_head (input Shard(1)) take as such.

Bytes communicated per rank per step: tplayers from `tplayers.count_bytes()`; DTensor from a
CommDebugMode that also sums the collectives' tensor sizes with the same ring-algorithm cost
model (see CommBytes). The same counter run on tplayers cross-checks the two (column bytes_check).

CPU: `python bench/transformer.py [--quick] [--tp 2] [--threads 1] [--out bench/out]` starts the
ranks itself (tplayers.launch, gloo). Writes <out>/transformer.csv and <out>/transformer.png and
prints a table. Ratios below 1 favour tplayers; scaling efficiency = unsharded time / tp / TP time.
"""

import argparse
import copy
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from linear import figure, save_figure, time_round_robin, wait, write_csv  # bench/linear.py: shared timing, CSV
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import tplayers


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    layers: int

    def __str__(self):
        return (
            f"{self.name}:b{self.batch}s{self.seq}h{self.hidden}n{self.heads}kv{self.kv_heads}"
            f"f{self.ffn}v{self.vocab}L{self.layers}"
        )


SHAPES = [Shape("llama", batch=4, seq=512, hidden=512, heads=8, kv_heads=4, ffn=1536, vocab=8192, layers=2)]
QUICK_SHAPES = [Shape("llama", batch=2, seq=32, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, layers=2)]
MODES = ("tp", "tp+sp")
PROVIDERS = ("tplayers", "dtensor")
FIELDS = (
    "kernel", "provider", "mode", "shape", "device", "threads", "tp", "time_ms", "ratio_to_dtensor",
    "scaling_efficiency", "bytes_per_rank", "bytes_sent_p2p", "bytes_check",
    "collectives_per_rank", "tokens_per_s",
)  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few iterations (smoke test)")
    p.add_argument("--tp", type=int, default=2, help="TP size = local CPU ranks")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 2, quick 1)")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default 8, quick 3)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = p.parse_args(argv)
    args.shapes = QUICK_SHAPES if args.quick else SHAPES
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.reps = args.reps if args.reps is not None else (3 if args.quick else 8)
    return args


# ---- models -------------------------------------------------------------------------------


def reference_model(shape):
    """The unsharded HF model from a random config (no network); seeded, so every rank builds the same."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.seq, attention_dropout=0.0,
    )  # fmt: skip
    return tf.LlamaForCausalLM(config).train()


def tplayers_model(ref, group, sp):
    return tplayers.parallelize(copy.deepcopy(ref), group=group, sequence_parallel=sp)


def dtensor_model(ref, mesh, sp):
    """The torchtitan Llama plan on HF module names (see the module docstring)."""
    model = copy.deepcopy(ref)
    seq = Shard(1) if sp else Replicate()
    # Replicated activations enter attention / MLP as one DTensor, so q/k/v (gate/up) sum their
    # partial dx as DTensors and reduce once at the module boundary, as Megatron does.
    enter = dict(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    parallelize_module(
        model,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
            **({"model.norm": SequenceParallel(use_local_output=True)} if sp else {}),
        },
    )
    for i, block in enumerate(model.model.layers):
        plan = {
            # HF calls self_attn(hidden_states=...), mlp(hidden_states) positionally
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": seq}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
            "mlp": PrepareModuleInput(**enter),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan["input_layernorm"] = SequenceParallel()
            plan["post_attention_layernorm"] = SequenceParallel()
        parallelize_module(block, mesh, plan)
        if sp and i == 0:  # the residual stream becomes a local sequence shard as it enters the first block
            parallelize_module(
                block,
                mesh,
                PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
                ),
            )
    return model


def fwd_bwd(model, ids):
    for p in model.parameters():
        p.grad = None  # a fresh gradient each step, not an accumulating add
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    for p in model.parameters():
        finish_grad(p)


def finish_grad(p):
    """Wait for in-flight DTensor collectives; a Partial gradient (a SequenceParallel norm that saw
    part of the sequence) is reduced, as an optimizer step would need (tplayers does it in backward)."""
    g = p.grad
    if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
        p.grad = g.redistribute(g.device_mesh, [Replicate()] * g.device_mesh.ndim)
    wait(p.grad)


# ---- bytes on the wire --------------------------------------------------------------------


class CommBytes(CommDebugMode):
    """CommDebugMode that also adds up the bytes this rank sends, with tplayers.functional.comm's
    ring-algorithm cost: (n-1)/n of the gathered / reduced buffer per AllGather or ReduceScatter,
    2(n-1)/n per AllReduce. Sees DTensor's functional collectives and plain c10d calls alike."""

    def __init__(self):
        super().__init__()
        self.bytes = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented:
            kind, nbytes = _collective_bytes(func._overloadpacket.__name__, args)
            if kind:
                self.bytes[kind] += nbytes
        return out

    def total(self):
        return int(round(sum(self.bytes.values())))


def _collective_bytes(name, args):
    n = dist.get_world_size()
    size = lambda t: (sum(x.numel() * x.element_size() for x in t) if isinstance(t, list | tuple) else
                      t.numel() * t.element_size())  # fmt: skip
    if name in ("all_reduce", "allreduce_"):
        return "all_reduce", 2 * (n - 1) / n * size(args[0])
    if name == "all_gather_into_tensor":  # (input shard, group size, group)
        return "all_gather", (n - 1) * size(args[0])
    if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):  # (output, input, ...)
        return "all_gather", (n - 1) / n * size(args[0])
    if name == "reduce_scatter_tensor":  # (input, op, group size, group)
        return "reduce_scatter", (n - 1) / n * size(args[0])
    if name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):  # (output, input, ...)
        return "reduce_scatter", (n - 1) / n * size(args[1])
    if name in ("all_to_all_single", "alltoall_base_"):
        return "all_to_all", (n - 1) / n * size(args[0])
    return None, 0


# ---- the benchmark --------------------------------------------------------------------------


def bench_llama(shape, mesh, args):
    """Rows for one shape: every (provider, mode)'s fwd+bwd time and bytes, and the unsharded time."""
    n, group = dist.get_world_size(), mesh.get_group()
    if shape.heads % n or shape.kv_heads % n or shape.ffn % n or shape.vocab % n or shape.seq % n:
        raise ValueError(f"{shape}: heads, kv_heads, ffn, vocab and seq must be divisible by the TP size {n}")
    ref = reference_model(shape)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(1))
    models = {}
    for mode in MODES:
        sp = mode == "tp+sp"
        models["tplayers", mode] = tplayers_model(ref, group, sp)
        models["dtensor", mode] = dtensor_model(ref, mesh, sp)

    # Compare like with like: every provider must compute the unsharded model's logits and loss.
    with torch.no_grad():
        expected = ref(input_ids=ids, labels=ids)
        for key, model in models.items():
            out = model(input_ids=ids, labels=ids)
            # Looser than the tests' fp32 table: this only guards against timing the wrong thing.
            torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-4, msg=f"{key}: logits")
            torch.testing.assert_close(out.loss, expected.loss, rtol=1e-4, atol=1e-4, msg=f"{key}: loss")

    fns = {key: (lambda m=model: fwd_bwd(m, ids)) for key, model in models.items()}
    # The unsharded model runs on rank 0 alone; the other ranks wait in the barrier.
    fns["unsharded", "-"] = (lambda: fwd_bwd(ref, ids)) if dist.get_rank() == 0 else None
    times = time_round_robin(fns, torch.device("cpu"), args.warmup, args.reps)

    rows = []
    for (provider, mode), t in times.items():
        row = {
            "kernel": "llama_fwd_bwd", "provider": provider, "mode": mode, "shape": str(shape),
            "time_ms": 1e3 * t, "tokens_per_s": shape.batch * shape.seq / t,
        }  # fmt: skip
        if provider != "unsharded":
            with warnings.catch_warnings(), tplayers.count_bytes() as counted, CommBytes() as seen:
                # its module tracker's hooks warn about HF's dataclass outputs
                warnings.simplefilter("ignore")
                fns[provider, mode]()
            row["collectives_per_rank"] = seen.get_total_counts()
            if provider == "tplayers":
                # the dispatch counter sees collectives only, not the p2p sends of tplayers' overlapped ring
                row["bytes_per_rank"], row["bytes_check"] = counted.total(), seen.total()
                row["bytes_sent_p2p"] = counted["send"]
            else:
                row["bytes_per_rank"] = seen.total()
        rows.append(row)
    return rows


def worker(rank, world_size, args):
    """Runs on every rank; returns the rows (identical on every rank: times are max-reduced)."""
    torch.set_num_threads(args.threads)
    tplayers.set_backend("torch")  # CPU: the torch reference GEMMs (the Triton interpreter is slow)
    mesh = init_device_mesh("cpu", (world_size,))
    rows = []
    for shape in args.shapes:
        rows += bench_llama(shape, mesh, args)
    for row in rows:
        row.update(device="cpu", threads=args.threads, tp=world_size)
    return rows


# ---- reporting ------------------------------------------------------------------------------


def add_ratios(rows):
    """ratio_to_dtensor within each (shape, mode); scaling efficiency against the unsharded model."""
    by_key = {(r["shape"], r["mode"], r["provider"]): r["time_ms"] for r in rows}
    for row in rows:
        if row["provider"] == "unsharded":
            continue
        dtensor, unsharded = by_key.get((row["shape"], row["mode"], "dtensor")), by_key[row["shape"], "-", "unsharded"]
        if dtensor:
            row["ratio_to_dtensor"] = row["time_ms"] / dtensor
        row["scaling_efficiency"] = unsharded / row["tp"] / row["time_ms"]
    return rows


def print_table(rows):
    first = rows[0]
    print(f"\nLlama fwd+bwd (loss from labels), tp={first['tp']}, threads/rank={first['threads']}, device=cpu")
    head = (
        f"{'shape':<40} {'provider':<10} {'mode':<6} {'ms':>9} {'tok/s':>8} {'/dtensor':>8} {'eff':>6} "
        f"{'MB/rank':>8} {'colls':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = f"{r['ratio_to_dtensor']:8.3f}" if "ratio_to_dtensor" in r else f"{'':8}"
        eff = f"{r['scaling_efficiency']:6.3f}" if "scaling_efficiency" in r else f"{'':6}"
        mb = f"{r['bytes_per_rank'] / 2**20:8.1f}" if "bytes_per_rank" in r else f"{'':8}"
        colls = f"{r['collectives_per_rank']:6d}" if "collectives_per_rank" in r else f"{'':6}"
        print(
            f"{r['shape']:<40} {r['provider']:<10} {r['mode']:<6} {r['time_ms']:9.1f} {r['tokens_per_s']:8.0f} "
            f"{ratio} {eff} {mb} {colls}"
        )
    for r in rows:
        if r["provider"] == "tplayers" and r["bytes_per_rank"] - r["bytes_sent_p2p"] != r["bytes_check"]:
            print(
                f"note: {r['mode']}: tplayers count_bytes without p2p sends "
                f"{r['bytes_per_rank'] - r['bytes_sent_p2p']} != dispatch count {r['bytes_check']}"
            )


def plot(rows, path):
    t = {(r["shape"], r["mode"], r["provider"]): r for r in rows}
    groups = [(r["shape"], r["mode"]) for r in rows if r["provider"] == "tplayers"]
    series = {
        "time tplayers / dtensor": [t[s, m, "tplayers"]["ratio_to_dtensor"] for s, m in groups],
        "bytes tplayers / dtensor": [
            t[s, m, "tplayers"]["bytes_per_rank"] / t[s, m, "dtensor"]["bytes_per_rank"] for s, m in groups
        ],
    }
    width = 0.8 / len(series)
    fig, ax = figure(figsize=(2.2 * len(groups) + 2, 4))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([g + (i - 0.5) * width for g in range(len(groups))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{shape.split(':')[0]}\n{mode}" for shape, mode in groups])
    first = rows[0]
    ax.set_ylabel("ratio to DTensor (lower is better)")
    ax.set_title(f"HF Llama fwd+bwd, tp={first['tp']}, {first['threads']} thread(s)/rank, cpu")
    ax.legend(fontsize="small", loc="lower right")
    save_figure(fig, path)


def main(argv=None):
    """Run the benchmark; returns the rows.

    The local ranks are spawned processes that re-import this module by its name, so run the file
    or import it from a directory on sys.path (bench/, which also makes `linear` importable).
    """
    args = parse_args(argv)
    rows = add_ratios(tplayers.launch(worker, args.tp, args)[0])
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "transformer.csv", FIELDS)
    plot(rows, args.out / "transformer.png")
    print_table(rows)
    print(f"\nwrote {args.out / 'transformer.csv'} and {args.out / 'transformer.png'}")
    return rows


if __name__ == "__main__":
    main()
