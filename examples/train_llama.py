"""Train a small Llama-style HuggingFace model with tensor parallelism; runs under torchrun or on
local CPU ranks.

    torchrun --nproc-per-node 2 examples/train_llama.py --sequence-parallel   # GPUs (nccl) or CPU (gloo)
    python examples/train_llama.py --tp 2                                      # local CPU ranks, no torchrun
    torchrun --nproc-per-node 2 examples/train_llama.py --dtype fp16 --micro-batches 2
    torchrun --nproc-per-node 4 examples/train_llama.py --dp 2 --zero 3      # TP 2 x ZeRO-3 over 2 replicas

Each step is `tplayers.train_step`: gradient accumulation over micro-batches, the loss scaler
(fp16), global gradient clipping and, for bf16 / fp16, fp32 master weights.

Rank 0 prints the loss and how closely the run follows the same model trained unsharded
(tplayers.tools.demo holds the model, the data and the check).
"""

import argparse
import gc
import os

import torch.distributed as dist

import tplayers
from tplayers.tools.demo import DemoConfig, train_on_rank


def main(rank, world_size, cfg):
    report = train_on_rank(rank, world_size, cfg)
    if report is not None:
        print(
            f"loss {report['losses'][0]:.4f} -> {report['losses'][-1]:.4f}; "
            f"agrees with unsharded for {report['agree_steps']} of {len(report['losses'])} steps "
            f"(to {report['agree_tol']:g}, {cfg.dtype}); "
            f"{report['bytes_per_step']:,} bytes sent per rank per step"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size when not under torchrun")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (under torchrun: tp = world / dp)")
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over the replicas")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--micro-batches", type=int, default=1)
    args = parser.parse_args()
    options = dict(
        steps=args.steps, sequence_parallel=args.sequence_parallel, dtype=args.dtype, micro_batches=args.micro_batches,
        dp=args.dp, zero=args.zero, batch=8 * args.dp,
    )  # fmt: skip
    if "RANK" in os.environ:  # torchrun: the world is dp replicas of a TP group
        world = int(os.environ["WORLD_SIZE"])
        mesh = tplayers.init_mesh(dp=args.dp, tp=world // args.dp)  # raises if dp does not divide the world
        cfg = DemoConfig(tp=world // args.dp, **options)
        main(dist.get_rank(), dist.get_world_size(), cfg)
        # Free the model's tensors (its hooks make reference cycles) while the interpreter is whole, and let
        # every rank finish before any tears its groups down: a gloo rank exiting with work in flight aborts.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    else:
        cfg = DemoConfig(tp=args.tp, **options)
        tplayers.launch(main, args.dp * args.tp, cfg)
