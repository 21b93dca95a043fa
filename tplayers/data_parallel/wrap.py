"""`data_parallel(module, group=..., zero_stage=...)`: data parallelism over the replicas in
`group`, composed with the tensor-parallel layers inside `module`, on torch.distributed's own
engines:

    stage 0  composable DDP (`replicate`): every replica holds everything; gradients averaged in
             buckets, each bucket's all-reduce overlapped with the rest of backward
    stage 1  stage 0 + the optimizer state sharded over the replicas (torch's
             ZeroRedundancyOptimizer, built by `data_parallel_optimizer`)
    stage 2  FSDP2 `fully_shard(reshard_after_forward=False)`: gradients reduce-scattered and the
             optimizer state sharded; parameters whole from forward until after backward
    stage 3  FSDP2 `fully_shard`: parameters sharded too, all-gathered block by block for forward
             and for backward, the next block's gather prefetched while the current one computes

Each decoder block (the items of the model's largest nn.ModuleList) is one FSDP unit, the rest of
the model (embeddings, final norm, LM head; tied weights stay tied) the root's.

What tplayers adds is the composition, through each parameter's placement record:

- the record survives FSDP2 turning parameters into DTensors over the replicas, and says which
  replicas a parameter is sharded over, so `clip_grad_norm_` sums the shards' norms over them
  and the loss scaler agrees on an overflow over them;
- replicated weights that see part of the sequence under sequence parallelism (norms) get their
  gradient summed over the TP group by a hook on the parameter as it is computed; FSDP2 computes
  on its own unsharded copies, where that hook would never fire, so these weights (a few vectors
  per block) stay out of FSDP2 (`ignored_params`), whole on every rank, and the same hook then
  averages them over the replicas;
- `train_step(dp_group=...)` on a wrapped model, a module wrapped twice, a data-parallel group
  that overlaps a tensor-parallel one, and an optimizer built before a ZeRO 2-3 wrap (it would
  step tensors the model no longer uses) are errors.
"""

import inspect
from dataclasses import fields

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# FSDP2's custom-collective interface (`set_custom_all_gather` / `set_custom_reduce_scatter` are
# public; the base classes they take are not exported elsewhere in torch 2.13)
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tplayers.data_parallel.compress import Compression, Compressor, compressed_mean
from tplayers.distributed import context_data_group, expert_data_group, resolve_group
from tplayers.functional import comm
from tplayers.nn.experts import ParallelExperts
from tplayers.placement import get_placement, refuse_overlap, seal, update_placement
from tplayers.state import set_state, state_of

STAGES = (0, 1, 2, 3)


def _mesh_and_group(group) -> tuple[DeviceMesh, dist.ProcessGroup]:
    if isinstance(group, DeviceMesh):
        return group, resolve_group(group)
    pg = resolve_group(group)
    device_type = "cuda" if dist.get_backend(pg) == "nccl" else "cpu"
    return DeviceMesh.from_group(pg, device_type), pg


def _check(module, pg, stage):
    """Every rank checks the same things before any collective, so all raise together."""
    if stage not in STAGES:
        raise ValueError(f"data_parallel: zero_stage must be one of {STAGES}, got {stage!r}")
    if state_of(module).data_parallel is not None:
        stage_before = state_of(module).data_parallel[1]
        raise ValueError(f"data_parallel: {type(module).__name__} is already data-parallel (zero_stage {stage_before})")
    if state_of(module).tied_across_stages and dist.get_world_size(pg) > 1:
        # FSDP2 would shard the copy on one stage's ranks and not the other's (which the sum over
        # the pipeline of the tied gradients assumes alike): silently wrong, found by check_parallel.
        raise ValueError(
            f"data_parallel: this pipeline stage ({type(module).__name__}) shares parameters with another stage "
            "(tied input / output embeddings), whose gradients are summed over the pipeline as whole tensors; "
            "data parallelism over such stages is not supported: untie them (config.tie_word_embeddings=False) "
            "or train the pipeline without replicas"
        )
    refuse_overlap(module.parameters(), pg, "data_parallel", ("tp", "pp"),
                   "replicas must hold the same shards of the same stage (use init_mesh(dp=..., tp=..., pp=...) "
                   "and pass mesh['dp'])", role="the data-parallel group")  # fmt: skip


