"""`tplayers demo`: train a small Llama-style HuggingFace model with tensor parallelism on local
CPU ranks and check it step for step against the same model trained unsharded.

Model: `LlamaForCausalLM` from a small random config over bytes (vocabulary 256, split over the TP ranks as it is,
unevenly where it must), sharded by `tplayers.parallelize` with vocabulary-parallel logits and
`vocab_parallel_cross_entropy`; `--tp RxC` lays the tensor-parallel ranks out as a 2-D grid (`tplayers.hf.grid`).
Text: generated on the fly, sums written out ("17+25=42;"), so there is structure to learn and
nothing to download. Rank 0 trains the unsharded twins on the same batches: one in fp32, what
the sharded run is compared with step by step, and one in fp64, the exact answer both fp32 runs
approximate, so the report shows the sharded run as close to it as the unsharded fp32 run is.
Checkpoints (`--save`) go to `<save>/step_<n>`, the last `keep` of them kept.
"""

import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import tplayers
from tplayers.distributed import resolve_group
from tplayers.placement import local_tensor

BYTES = 256


@dataclass
class DemoConfig:
    tp: int | tuple[int, int] = 2  # tensor-parallel ranks, or an (r, c) grid of them
    dp: int = 1  # data-parallel replicas (each trains on its share of every batch)
    pp: int = 1  # pipeline stages (tplayers.pipeline_split, 1F1B over max(pp, micro_batches) micro-batches)
    cp: int = 1  # context-parallel ranks: the sequence split over them through attention too
    zero: int = 0  # ZeRO stage over the replicas (tplayers.data_parallel)
    steps: int = 300
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    batch: int = 8
    seq: int = 64
    lr: float = 1e-3
    sequence_parallel: bool = False
    overlap: bool | str = "auto"  # the layers' overlap mode: "auto", True (ring) or False (plain collectives)
    backend: str = "auto"
    seed: int = 0
    dtype: str = "fp32"  # the TP model's parameters: fp32, or bf16 / fp16 with fp32 master weights
    micro_batches: int = 1  # gradient accumulation: the batch is split into this many
    max_grad_norm: float = 1.0
    save: str | None = None  # a folder: sharded checkpoints (tplayers.save_checkpoint) written there
    save_every: int = 0  # steps between checkpoints (0: only at the end)
    keep: int = 2  # checkpoints kept in `save` (the last ones)
    resume: str | None = None  # a folder `save` wrote: go on from its last checkpoint, at any layout


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# How closely the TP run is expected to track the fp32 unsharded one (loss in nats), per
# parameter dtype: fp32 differs only by summation order; 16-bit runs by their rounding (bf16
# keeps 8 mantissa bits, fp16 11). Measured over the default 300 steps: fp32 within 1e-4 for
# ~150 steps (0.04 at most after), bf16 within 0.034-0.050, fp16 within 0.036-0.046.
AGREE_TOL = {"fp32": 1e-4, "bf16": 1e-1, "fp16": 5e-2}


