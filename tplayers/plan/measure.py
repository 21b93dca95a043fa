"""The measuring half of `tplayers plan --validate` (see `tplayers.plan.validate`): one training
step of each case on local CPU ranks, and what each rank holds and sends in it."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from tplayers.plan.layout import Assumptions, Layout
from tplayers.plan.specs import ModelSpec, Precision

# The model every default case trains: Llama-style (RMSNorm, SwiGLU, RoPE, no biases, no
# dropout), grouped-query attention with 2 kv heads, so tp = 4 replicates each kv head on two
# ranks. A vocabulary of 250, split unevenly at TP 4 (63, 63, 63, 61): tplayers pads nothing.
VALIDATION_MODEL = ModelSpec(
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    ffn_hidden=128,
    vocab=250,
    seq_len=32,
    gated_mlp=True,
    dropout=False,
    name="tiny-llama",
)
VALIDATION_ASSUMPTIONS = Assumptions(implementation="tplayers")
MICRO_BATCH = 2

# Bytes per parameter of what tplayers keeps, per training dtype (see the module docstring).
TPLAYERS_PRECISIONS = {
    "bf16": Precision(param_bytes=2, grad_bytes=4, optimizer_bytes=12, activation_bytes=2),
    "fp32": Precision.preset("fp32-adam"),
}
# Measured / plan activations of the default cases lie in [1.26, 1.67], the gap being HF's
# RMSNorm storage (see the module docstring): the one-sided band allows up to 1.75.
DEFAULT_ACTIVATION_RTOL = 0.75
# Pipeline cases: the ranks' mean idle share in [0.75, 2] x the formula's. Measured 0.86-1.48
# on 2 CPU cores (the default cases, four runs): the formula prices what stages send at zero and
# takes every stage as heavy as the others, while here each send costs a core some milliseconds
# (gloo's thread beside the compute) and the last stage adds the LM head and the loss; GPipe at
# m = 2p and interleaved (twice the sends) sit highest, at about 1.4.
DEFAULT_BUBBLE_RTOL = 1.0


# The model of the pipeline cases: 4 layers (pp x virtual stages up to 4), and wide enough that
# a micro-batch's compute dwarfs what a stage sends (the bubble formula prices sends at zero).
PIPELINE_VALIDATION_MODEL = replace(
    VALIDATION_MODEL, layers=4, hidden=128, ffn_hidden=512, seq_len=256, num_params=None, name="tiny-llama-pipeline"
)
PIPELINE_MICRO_BATCH = 4
PIPELINE_TRACED_STEPS = 3  # the quickest one's bubble is reported


@dataclass(frozen=True)
class ValidationCase:
    """One layout to train and check: `dtype` "bf16" (bf16 model, MixedPrecisionOptimizer over
    Adam) or "fp32" (fp32 model, Adam). recompute must be "none" (tplayers has no recomputation
    yet); ZeRO 1-3 (`tplayers.data_parallel`) trains in fp32. pp > 1: one schedule step of
    `tplayers.pipeline_split` stages (fp32, dp = 1), checked for its bubble and activations in
    flight; `model` then defaults to `PIPELINE_VALIDATION_MODEL`."""

    layout: Layout
    dtype: str = "bf16"
    model: ModelSpec | None = None  # None: the one `measure` is given

    def __post_init__(self):
        if self.dtype not in TPLAYERS_PRECISIONS:
            raise ValueError(f"ValidationCase.dtype must be one of {list(TPLAYERS_PRECISIONS)}, got {self.dtype!r}")
        lay = self.layout
        if lay.recompute != "none":
            raise ValueError(
                f"tplayers has no recomputation yet: validation needs recompute='none', not {lay.recompute!r}"
            )
        if lay.zero_stage and self.dtype != "fp32":
            raise ValueError(f"ZeRO cases train in fp32 (FSDP2's bf16 copies are not itemised), got {self.dtype}")
        if lay.pp > 1 and (lay.dp != 1 or self.dtype != "fp32"):
            raise ValueError(f"pipeline cases run at dp=1 in fp32, got {lay.describe()} {self.dtype}")

    @property
    def precision(self) -> Precision:
        return TPLAYERS_PRECISIONS[self.dtype]

    @property
    def name(self) -> str:
        lay = self.layout
        parts = (
            [f"tp{lay.tp_grid[0]}x{lay.tp_grid[1]}" if lay.tp_grid else f"tp{lay.tp}"]
            + ([f"dp{lay.dp}"] if lay.dp > 1 else [])
            + (["sp"] if lay.sequence_parallel else [])
        )
        if lay.pp > 1:
            v = f"v{lay.virtual_stages}" if lay.schedule == "interleaved" else ""
            parts.insert(0, f"pp{lay.pp} {lay.schedule}{v}")
        parts += [f"zero{lay.zero_stage}"] if lay.zero_stage else []
        if lay.num_microbatches > 1:
            parts.append(f"m{lay.num_microbatches}")
        return " ".join(parts + [self.dtype])


def _case(dtype="bf16", **layout) -> ValidationCase:
    return ValidationCase(Layout(micro_batch=MICRO_BATCH, **layout), dtype)


def _pipeline_case(**layout) -> ValidationCase:
    return ValidationCase(Layout(micro_batch=PIPELINE_MICRO_BATCH, **layout), "fp32", PIPELINE_VALIDATION_MODEL)


STEP_CASES = (
    _case(tp=1),
    _case(tp=2),
    _case(tp=2, sequence_parallel=True),
    _case(tp=2, num_microbatches=2),  # gradient accumulation: TP traffic twice, one DP reduction
    _case("fp32", tp=2),
    _case(tp=4),  # 4 ranks > 2 kv heads: k / v replicated, their gradients all-reduced
    _case(tp=4, sequence_parallel=True),
    _case(tp=2, dp=2, sequence_parallel=True),
    # ZeRO on tplayers.data_parallel: optimizer state partitioned (1), gradients (2), parameters (3)
    _case("fp32", tp=2, dp=2, zero_stage=1),
    _case("fp32", tp=2, dp=2, zero_stage=2),
    _case("fp32", tp=2, dp=2, zero_stage=3, sequence_parallel=True),  # norms whole, outside FSDP2
    # 3 replicas: FSDP2 pads 64 rows to 66, ZeRO-1 partitions whole tensors unevenly
    _case("fp32", tp=1, dp=3, zero_stage=1),
    _case("fp32", tp=1, dp=3, zero_stage=3),
    # 2-D grids (tplayers.hf.grid): bytes per axis, the blocks' shares of both weight dims
    _case(tp=(2, 2)),
    _case(tp=(2, 2), sequence_parallel=True),  # the sequence over tp_r: norm gradients summed there
    _case("fp32", tp=(1, 2), num_microbatches=2),
    _case("fp32", tp=(1, 2), dp=2, zero_stage=3),  # 3-D: ZeRO-3 over the replicas of a grid
)
# 8 ranks: `validate(GRID_CASES_8, nprocs_max=8)`
GRID_CASES_8 = (
    _case("fp32", tp=(2, 2), dp=2, zero_stage=3),
    _case("fp32", tp=(2, 2), dp=2, zero_stage=3, sequence_parallel=True),
)
# pipelines: the bubble and the micro-batches in flight per stage (GPipe m, 1F1B min(pp - i, m))
PIPELINE_CASES = (
    _pipeline_case(pp=2, num_microbatches=2, schedule="gpipe"),
    _pipeline_case(pp=2, num_microbatches=4, schedule="gpipe"),
    _pipeline_case(pp=2, num_microbatches=4, schedule="1f1b"),
    _pipeline_case(pp=2, num_microbatches=4, schedule="interleaved", virtual_stages=2),
    _pipeline_case(pp=2, tp=2, sequence_parallel=True, num_microbatches=2, schedule="1f1b"),
    _pipeline_case(pp=4, num_microbatches=2, schedule="gpipe"),  # fewer micro-batches than stages
    _pipeline_case(pp=2, tp=(1, 2), num_microbatches=2, schedule="1f1b"),  # stages of a 2-D grid model
    _pipeline_case(pp=2, tp=(2, 1), sequence_parallel=True, num_microbatches=2, schedule="1f1b"),
)
DEFAULT_CASES = STEP_CASES + PIPELINE_CASES


# ---------------------------------------------------------------------------------------------
# Measurement (on the ranks)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank measured in one training step, in bytes."""

    comm: int  # sent in the whole step
    comm_dp: int  # sent over the data-parallel axis (the gradient reduction, ZeRO's gathers)
    comm_by_kind: dict[str, int]  # all_reduce / all_gather / reduce_scatter / send
    params: int
    grads: int
    optimizer: int
    activations: int  # the largest of the micro-batches

    QUANTITIES = ("comm", "comm_tp", "comm_dp", "params", "grads", "optimizer", "activations")

    @property
    def comm_tp(self) -> int:
        return self.comm - self.comm_dp