def _check_experts(experts, pg, stage):
    """Expert-parallel layers: their expert groups inside the data-parallel group (expert
    parallelism folds over the replicas), their replicas known; under ZeRO-1 one expert group
    (the optimizer's state is sharded over its replicas, which hold the same experts)."""
    members = set(dist.get_process_group_ranks(pg))
    for m in experts:
        ep = dist.get_process_group_ranks(m.expert_group)
        if not set(ep) <= members:
            raise ValueError(
                f"data_parallel: the expert group {ep} of {type(m).__name__} is not inside the data-parallel group "
                f"{sorted(members)}: expert parallelism folds over the replicas (tplayers.init_mesh(dp=..., ep=...))"
            )
        expert_data_group(pg, m.expert_group)  # raises, naming init_mesh, where the mesh does not give it
    groups = {tuple(dist.get_process_group_ranks(m.expert_group)) for m in experts}
    if stage == 1 and len(groups) > 1:
        raise ValueError(
            f"data_parallel: ZeRO-1 with experts over several expert groups {sorted(groups)} is not supported (the "
            "optimizer's state is sharded over the replicas of one); use zero_stage 0, 2 or 3"
        )


def _expert_units(module) -> list[tuple[nn.Module, ParallelExperts]]:
    """(unit, layer) for each expert-parallel layer: the unit reduced over the experts' own
    replicas is the layer, or the outermost LoRA wrapper around it (peft's ParamWrapper: its
    adapters' factors are the experts' too, `tplayers.hf.lora_experts`)."""
    parents = {id(child): parent for parent in module.modules() for child in parent.children()}
    out = []
    for m in module.modules():
        if isinstance(m, ParallelExperts) and m.expert_group is not None:
            unit = m
            while id(unit) in parents and getattr(parents[id(unit)], "base_layer", None) is unit:
                unit = parents[id(unit)]
            out.append((unit, m))
    return out


def _check_expert_adapters(module, stage):
    """LoRA on experts parametrizes the experts' weights while they run (peft's ParamWrapper),
    which FSDP2's own swapping of the same parameters does not compose with."""
    wrapped = [type(m.base_layer).__name__ for m in module.modules() if hasattr(m, "parameter_name")
               and hasattr(m, "base_layer")]  # fmt: skip
    if wrapped and stage >= 2:
        raise ValueError(
            f"data_parallel: ZeRO-{stage} with LoRA on experts' parameters ({wrapped[0]}, peft's target_parameters) "
            "is not supported: FSDP2 and peft's parametrization both replace the parameter; use zero_stage=0"
        )


def _check_mixed_precision(module, stage, param_dtype):
    if stage < 2:
        raise ValueError(
            f"data_parallel: param_dtype needs ZeRO stage 2 or 3 (FSDP2's mixed precision), got stage {stage}; "
            "train in fp32 at stages 0-1"
        )
    if param_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"data_parallel: param_dtype must be torch.bfloat16 or torch.float16, got {param_dtype}")
    low = [n for n, p in module.named_parameters() if p.dtype != torch.float32]
    if low:
        raise ValueError(
            f"data_parallel(param_dtype=...): keep the model in fp32 (its shards are the masters); {low[0]} is not"
        )
    summed = [n for n, p in module.named_parameters() if getattr(get_placement(p), "grad_summed", False)]
    if summed:
        raise ValueError(
            f"data_parallel(param_dtype=...): {summed[0]} is summed over the TP group by its own hook (sequence "
            "parallelism), which FSDP2's 16-bit copies bypass; use param_dtype without sequence_parallel"
        )