def build_model(cfg: DemoConfig):
    """The unsharded model; it knows nothing about parallelism."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise ImportError("tplayers demo trains a HuggingFace model: pip install 'tplayers[hf]'") from e
    config = LlamaConfig(
        vocab_size=BYTES,  # as it is: tplayers splits it unevenly where it must
        hidden_size=cfg.hidden, intermediate_size=cfg.ffn, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def text_batch(step: int, cfg: DemoConfig, device) -> torch.Tensor:
    """(batch, seq) byte ids of generated sums, the same on every rank for a given step."""
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    rows = []
    for _ in range(cfg.batch):
        text = ""
        while len(text) < cfg.seq + 1:
            a, b = torch.randint(0, 100, (2,), generator=gen).tolist()
            text += f"{a}+{b}={a + b};"
        start = int(torch.randint(0, len(text) - cfg.seq, (1,), generator=gen))
        rows.append(list(text[start : start + cfg.seq].encode()))
    return torch.tensor(rows, device=device)


def _loss(model, ids, group, context=False):
    """Next-byte cross-entropy from this rank's vocabulary slice of the logits (context parallelism:
    the model's own loss, over every rank's tokens)."""
    if context:
        return model(ids, labels=ids).loss
    local_logits = model(ids).logits  # (B, S, V/n)
    return tplayers.vocab_parallel_cross_entropy(local_logits[:, :-1], ids[:, 1:], group=group, vocab_size=BYTES)


def model_state_bytes(model, optimizer) -> dict:
    """Bytes this rank holds of parameters, gradients (one per trainable parameter, as backward
    leaves them) and optimizer state, measured on the tensors themselves."""
    params = {id(p): p for p in model.parameters()}.values()
    inner = getattr(optimizer, "optimizer", optimizer)  # MixedPrecisionOptimizer's own
    inner = getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer's local one
    size = lambda t: local_tensor(t).numel() * t.element_size()  # noqa: E731
    state = sum(size(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    masters = sum(size(m) for m in getattr(optimizer, "masters", lambda: [])())
    return dict(
        params=sum(size(p) for p in params),
        grads=sum(size(p) for p in params if p.requires_grad),
        optimizer=state + masters,
    )


def _loss_of(logits, ids, group, context=False):
    """The pipeline's last stage: next-byte cross-entropy from this rank's vocabulary slice (context
    parallelism: from the whole rows' logits the last stage gathers)."""
    if context:
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    return tplayers.vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], group=group, vocab_size=BYTES)


def _own_keys(full, trained, pp):
    """The state-dict keys of the weights this rank trains (all of them without pipelining)."""
    if pp == 1:
        return list(full)
    layers = {f"model.layers.{i}." for i in trained.layer_indices}
    keys = [k for k in full if any(k.startswith(prefix) for prefix in layers)]
    keys += [k for k in full if k.startswith("model.embed_tokens")] if trained.first else []
    keys += [k for k in full if k.startswith(("model.norm", "lm_head"))] if trained.last else []
    return keys


STEP_PREFIX, TWINS = "step_", "unsharded_twins.pt"


