"""`tplayers demo`: train a small tensor-parallel MLP stack on local CPU ranks and check it
step for step against the same model trained unsharded.

Model: `layers` residual blocks h = h + Row(gelu(Col(h))) regressing the output of a fixed
random teacher network; rank 0 trains the unsharded twin (nn.Linear) on the same batches.
"""

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

import tplayers
from tplayers.functional.collectives import all_gather_dim


@dataclass
class DemoConfig:
    tp: int = 2
    steps: int = 200
    layers: int = 2
    hidden: int = 64
    ffn: int = 256
    batch: int = 8
    seq: int = 32
    lr: float = 3e-3
    sequence_parallel: bool = False
    overlap: bool = True
    backend: str = "auto"
    seed: int = 0


class MLPStack(nn.Module):
    """The unsharded model: plain nn.Linear blocks, knowing nothing about parallelism."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(cfg.hidden, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.hidden))
            for _ in range(cfg.layers)
        )

    def forward(self, h):
        for block in self.blocks:
            h = h + block(h)
        return h


def tensor_parallel(model: MLPStack, group, cfg: DemoConfig) -> MLPStack:
    """Swap each block's Linear pair for Column/Row-parallel shards of the same weights."""
    kw = dict(group=group, sequence_parallel=cfg.sequence_parallel, overlap=cfg.overlap)
    for block in model.blocks:
        block[0] = tplayers.ColumnParallelLinear.from_linear(block[0], **kw)
        block[2] = tplayers.RowParallelLinear.from_linear(block[2], **kw)
    return model


def _batch(step, cfg, teacher, device):
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    x = torch.randn(cfg.batch, cfg.seq, cfg.hidden, generator=gen).to(device)
    with torch.no_grad():
        return x, teacher(x)


def _gather_full_params(model: nn.Module, group) -> list:
    """Every parameter whole (sharded ones all-gathered along their shard dim); a collective."""
    full = []
    for p in model.parameters():
        placement = tplayers.get_placement(p)
        t = p.detach()
        if placement is not None and placement.is_sharded:
            t = all_gather_dim(t.contiguous(), placement.placement.dim, placement.group)
        full.append(t)
    return full


def train_on_rank(rank, world_size, cfg: DemoConfig):
    tplayers.set_backend(cfg.backend)
    group = dist.group.WORLD
    torch.manual_seed(cfg.seed)
    # CPU ranks on gloo (launch, or torchrun without GPUs); one GPU per rank on NCCL (torchrun).
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    teacher = MLPStack(cfg).to(device)
    model = MLPStack(cfg).to(device)
    reference = MLPStack(cfg).to(device) if rank == 0 else None
    if reference is not None:
        reference.load_state_dict(model.state_dict())
    model = tensor_parallel(model, group, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=cfg.lr) if reference is not None else None
    shard = (lambda t: t.chunk(world_size, 1)[rank]) if cfg.sequence_parallel else (lambda t: t)

    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=cfg.steps, desc=f"TP={world_size} MLP", unit="step")
    losses, ref_losses, train_time, bytes_per_step = [], [], 0.0, 0
    for step in range(cfg.steps):
        x, target = _batch(step, cfg, teacher, device)
        start = time.perf_counter()
        with tplayers.count_bytes() as sent:
            # Each rank's loss is over its sequence shard; their sum is the full mean loss.
            loss = nn.functional.mse_loss(model(shard(x)), shard(target), reduction="sum") / target.numel()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - start
        bytes_per_step = sent.total()
        total = loss.detach().clone()
        if cfg.sequence_parallel:
            dist.all_reduce(total, group=group)
        losses.append(total.item())
        if reference is not None:
            ref_loss = nn.functional.mse_loss(reference(x), target)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_losses.append(ref_loss.item())
            progress.update(1)
            progress.set_postfix(loss=f"{losses[-1]:.4f}", unsharded=f"{ref_losses[-1]:.4f}")
    if progress is not None:
        progress.close()
    gathered = _gather_full_params(model, group)
    if rank != 0:
        return None
    diff = max((a - b.detach()).abs().max().item() for a, b in zip(gathered, reference.parameters(), strict=True))
    tokens = cfg.steps * cfg.batch * cfg.seq
    return dict(
        config=asdict(cfg),
        losses=losses,
        unsharded_losses=ref_losses,
        tokens_per_s=tokens / train_time,
        bytes_per_step=bytes_per_step,
        max_param_diff=diff,
        max_loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
    )


def run_demo(cfg: DemoConfig) -> dict:
    """Train on `cfg.tp` local ranks; rank 0's report (losses, throughput, bytes, differences)."""
    for name in ("tp", "steps", "layers", "hidden", "ffn", "batch", "seq"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.ffn % cfg.tp:
        raise ValueError(f"ffn ({cfg.ffn}) is not divisible by the tensor-parallel size ({cfg.tp})")
    if cfg.sequence_parallel and cfg.seq % cfg.tp:
        raise ValueError(f"seq ({cfg.seq}) is not divisible by the tensor-parallel size ({cfg.tp})")
    return tplayers.launch(train_on_rank, cfg.tp, cfg)[0]


def write_report(report: dict, out_dir) -> list:
    """loss.csv and, where matplotlib is installed, loss.png; returns the paths written."""
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = zip(report["losses"], report["unsharded_losses"], strict=True)
    csv = out / "loss.csv"
    csv.write_text("step,loss_tp,loss_unsharded\n" + "".join(f"{i},{a},{b}\n" for i, (a, b) in enumerate(rows)))
    written = [csv]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'tplayers[bench]'): loss.png not written")
        return written
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(report["unsharded_losses"], label="unsharded", linewidth=3, alpha=0.5)
    ax.plot(report["losses"], label=f"TP={report['config']['tp']}", linestyle="--")
    ax.set(xlabel="step", ylabel="MSE loss", yscale="log", title="tplayers demo")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    return [*written, out / "loss.png"]


def summary(report: dict) -> str:
    losses = report["losses"]
    return "\n".join(
        [
            f"loss: {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps",
            f"tokens/s (TP ranks, fwd+bwd+step): {report['tokens_per_s']:,.0f}",
            f"bytes sent per rank per step: {report['bytes_per_step']:,}",
            f"largest |loss difference| vs unsharded: {report['max_loss_diff']:.3g}",
            f"largest |parameter difference| vs unsharded: {report['max_param_diff']:.3g}",
        ]
    )