@dataclass(frozen=True)
class PipelineRankMeasurement:
    """What one rank measured in one schedule step (`tplayers.pipeline.trace`)."""

    bubble: float  # idle share of the step: 1 - compute / step time
    in_flight: float  # most micro-batches (of this rank's layers) whose activations it held
    compute_seconds: float
    step_seconds: float


@dataclass(frozen=True)
class Measurement:
    """One case's measurements on each of its ranks (rank order: tp fastest, then dp)."""

    case: ValidationCase
    ranks: tuple[RankMeasurement, ...] | tuple[PipelineRankMeasurement, ...]
    seconds: float  # wall time of the slowest rank: build, parallelize, one step
    model: ModelSpec = VALIDATION_MODEL  # the model trained
    assumptions: Assumptions = VALIDATION_ASSUMPTIONS  # its vocabulary padding


def _hf_llama(spec: ModelSpec, vocab: int):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise ImportError("tplayers plan --validate trains a HuggingFace model: pip install 'tplayers[hf]'") from e
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn_hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.seq_len, tie_word_embeddings=spec.tied_embeddings,
        attention_bias=spec.linear_bias, mlp_bias=spec.linear_bias, attention_dropout=0.0,
        attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _check_model(spec: ModelSpec) -> None:
    """The measured model is an HF Llama: the ModelSpec must describe one."""
    llama = (
        spec.has_dims
        and spec.gated_mlp
        and spec.norm == "rmsnorm"
        and spec.position_embedding == "rope"
        and not spec.dropout
    )
    if not llama:
        raise ValueError(
            "validation trains a HuggingFace Llama: the ModelSpec needs dimensions, gated_mlp=True, "
            "norm='rmsnorm', position_embedding='rope' and dropout=False"
        )


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


