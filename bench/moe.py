"""Benchmark: expert parallelism against the experts split over tensor parallelism and against
HF transformers' own expert-parallel path, on the same ranks and the same Qwen3-MoE model
(forward + backward of one training step), side by side in one run:

    tplayers-ep     parallelize(expert_group=mesh["ep"]): whole experts per rank, each rank its
                    own micro-batch, tokens moved by all-to-all; data_parallel ZeRO-3 around it
    tplayers-tp     parallelize(group=every rank): each rank 1/n of every expert; the n
                    micro-batches as one batch that every rank runs (the same tokens per step)
    hf-ep           transformers' DistributedConfig(ep_size=n, fsdp_size=n,
                    ep_implementation="all_to_all"): whole experts per rank, FSDP2 around it

Per provider: tokens per second (the step's tokens over the slowest rank's median time, round
robin), the model state each rank holds (parameter and gradient bytes: a CPU has no per-module
peak-memory counter, and on a GPU the activations would add to it alike), the bytes each rank
sends by axis (`tplayers.count_bytes`; HF's collectives do not go through it and are not
counted), and the per-rank load: (token, expert) pairs each rank's experts ran, its largest over
the mean.

What gloo on 2 CPU cores can say: the relative cost of the same math laid out three ways, with
the all-to-alls' bytes exact. What it cannot: GPU speed (the experts' grouped GEMM runs its
pure-torch reference here, not the Triton kernel; NVLink and InfiniBand all-to-alls have other
latencies), so read the ratios of one run, not the times.

    python bench/moe.py [--quick] [--out bench/out]    (starts 4 local ranks itself)

Writes <out>/moe.csv and <out>/moe.png and prints the table.
"""

import argparse
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from linear import figure, save_figure, time_round_robin, write_outputs

import tplayers
from tplayers.nn.experts import ParallelExperts
from tplayers.placement import local_tensor

RANKS = 4
SHAPE = dict(hidden=256, experts=8, ffn=512, top_k=2, layers=2, seq=128, micro=4)
QUICK = dict(hidden=64, experts=8, ffn=64, top_k=2, layers=1, seq=32, micro=2)
FIELDS = ("op", "provider", "shape", "device", "ranks", "tokens_per_s", "time_ms", "time_ratio", "state_mb_per_rank",
          "ep_bytes", "tp_bytes", "dp_bytes", "load_max_over_mean")  # fmt: skip
PROVIDERS = ("tplayers-ep", "tplayers-tp", "hf-ep")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    return p.parse_args(argv)


def _model(shape):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.AutoConfig.for_model(
        "qwen3_moe", vocab_size=1024, hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=shape["hidden"] // 4, num_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"], moe_intermediate_size=shape["ffn"], max_position_embeddings=shape["seq"],
    )  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(cfg)


def _state_mb(model):
    """Parameter and gradient bytes this rank holds (its shards), in MB."""
    held = sum(local_tensor(t).numel() * t.element_size() for p in model.parameters() for t in (p, p.grad)
               if t is not None)  # fmt: skip
    return held / 1e6


def _load(model, n):
    """Pairs each rank's experts ran in the last forward, max over mean (from the routing every
    rank recorded: each pick counted on the rank holding its expert)."""
    picks = getattr(model, "_bench_picks", [])
    per_rank = torch.zeros(n, dtype=torch.float64)
    for indices, sizes in picks:
        owner = torch.repeat_interleave(torch.arange(n), torch.tensor(sizes))
        per_rank += torch.bincount(owner[indices.flatten()], minlength=n).double()
    dist.all_reduce(per_rank)
    return (per_rank.max() / per_rank.mean()).item() if per_rank.sum() else float("nan")


def _record_picks(model):
    model._bench_picks = []
    for m in model.modules():
        if isinstance(m, ParallelExperts) and m.expert_group is not None:
            m.register_forward_pre_hook(
                lambda mod, args: model._bench_picks.append((args[1].detach(), mod.expert_sizes))
            )


def _hf_ep(shape, n, directory):
    import transformers as tf
    from transformers.distributed.configuration_utils import DistributedConfig

    config = DistributedConfig(ep_size=n, fsdp_size=n, ep_implementation="all_to_all")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tf.AutoModelForCausalLM.from_pretrained(directory, distributed_config=config)