def _next_token_loss(logits, ids):
    """Mean next-byte cross-entropy, in the logits' dtype (fp64 for the exact twin: HF's own
    loss upcasts to fp32 only)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class Twins:
    """Rank 0's unsharded copies of the initial model, trained on the same batches with torch's
    own clipping: in fp32 (what the sharded run is compared with) and in fp64 (the exact answer
    both fp32 runs approximate: the yardstick for how close "close" is)."""

    def __init__(self, model, cfg, device):
        self.models = {}
        for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
            twin = build_model(cfg).to(device, dtype)
            twin.load_state_dict(model.state_dict())
            self.models[name] = (twin, torch.optim.AdamW(twin.parameters(), lr=cfg.lr))
        self.losses = {name: [] for name in self.models}
        self.max_grad_norm = cfg.max_grad_norm

    def step(self, ids):
        for name, (twin, opt) in self.models.items():
            loss = _next_token_loss(twin(ids).logits, ids)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(twin.parameters(), self.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.losses[name].append(loss.item())

    def state_dict(self):
        models = {n: {"model": m.state_dict(), "optimizer": o.state_dict()} for n, (m, o) in self.models.items()}
        return {"models": models, "losses": self.losses}

    def load_state_dict(self, state):
        for name, (twin, opt) in self.models.items():
            twin.load_state_dict(state["models"][name]["model"])
            opt.load_state_dict(state["models"][name]["optimizer"])
        self.losses = {name: list(v) for name, v in state["losses"].items()}


def _save(folder, step, keep, model, opt, scaler, losses, twins):
    """The sharded checkpoint `<folder>/step_<step>` (every rank), rank 0's twins inside it; only
    the last `keep` checkpoints stay."""
    path = Path(folder) / f"{STEP_PREFIX}{step}"
    extra = {"step": step, "losses": list(losses)}
    tplayers.save_checkpoint(path, model=model, optimizer=opt, scaler=scaler, extra=extra, keep=keep)
    if twins is not None:  # rotation removes the checkpoint and its twins together
        torch.save(twins.state_dict(), path / (TWINS + ".partial"))
        (path / (TWINS + ".partial")).replace(path / TWINS)


def last_checkpoint(folder) -> Path | None:
    """The checkpoint `--save` wrote last in `folder` (the highest step with its twins), or None."""
    steps = [p for p in Path(folder).glob(f"{STEP_PREFIX}*") if p.name[len(STEP_PREFIX) :].isdigit()]
    steps = [p for p in steps if (p / TWINS).is_file()]
    return max(steps, key=lambda p: int(p.name[len(STEP_PREFIX) :]), default=None)


def _resume(folder, model, opt, scaler, twins):
    """(next step, losses so far) from the last checkpoint in `folder`; the twins restored."""
    path = last_checkpoint(folder)
    extra = tplayers.load_checkpoint(path, model=model, optimizer=opt, scaler=scaler)
    if twins is not None:
        twins.load_state_dict(torch.load(path / TWINS, weights_only=True))
    return extra["step"], list(extra["losses"])


def train_on_rank(rank, world_size, cfg: DemoConfig):
    tplayers.set_backend(cfg.backend)
    mesh = tplayers.init_mesh(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp)
    tp_mesh = mesh["tp_r", "tp_c"] if isinstance(cfg.tp, tuple) else mesh["tp"]
    # every tensor-parallel rank (a grid flattened): the loss, the scaler, the gathered state
    group, dp_group = resolve_group(tp_mesh), mesh["dp"].get_group()
    dp_rank = mesh["dp"].get_local_rank()
    # CPU ranks on gloo (launch, or torchrun without GPUs); one GPU per rank on NCCL (torchrun).
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(cfg.seed)
    model = build_model(cfg).to(device)
    twins = Twins(model, cfg, device) if rank == 0 else None
    data_parallel = cfg.dp > 1 or cfg.zero > 0
    if not data_parallel:  # 16-bit parameters with fp32 masters in the optimizer
        with torch.no_grad():  # parameters only: buffers (RoPE frequencies) stay fp32
            for p in model.parameters():
                p.data = p.data.to(DTYPES[cfg.dtype])
    context = dict(context_group=mesh["cp"], vocab_parallel_logits=False) if cfg.cp > 1 else {}
    tplayers.parallelize(
        model, group=tp_mesh, sequence_parallel=cfg.sequence_parallel, overlap=cfg.overlap,
        **{"vocab_parallel_logits": True, **context},
    )  # fmt: skip
    trained, schedule = model, None  # what this rank trains: the model, or its pipeline stage
    if cfg.pp > 1:
        stage = tplayers.pipeline_split(model, group=mesh["pp"])[0]
        trained = stage.module
        n_microbatches = max(cfg.pp, cfg.micro_batches)
        loss_of = functools.partial(_loss_of, group=group, context=cfg.cp > 1)
        schedule = tplayers.Schedule1F1B(stage, n_microbatches, loss_of)
    if data_parallel:  # 16-bit: FSDP2 computes in it, its fp32 shards are the masters
        param_dtype = DTYPES[cfg.dtype] if cfg.dtype != "fp32" else None
        tplayers.data_parallel(trained, group=mesh["dp"], zero_stage=cfg.zero, param_dtype=param_dtype)
    opt = tplayers.data_parallel_optimizer(trained, torch.optim.AdamW, lr=cfg.lr)
    if cfg.dtype != "fp32" and not data_parallel:
        opt = tplayers.MixedPrecisionOptimizer(opt)
    # fp16's 5 exponent bits need loss scaling; bf16 has fp32's range and does not.
    scaler = tplayers.DynamicLossScaler(init_scale=2.0**12, group=group, enabled=cfg.dtype == "fp16")

    progress = None
    if rank == 0:
        from tqdm import tqdm

        layout = (
            f"TP={tp_label(cfg.tp)}" + (f" PP={cfg.pp}" if cfg.pp > 1 else "") + (f" CP={cfg.cp}" if cfg.cp > 1 else "")
        )
        layout += f" DP={cfg.dp} ZeRO-{cfg.zero}" if cfg.dp > 1 or cfg.zero else ""
        progress = tqdm(total=cfg.steps, desc=f"{layout} Llama {cfg.dtype}", unit="step")
    losses, train_time, bytes_per_step, skipped = [], 0.0, 0, 0
    start_step = 0
    if cfg.resume:
        start_step, losses = _resume(cfg.resume, model, opt, scaler, twins)
        if progress is not None:
            progress.update(start_step)
    for step in range(start_step, cfg.steps):
        ids = text_batch(step, cfg, device)
        mine = ids.chunk(cfg.dp)[dp_rank]  # this replica's share of the batch
        start = time.perf_counter()
        with tplayers.count_bytes() as sent:
            if schedule is not None:  # the schedule's micro-batches are the accumulation
                result = tplayers.train_step(
                    schedule, opt, [(mine, mine)], None, scaler=scaler, max_grad_norm=cfg.max_grad_norm
                )
            else:
                result = tplayers.train_step(
                    model, opt, mine.chunk(cfg.micro_batches), lambda m, b: _loss(m, b, group, cfg.cp > 1),
                    scaler=scaler, max_grad_norm=cfg.max_grad_norm,
                )  # fmt: skip
        train_time += time.perf_counter() - start
        bytes_per_step = sent.total()
        loss = torch.tensor([result.loss], dtype=torch.float64)
        dist.all_reduce(loss, group=dp_group)  # the mean over the replicas: the whole batch's
        losses.append(loss.item() / cfg.dp)
        skipped += result.skipped
        if twins is not None:
            twins.step(ids)
            progress.update(1)
            progress.set_postfix(loss=f"{losses[-1]:.4f}", unsharded=f"{twins.losses['fp32'][-1]:.4f}")
        last = step + 1 == cfg.steps
        if cfg.save and (last or (cfg.save_every and (step + 1) % cfg.save_every == 0)):
            _save(cfg.save, step + 1, cfg.keep, model, opt, scaler, losses, twins)
    if progress is not None:
        progress.close()
    full = tplayers.gather_state_dict(model, group=group)  # a collective: every rank
    state_bytes = model_state_bytes(trained, opt)
    # each stage's own weights against the twins' (rank 0 sends theirs to all)
    twin_states = [{n: m.state_dict() for n, (m, _) in twins.models.items()} if twins is not None else None]
    dist.broadcast_object_list(twin_states, src=0)
    twin_states = twin_states[0]
    mine = _own_keys(full, trained, cfg.pp)

    def largest_difference(state, exact):
        return max((state[k].double() - exact[k]).abs().max().item() for k in mine)

    diffs = torch.tensor(
        [largest_difference(full, twin_states["fp32"]), largest_difference(full, twin_states["fp64"])],
        dtype=torch.float64,
    )
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    tokens = cfg.steps * cfg.batch * cfg.seq
    ref_losses, exact_losses = twins.losses["fp32"], twins.losses["fp64"]
    loss_diffs = [abs(a - b) for a, b in zip(losses, ref_losses, strict=True)]
    # Summation order differs between the sharded and the unsharded GEMMs, so the two runs differ
    # by rounding from the first step; training amplifies that over hundreds of steps. Report how
    # long they agree to AGREE_TOL and how far apart they end up, and how far each fp32 run is
    # from the exact (fp64) one: the sharded run is as good as the unsharded when those match.
    tol = AGREE_TOL[cfg.dtype]
    agree_steps = next((i for i, d in enumerate(loss_diffs) if d > tol), len(loss_diffs))
    return dict(
        config=asdict(cfg),
        losses=losses,
        unsharded_losses=ref_losses,
        exact_losses=exact_losses,
        sharded_vs_exact=[abs(a - b) for a, b in zip(losses, exact_losses, strict=True)],
        unsharded_vs_exact=[abs(a - b) for a, b in zip(ref_losses, exact_losses, strict=True)],
        tokens_per_s=tokens / train_time,
        bytes_per_step=bytes_per_step,
        max_param_diff=diffs[0].item(),
        max_param_diff_vs_exact=diffs[1].item(),
        unsharded_param_diff_vs_exact=max(
            (v.double() - twin_states["fp64"][k]).abs().max().item() for k, v in twin_states["fp32"].items()
        ),
        max_loss_diff=max(loss_diffs),
        agree_steps=agree_steps,
        max_loss_diff_while_agreeing=max(loss_diffs[:agree_steps], default=0.0),
        agree_tol=tol,
        skipped_steps=skipped,
        final_scale=scaler.get_scale(),
        model_state_bytes=state_bytes,
    )


def tp_label(tp) -> str:
    return "{}x{}".format(*tp) if isinstance(tp, (tuple, list)) else str(tp)


def run_demo(cfg: DemoConfig) -> dict:
    """Train on `cfg.dp * cfg.pp * cfg.cp * tp` local ranks; rank 0's report (losses, throughput, bytes,
    differences)."""
    if isinstance(cfg.tp, list):
        cfg.tp = tuple(cfg.tp)
    grid = isinstance(cfg.tp, tuple)
    if grid and (len(cfg.tp) != 2 or min(cfg.tp) <= 0):
        raise ValueError(f"--tp RxC: two positive sizes, got {cfg.tp}")
    tp = cfg.tp[0] * cfg.tp[1] if grid else cfg.tp
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {cfg.dtype!r}")
    if cfg.micro_batches <= 0 or cfg.batch % cfg.micro_batches:
        raise ValueError(f"batch ({cfg.batch}) is not divisible into {cfg.micro_batches} micro-batches")
    if not cfg.max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {cfg.max_grad_norm}")
    if cfg.zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be a ZeRO stage 0-3, got {cfg.zero}")
    if cfg.dtype != "fp32" and (cfg.dp > 1 or cfg.zero) and (cfg.zero < 2 or cfg.sequence_parallel):
        raise ValueError(
            f"--dtype {cfg.dtype} with data parallelism needs --zero 2 or 3 and no --sequence-parallel "
            "(FSDP2's mixed precision; see tplayers.data_parallel)"
        )
    if cfg.batch % (cfg.dp * cfg.micro_batches):
        raise ValueError(
            f"batch ({cfg.batch}) is not divisible into {cfg.dp} replicas x {cfg.micro_batches} micro-batches"
        )
    if cfg.pp > 1 and (cfg.dp > 1 or cfg.zero) and cfg.zero < 2:
        raise ValueError("--pp with data parallelism needs --zero 2 or 3 (FSDP2, which the schedules drive)")
    if cfg.pp > 1 and cfg.layers < cfg.pp:
        raise ValueError(f"layers ({cfg.layers}) must be at least pp ({cfg.pp})")
    pipeline_microbatches = max(cfg.pp, cfg.micro_batches)
    if cfg.pp > 1 and cfg.batch % (cfg.dp * pipeline_microbatches):
        raise ValueError(
            f"batch ({cfg.batch}) is not divisible into {cfg.dp} replicas x {pipeline_microbatches} micro-batches"
        )
    if cfg.cp > 1 and grid:
        raise ValueError("--cp with a 2-D --tp grid is not supported")
    for name in ("dp", "pp", "cp", "steps", "layers", "hidden", "heads", "kv_heads", "ffn", "batch", "seq"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(cfg, name)}")
    if tp <= 0:
        raise ValueError(f"tp must be positive, got {cfg.tp}")
    # heads, kv heads, ffn and the vocabulary need not divide tp: parallelize splits them unevenly
    # and refuses, naming it, only what cannot be split (a rank with no head)
    if cfg.hidden % cfg.heads:
        raise ValueError(f"hidden ({cfg.hidden}) is not divisible by heads ({cfg.heads})")
    if cfg.heads % cfg.kv_heads:
        raise ValueError(f"heads ({cfg.heads}) is not divisible by kv_heads ({cfg.kv_heads})")
    if cfg.save_every < 0 or (cfg.save_every and not cfg.save):
        raise ValueError(f"--save-every {cfg.save_every} needs --save and a positive count")
    if cfg.keep < 1:
        raise ValueError(f"--keep {cfg.keep}: at least the last checkpoint must be kept")
    if cfg.resume and last_checkpoint(cfg.resume) is None:
        raise ValueError(f"--resume {cfg.resume}: no checkpoint folder there ({STEP_PREFIX}<n>, written by --save)")
    split, over = (cfg.tp[0], "tp_r") if grid else (tp, "the tensor-parallel size")
    if cfg.sequence_parallel and cfg.seq < split:  # any length splits, one token at least for each rank
        raise ValueError(f"seq ({cfg.seq}) is shorter than {over} ({split}): a rank would hold no token")
    return tplayers.launch(train_on_rank, cfg.dp * cfg.pp * cfg.cp * tp, cfg)[0]


CSV_COLUMNS = ("step", "loss_tp", "loss_unsharded", "loss_fp64", "tp_vs_fp64", "unsharded_vs_fp64")


def write_report(report: dict, out_dir) -> list:
    """loss.csv and, where matplotlib is installed, loss.png; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = zip(report["losses"], report["unsharded_losses"], report["exact_losses"], report["sharded_vs_exact"],
               report["unsharded_vs_exact"], strict=True)  # fmt: skip
    csv = out / "loss.csv"
    csv.write_text(",".join(CSV_COLUMNS) + "\n" + "".join(f"{i},{','.join(map(str, r))}\n" for i, r in enumerate(rows)))
    written = [csv]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'tplayers[bench]'): loss.png not written")
        return written
    tp = f"TP={tp_label(report['config']['tp'])}"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6.5), sharex=True, height_ratios=(3, 2))
    top.plot(report["unsharded_losses"], label="unsharded fp32", linewidth=3, alpha=0.5)
    top.plot(report["losses"], label=f"{tp} {report['config']['dtype']}", linestyle="--")
    top.set(ylabel="cross-entropy (nats / byte)", title="tplayers demo: Llama-style model")
    top.legend()
    # how far each run is from the exact answer: the sharded run should sit where the unsharded one does
    floor = 1e-12  # a zero distance (step 0) drawn at the bottom of the log scale
    bottom.semilogy([max(d, floor) for d in report["unsharded_vs_exact"]], label="unsharded fp32", linewidth=3,
                    alpha=0.5)  # fmt: skip
    bottom.semilogy([max(d, floor) for d in report["sharded_vs_exact"]], label=tp, linestyle="--")
    bottom.set(xlabel="step", ylabel="|loss - fp64 loss|", title="distance from the unsharded fp64 run")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    return [*written, out / "loss.png"]