class _SavedStorages:
    """saved_tensors_hooks that add up the distinct storages saved for backward, skipping the
    parameters' (the model's `parameters()` as they are when a tensor is saved: under ZeRO 2-3,
    FSDP2's gathered copies during forward): the activation memory held between forward and
    backward."""

    def __init__(self, model):
        self.model = model
        self.sizes: dict[int, int] = {}

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in {local_tensor(p).untyped_storage().data_ptr() for p in self.model.parameters()}:
            self.sizes[key] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def _new_groups(rank: int, layout: Layout):
    """Every rank of the world creates every TP and DP (or PP: pipeline cases have dp = 1) group
    of `layout` (ranks tp fastest), in the same order; returns this rank's (tp_group, dp_group or
    pp_group), or None if it is idle."""
    import torch.distributed as dist

    tp, dp = layout.tp, layout.dp * layout.pp
    if layout.tp_grid:  # a (dp, tp_r, tp_c) DeviceMesh: its groups, made by every rank of the world
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.arange(tp * dp).view(dp, *layout.tp_grid)
        mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "tp_r", "tp_c"))
        # its flattened group, made by every rank of the world now (members look it up later)
        mesh["tp_r", "tp_c"]._flatten("tp")
        return (mesh["tp_r", "tp_c"], mesh["dp"].get_group()) if rank < tp * dp else (None, None)
    mine = None, None
    tp_groups = [dist.new_group([d * tp + i for i in range(tp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * tp + i for d in range(dp)]) for i in range(tp)]
    if rank < tp * dp:
        mine = tp_groups[rank // tp], dp_groups[rank % tp]
    return mine


def _measure_step(case: ValidationCase, spec: ModelSpec, assumptions: Assumptions, seed: int, tp_group, dp_group):
    """Build, shard and train one step on this rank; returns its RankMeasurement."""
    import torch
    import torch.distributed as dist

    import tplayers
    from tplayers.functional import comm

    layout = case.layout
    vocab = spec.vocab  # as it is: tplayers splits it unevenly
    torch.manual_seed(seed)  # the same weights on every rank
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[case.dtype]
    model = _hf_llama(spec, vocab).to(dtype)
    tplayers.parallelize(model, group=tp_group, sequence_parallel=layout.sequence_parallel, vocab_parallel_logits=True)
    zero = layout.zero_stage
    if zero:  # the engines reduce the gradients themselves (counted: tplayers.count_bytes' "dp")
        tplayers.data_parallel(model, group=dp_group, zero_stage=zero)
    params = list(model.parameters())
    opt = tplayers.data_parallel_optimizer(model, torch.optim.Adam, lr=1e-3)
    if case.dtype != "fp32":
        opt = tplayers.MixedPrecisionOptimizer(opt)
    # Each DP replica its own batch, the same on the ranks of a TP group; tokens of the true
    # vocabulary, inputs and targets shifted by one (s positions each, as Megatron's data loader).
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank(dp_group))
    shape = (layout.num_microbatches, layout.micro_batch, spec.seq_len + 1)
    tokens = torch.randint(0, spec.vocab, shape, generator=gen)
    activations = 0
    with tplayers.count_bytes() as sent:
        for batch in tokens:
            saved = _SavedStorages(model)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                # the ids as a loader gives them (their own storage: at TP 1 the embedding keeps them)
                logits = model(batch[:, :-1].contiguous()).logits  # (b, s, V/tp)
                loss = tplayers.vocab_parallel_cross_entropy(logits, batch[:, 1:], group=tp_group, vocab_size=vocab)
            activations = max(activations, saved.total)
            (loss / layout.num_microbatches).backward()
        stepped = [p for group in opt.param_groups for p in group["params"]]  # the masters, if any
        for p in stepped if layout.dp > 1 and not zero else ():  # plain DDP: one all-reduce of every gradient
            if p.grad is not None:
                comm.all_reduce(p.grad, dp_group, axis="dp")
                p.grad.div_(layout.dp)
        held = {id(p): p for p in [*params, *stepped]}.values()
        grads = _held_bytes([p.grad for p in held if p.grad is not None], padded=zero >= 2)
        params_bytes = _held_bytes(params, padded=zero >= 2)
        opt.step()  # ZeRO-1's partitions sent to every replica
    model_ids = {id(p) for p in params}
    owned = sum(_nbytes(p) for p in stepped if id(p) not in model_ids)  # fp32 masters
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer: this replica's own optimizer
    states = [v for state in inner.state.values() for v in state.values() if _is_per_element(v)]
    owned += sum(_nbytes(local_tensor(v)) for v in states)
    opt.zero_grad(set_to_none=True)
    return RankMeasurement(
        comm=sent.total(),
        comm_dp=sent.by_axis()["dp"],
        comm_by_kind=dict(sent),
        params=params_bytes,
        grads=grads,
        optimizer=owned,
        activations=activations,
    )


def _measure_pipeline_step(case: ValidationCase, spec: ModelSpec, assumptions, seed: int, tp_group, pp_group):
    """Build, shard, split into stages and run one schedule step (after one to warm up) under
    `tplayers.pipeline.trace`; returns this rank's PipelineRankMeasurement."""
    import torch
    import torch.nn.functional as F

    import tplayers

    layout = case.layout
    torch.manual_seed(seed)
    model = _hf_llama(spec, spec.vocab)
    if layout.tp > 1:
        tplayers.parallelize(model, group=tp_group, sequence_parallel=layout.sequence_parallel, verify=False)
    v = layout.virtual_stages if layout.schedule == "interleaved" else 1
    stages = tplayers.pipeline_split(model, group=pp_group, virtual_stages=v)
    schedule_class = {
        "gpipe": tplayers.ScheduleGPipe,
        "1f1b": tplayers.Schedule1F1B,
        "interleaved": tplayers.ScheduleInterleaved1F1B,
    }[layout.schedule]

    def loss_fn(logits, tokens):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    schedule = schedule_class(stages if v > 1 else stages[0], layout.num_microbatches, loss_fn)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab, (layout.num_microbatches * layout.micro_batch, spec.seq_len), generator=gen)
    schedule.step(tokens, target=tokens)  # the first step also checks and infers the stages' shapes
    traces = []
    for _ in range(PIPELINE_TRACED_STEPS):
        with tplayers.pipeline.trace(schedule) as t:
            schedule.step(tokens, target=tokens)
        traces.append(t)
    t = min(traces, key=lambda t: t.step_seconds)  # the step the machine disturbed least
    return PipelineRankMeasurement(t.bubble, t.peak_in_flight, t.compute_seconds, t.step_seconds)