def sharding_units(module) -> list[nn.Module]:
    """The blocks of the model's largest nn.ModuleList (its decoder layers), or none."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m)]
    return list(max(lists, key=len)) if lists else []


def _average_after_reduce(params, group):
    """FSDP2's hook after a unit's gradient reduction: the mean over the replicas of the
    gradients of `params`, the unit's weights kept out of FSDP2 (summed over TP by their own
    hook). It runs when the engine reduces, once per step under accumulation (train_step's
    `set_requires_gradient_sync`) and in pipeline schedules (which reduce after the last
    micro-batch), with the micro-batches' gradients accumulated."""
    n = dist.get_world_size(group)

    def hook(_reduce_output):
        for p in params:
            if p.grad is not None:
                comm.all_reduce(p.grad, group, axis="dp")
                p.grad.div_(n)

    return hook


def _keep_whole_while_accumulating(module):
    """ZeRO-2 (parameters whole from forward until after backward): while `train_step`
    accumulates micro-batches without a reduction, the parameters stay whole from the first
    micro-batch's gather to the last one's backward: one gather per step, in the memory ZeRO-2
    already holds (ZeRO-3 gathers per micro-batch, its point)."""
    engine = module.set_requires_gradient_sync

    def set_requires_gradient_sync(requires_gradient_sync: bool, *args, **kwargs):
        module.set_reshard_after_backward(bool(requires_gradient_sync))
        return engine(requires_gradient_sync, *args, **kwargs)

    set_requires_gradient_sync.__doc__ = engine.__doc__
    module.set_requires_gradient_sync = set_requires_gradient_sync


def _counted_all_reduce(group, bucket):
    """DDP's own all-reduce of a gradient bucket (the mean), counted as data-parallel bytes."""
    comm.record("all_reduce", bucket.buffer(), group, "dp")
    return default_hooks.allreduce_hook(group, bucket)