def _median(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def summary(report: dict) -> str:
    losses = report["losses"]
    sharded, unsharded = report["sharded_vs_exact"], report["unsharded_vs_exact"]
    return "\n".join(
        [
            f"loss: {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps",
            f"tokens/s (TP ranks, fwd+bwd+step): {report['tokens_per_s']:,.0f}",
            f"bytes sent per rank per step by the TP layers: {report['bytes_per_step']:,}",
            f"parameters {report['config']['dtype']}; steps skipped on overflow: {report['skipped_steps']}, "
            f"final loss scale {report['final_scale']:g}",
            f"agrees with the unsharded fp32 run to {report['agree_tol']:g} for {report['agree_steps']} steps "
            f"(largest |loss difference| there: {report['max_loss_diff_while_agreeing']:.3g})",
            f"largest |loss difference| vs unsharded over all steps: {report['max_loss_diff']:.3g}",
            f"largest |parameter difference| vs unsharded at the end: {report['max_param_diff']:.3g}",
            "distance from the exact answer (the unsharded model trained in fp64), |loss - fp64 loss| median / "
            f"largest over the steps: sharded {_median(sharded):.3g} / {max(sharded):.3g}, "
            f"unsharded fp32 {_median(unsharded):.3g} / {max(unsharded):.3g} "
            f"(ratio of the medians {_median(sharded) / max(_median(unsharded), 1e-30):.2g})",
            "largest |parameter difference| from the fp64 run at the end: "
            f"sharded {report['max_param_diff_vs_exact']:.3g}, "
            f"unsharded fp32 {report['unsharded_param_diff_vs_exact']:.3g} "
            "(fp32 rounding, amplified by training, moves both fp32 runs from the exact one alike)",
            "model state per rank (rank 0): "
            + ", ".join(f"{k} {v:,} B" for k, v in report["model_state_bytes"].items())
            + f" (ZeRO stage {report['config']['zero']} over {report['config']['dp']} replicas"
            + (f", one of {report['config']['pp']} pipeline stages)" if report["config"]["pp"] > 1 else ")"),
        ]
    )