def bench(rank, world, args):
    torch.set_num_threads(1)
    shape = QUICK if args.quick else SHAPE
    n, micro, seq = world, shape["micro"], shape["seq"]
    ids = torch.randint(0, 1024, (n * micro, seq), generator=torch.Generator().manual_seed(0))
    mine = ids[rank * micro : (rank + 1) * micro]
    mesh = tplayers.init_mesh(dp=n, ep=n)
    models = {}
    ep = _model(shape)
    tplayers.parallelize(ep, group=mesh["tp"], expert_group=mesh["ep"], verify=False)
    tplayers.data_parallel(ep, group=mesh["dp"], zero_stage=3)
    _record_picks(ep)
    models["tplayers-ep"] = (ep, mine)
    tp = _model(shape)
    tplayers.parallelize(tp, group=dist.group.WORLD, verify=False)
    models["tplayers-tp"] = (tp, ids)
    models["hf-ep"] = (_hf_ep(shape, n, args.hf_directory), mine)

    def step(model, batch):
        def run():
            model(batch, labels=batch).loss.backward()
            model.zero_grad(set_to_none=False)

        return run

    rows, label = [], f"hidden {shape['hidden']}, {shape['experts']} experts of {shape['ffn']}, top {shape['top_k']}"
    label += f", {shape['layers']} layers, {n} x {micro} x {seq} tokens"
    seconds = time_round_robin({k: step(*v) for k, v in models.items()}, torch.device("cpu"), 1, args.reps)
    times = {k: 1e3 * v for k, v in seconds.items()}  # ms
    for name, (model, batch) in models.items():
        with tplayers.count_bytes() as sent:
            model(batch, labels=batch).loss.backward()
        axes = sent.by_axis()
        load = _load(model, n) if name == "tplayers-ep" else float("nan")
        state = torch.tensor(_state_mb(model))
        dist.all_reduce(state, op=dist.ReduceOp.MAX)
        model.zero_grad()
        rows.append(dict(op="moe train step", provider=name, shape=label, device="cpu (gloo)", ranks=n,
                         time_ms=times[name],
                         tokens_per_s=n * micro * seq / (times[name] / 1e3), state_mb_per_rank=state.item(),
                         ep_bytes=axes["ep"] if name != "hf-ep" else "", tp_bytes=axes["tp"] if name != "hf-ep" else "",
                         dp_bytes=axes["dp"] if name != "hf-ep" else "", load_max_over_mean=load))  # fmt: skip
    for row in rows:
        row["time_ratio"] = row["time_ms"] / times["tplayers-ep"]
    return rows


def plot(rows, path):
    fig, axes = figure(1, 3, figsize=(14, 3.5))
    names = [r["provider"] for r in rows]
    for ax, (key, title) in zip(axes, (("tokens_per_s", "tokens / s"), ("time_ratio", "time over tplayers-ep"),
                                       ("state_mb_per_rank", "model state per rank (MB)")), strict=True):  # fmt: skip
        ax.barh(names, [r[key] for r in rows])
        ax.set_title(title)
    save_figure(fig, path)


def print_table(rows):
    print(f"{'provider':<14}{'tokens/s':>10}{'time ratio':>12}{'state MB':>10}{'ep bytes':>12}{'tp bytes':>12}"
          f"{'dp bytes':>12}{'load max/mean':>15}")  # fmt: skip
    for r in rows:
        nums = f"{r['tokens_per_s']:>10.0f}{r['time_ratio']:>12.2f}{r['state_mb_per_rank']:>10.2f}"
        sent = f"{r['ep_bytes']!s:>12}{r['tp_bytes']!s:>12}{r['dp_bytes']!s:>12}"
        print(f"{r['provider']:<14}{nums}{sent}{r['load_max_over_mean']:>15.2f}")
    print("(gloo on CPU: compare the ratios of one run; hf-ep's bytes are not counted, its collectives bypass "
          "tplayers.count_bytes)")  # fmt: skip


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:  # the same model, for HF's from_pretrained
        _model(QUICK if args.quick else SHAPE).save_pretrained(directory)
        args.hf_directory = directory
        rows = tplayers.launch(bench, RANKS, args)[0]
    return write_outputs(rows, args.out, "moe", FIELDS, plot, print_table)


if __name__ == "__main__":
    main()