class _CountedAllGather(AllGather):
    """FSDP2's all-gather of parameters, counted as data-parallel bytes."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        comm.record("all_gather", output_tensor, group, "dp")
        return comm.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of gradients, counted as data-parallel bytes."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        comm.record("reduce_scatter", input_tensor, group, "dp")
        return comm.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _refuse_stale_optimizer(optimizer, args, kwargs):
    """A global optimizer step pre-hook: an optimizer holding a parameter that a ZeRO 2-3 wrap
    took off its module would step a tensor nothing uses, silently."""
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            name = state_of(p).replaced_by
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds {name}, which data_parallel replaced with its sharded form: "
                    "build the optimizer after wrapping (tplayers.data_parallel_optimizer)"
                )


_stale_hook = None


def data_parallel(
    module: nn.Module, *, group=None, zero_stage: int = 0, param_dtype=None, bucket_cap_mb: float = 25.0,
    compress=None,
) -> nn.Module:  # fmt: skip
    """Make `module` data-parallel over `group` (ProcessGroup or 1-D DeviceMesh, e.g.
    `init_mesh(dp=2, tp=2)["dp"]`; None: every rank) at `zero_stage` 0-3 (module docstring), in
    place; returns it. Build the optimizer afterwards, with `data_parallel_optimizer`.

    A context-parallel model (`parallelize(context_group=)`) is reduced over dp x cp (the group
    `init_mesh(dp=..., cp=...)` made), also at dp = 1: every rank of both holds the same weights.

    16-bit training (ZeRO 2-3): keep the model in fp32 and pass `param_dtype=torch.bfloat16` (or
    fp16): FSDP2 computes forward and backward with 16-bit copies of the parameters it gathers,
    reduces gradients in fp32, and the fp32 shards it keeps are the master weights (each replica
    holds 1/dp of them). `MixedPrecisionOptimizer` on a data-parallel model is refused.

    `compress`: "bf16" (any stage; at 2-3 FSDP2's reduce dtype, parameters still gathered in
    their own dtype), "int8", "topk:<fraction>" or "powersgd:rank=<r>[,start=<step>]" (stages
    0-1, with error feedback), or a `Compression`; see `tplayers.data_parallel.compress`. The
    compressor is `tplayers.state.state_of(module).compressor` (its residuals, PowerSGD's state) at stages 0-1."""
    global _stale_hook
    mesh, pg = _mesh_and_group(group)
    context, data_group = state_of(module).context, pg
    if context is not None:  # a context-parallel model: its weights' replicas are dp x cp
        pg = context_data_group(pg, context.group)
        mesh = DeviceMesh.from_group(pg, mesh.device_type)
    compression = Compression.parse(compress)
    if compression is not None:
        compression.check_stage(zero_stage)
    _check(module, pg, zero_stage)
    if param_dtype is not None:
        _check_mixed_precision(module, zero_stage, param_dtype)
    records = {name: get_placement(p) for name, p in module.named_parameters()}
    units = _expert_units(module)
    experts = [m for _, m in units]
    _check_experts(experts, pg, zero_stage)
    _check_expert_adapters(module, zero_stage)
    # Each expert's gradient sums its expert group's batches: the mean over every replica is the
    # mean over the expert's own replicas of it divided by the expert group's size (`grad_divisor`)
    if zero_stage <= 1:
        from torch.distributed._composable import replicate  # torch's composable DDP, in place

        for unit, m in units:  # over their own replicas, then the rest over every replica
            edp = expert_data_group(pg, m.expert_group)
            replicate(unit, process_group=edp, bucket_cap_mb=bucket_cap_mb)
            unit.register_comm_hook(edp, _counted_all_reduce)
            m.grad_divisor = dist.get_world_size(pg) // dist.get_world_size(edp)
            for p in unit.parameters():
                update_placement(p, dp_group=edp)
        replicate(module, process_group=pg, bucket_cap_mb=bucket_cap_mb, ignored_modules=[u for u, _ in units])
        if compression is None:
            module.register_comm_hook(pg, _counted_all_reduce)
        else:
            compressor = Compressor(compression, pg, list(module.parameters()))
            module.register_comm_hook(compressor, compressed_mean)
            set_state(module, compressor=compressor)
        for p in module.parameters():
            if getattr(get_placement(p), "ep_group", None) is None:
                update_placement(p, dp_group=pg)
    else:
        summed = [p for p in module.parameters() if getattr(get_placement(p), "grad_summed", False)]
        # a rank holding none of an uneven tensor-parallel split: nothing to shard (FSDP2 cannot
        # reduce-scatter an empty tensor), nothing to reduce
        empty = {p for p in module.parameters() if p.numel() == 0}
        old = dict(module.named_parameters())
        kwargs = dict(mesh=mesh, reshard_after_forward=zero_stage == 3, ignored_params=set(summed) | empty)
        reduce_dtype = torch.bfloat16 if compression is not None else torch.float32  # bf16: the only one here
        if param_dtype is not None or compression is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for m in experts:  # over their own replicas first: the blocks' units then leave them out
            edp = expert_data_group(pg, m.expert_group)
            fully_shard(m, **{**kwargs, "mesh": DeviceMesh.from_group(edp, mesh.device_type)})
            m.grad_divisor = dist.get_world_size(pg) // dist.get_world_size(edp)
        for unit in sharding_units(module):
            fully_shard(unit, **kwargs)
        fully_shard(module, **kwargs)
        for unit in module.modules():  # the root and every block: their collectives counted
            if isinstance(unit, FSDPModule):
                unit.set_custom_all_gather(_CountedAllGather())
                unit.set_custom_reduce_scatter(_CountedReduceScatter())
        for name, p in module.named_parameters():
            if p is not old[name]:  # FSDP2's DTensor over the replicas: the record goes with it
                set_state(old[name], replaced_by=name)
                if records[name] is not None:  # the whole record: TP placement, pipeline group, ...
                    update_placement(p, **{f.name: getattr(records[name], f.name) for f in fields(records[name])})
                expert_group = getattr(records[name], "ep_group", None)
                replicas = expert_data_group(pg, expert_group) if expert_group is not None else pg
                update_placement(p, dp_group=replicas, dp_sharded=True)
        for p in empty:
            update_placement(p, dp_group=pg)
        units = [*sharding_units(module), module]
        owner = {}
        for unit in units:  # each summed weight to the innermost unit holding it
            for p in unit.parameters():
                owner.setdefault(p, unit)
        for unit in units:  # after the hook that sums them over TP: the mean over the replicas
            own = [p for p in summed if owner[p] is unit]
            if own:
                unit.set_all_reduce_hook(_average_after_reduce(own, pg))
        for p in summed:
            update_placement(p, dp_group=pg)
        if zero_stage == 2:
            _keep_whole_while_accumulating(module)
        if _stale_hook is None:
            _stale_hook = register_optimizer_step_pre_hook(_refuse_stale_optimizer)
    # ZeRO-1 with experts: the optimizer's state sharded over the experts' own replicas, which hold
    # the same dense weights and the same experts (every replica would hold another's experts)
    sharded_over = expert_data_group(pg, experts[0].expert_group) if zero_stage == 1 and experts else pg
    set_state(module, data_parallel=(sharded_over, zero_stage))
    if context is not None:  # the parameters' own sums over cp stand down; the loss scales by cp
        context.reduced_by_data_parallel = True
        context.replica_group = data_group  # the batch's replicas (dp alone): what a Trainer splits rows over
    if any(get_placement(p) is not None for p in module.parameters()):
        seal(module)  # the records of FSDP2's new parameters, kept by their modules
    return module


def ZeRO3(module: nn.Module, *, group=None, **kwargs) -> nn.Module:  # noqa: N802 (the public name)
    """`data_parallel(module, group=group, zero_stage=3)`."""
    return data_parallel(module, group=group, zero_stage=3, **kwargs)


def _zero1(optimizer, wrapped, params):
    """torch's ZeroRedundancyOptimizer over the replicas (its broadcasts counted as the all-gather
    of the parameters they amount to)."""
    nbytes = sum(p.numel() * p.element_size() for p in params)
    optimizer.register_step_post_hook(lambda *_: comm.record("all_gather", nbytes, wrapped[0], "dp"))
    return optimizer


def shard_optimizer_state(module: nn.Module, optimizer):
    """ZeRO-1 for an optimizer built elsewhere (HF Trainer's): at stage 1, a ZeroRedundancyOptimizer
    of the same class, hyperparameters and param groups, its state sharded over the replicas;
    at the other stages (and for an optimizer already sharded) `optimizer` itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    wrapped = state_of(module).data_parallel
    if wrapped is None or wrapped[1] != 1 or isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if optimizer.state:
        raise ValueError("shard_optimizer_state: the optimizer has stepped; shard it before its first step")
    accepted = inspect.signature(type(optimizer).__init__).parameters  # AdamW's defaults hold a key it refuses
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [{k: v for k, v in g.items() if k == "params" or k in accepted} for g in optimizer.param_groups]
    params = [p for g in groups for p in g["params"]]
    sharded = ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=wrapped[0], **defaults)
    return _zero1(sharded, wrapped, params)


def data_parallel_optimizer(module: nn.Module, optimizer_class, **kwargs):
    """The optimizer for a (data-parallel) module's trainable parameters (a frozen base under
    LoRA adapters holds no state and is not moved), the same call at every stage: stage 1 shards
    its state over the replicas (ZeroRedundancyOptimizer around `optimizer_class`); the other
    stages build `optimizer_class(trainable parameters, **kwargs)` (ZeRO 2-3 parameters are
    already shards, so their state is too)."""
    wrapped = state_of(module).data_parallel
    params = [p for p in module.parameters() if p.requires_grad]
    if wrapped is not None and wrapped[1] == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=wrapped[0], **kwargs)
        return _zero1(optimizer, wrapped, params)
    return optimizer_class(params, **kwargs)