def _held_bytes(tensors, *, padded: bool) -> int:
    """Bytes of `tensors`; `padded` (ZeRO 2-3 on FSDP2): of the distinct storages their local
    shards live in, which hold each shard padded to ceil(rows / dp) rows (the gradients of one
    unit share one reduce-scatter buffer)."""
    if not padded:
        return sum(_nbytes(t) for t in tensors)
    storages = {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def local_tensor(t):
    from tplayers.placement import local_tensor as local

    return local(t)


def _is_per_element(value) -> bool:
    import torch

    return torch.is_tensor(value) and value.dim() > 0


def _measure_cases(rank, world_size, cases, spec, assumptions, seed):
    """On every rank of the world: each case on its first tp*dp ranks; None where idle."""
    import torch.distributed as dist

    out = []
    for case in cases:
        start = time.perf_counter()
        groups = _new_groups(rank, case.layout)
        result = None
        if groups[0] is not None:
            step = _measure_pipeline_step if case.layout.pp > 1 else _measure_step
            result = (step(case, case.model or spec, assumptions, seed, *groups), time.perf_counter() - start)
        dist.barrier()  # every rank is done with this case's groups before any is destroyed
        if result is not None and not case.layout.tp_grid:  # a mesh keeps its groups
            for g in {id(g): g for g in groups}.values():
                dist.destroy_process_group(g)
        out.append(result)
    return out


def _pool_entry(rank, world_size, group, cases, spec, assumptions, seed):
    """`WorkerPool.run` calls fn(rank, n, group, *args)."""
    return _measure_cases(rank, world_size, cases, spec, assumptions, seed)


def _resolve_cases(layouts, nprocs_max):
    if layouts is None:
        return [c for c in DEFAULT_CASES if c.layout.num_gpus <= nprocs_max]
    cases = [c if isinstance(c, ValidationCase) else ValidationCase(c) for c in layouts]
    too_big = [c.name for c in cases if c.layout.num_gpus > nprocs_max]
    if too_big:
        raise ValueError(f"layouts {too_big} need more than nprocs_max={nprocs_max} ranks")
    return cases


def measure(layouts=None, *, model=None, assumptions=None, nprocs_max=4, seed=0, pool=None) -> list[Measurement]:
    """Train one step of each case on local CPU ranks and return what each rank measured.

    `layouts`: ValidationCase or Layout (bf16) items, default `DEFAULT_CASES` (`STEP_CASES`, then
    `PIPELINE_CASES`) up to `nprocs_max`
    ranks. One launch runs every case (case by case, each on the first tp*dp ranks); `pool`, a
    `tplayers.testing.WorkerPool`, runs them on its ranks instead of starting new ones.
    """
    import tplayers

    spec = VALIDATION_MODEL if model is None else model
    _check_model(spec)
    assumptions = VALIDATION_ASSUMPTIONS if assumptions is None else assumptions
    cases = _resolve_cases(layouts, nprocs_max)
    if not cases:
        return []
    nprocs = max(c.layout.num_gpus for c in cases)
    if pool is not None:
        if pool.world_size < nprocs:
            raise ValueError(f"the pool has {pool.world_size} ranks; the cases need {nprocs}")
        per_rank = pool.run(_pool_entry, pool.world_size, cases, spec, assumptions, seed)
    else:
        per_rank = tplayers.launch(_measure_cases, nprocs, cases, spec, assumptions, seed)
    out = []
    for i, case in enumerate(cases):
        results = [per_rank[r][i] for r in range(case.layout.num_gpus)]
        ranks, seconds = tuple(m for m, _ in results), max(s for _, s in results)
        out.append(Measurement(case, ranks, seconds, case.model or spec, assumptions))
    return out
