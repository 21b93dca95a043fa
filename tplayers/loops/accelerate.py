"""accelerate on a parallelized model: `prepare(accelerator, model, optimizer, dataloader, ...)`.

accelerate treats every process as a data-parallel replica: it wraps the model in DDP (whose
constructor broadcasts rank 0's shards over the other ranks'), gives every process its own rows,
clips by each process's local norm and steps schedulers once per process. Under tensor
parallelism each of those is wrong without an error. `prepare` makes the accelerator a
`ParallelAccelerator` (the same object, its class extended, as `parallel_trainer` extends a
Trainer class) that reads the model's replicas from its placement records (`replicas.py`):

- models are prepared for autocast and compilation only: no DDP or FSDP around them (the replicas
  reduce through `tplayers.data_parallel`, which the records name);
- data loaders are sharded over the replicas: the ranks of one tensor-parallel group read the
  same rows, in the same order (accelerate's own `prepare_data_loader`, told the replicas);
- `clip_grad_norm_` is `tplayers.clip_grad_norm_`: the norm of the full gradient;
- `no_sync` switches the data-parallel engines' gradient sync (`set_requires_gradient_sync`);
- `gather_for_metrics` gathers over the replicas (one copy of each row), so the tail of an uneven
  evaluation set is trimmed as accelerate trims it; `gather_replicas` the same, untrimmed;
- schedulers step once per replica per optimizer step, as accelerate's do per process;
- fp16's GradScaler becomes `tplayers.DynamicLossScaler` with its settings: an overflow on any
  rank skips the step on every rank (GradScaler decides per rank, and the ranks would diverge);
- `save_state` / `load_state` write and read a tplayers sharded checkpoint (accelerate's own write
  the main process's state dicts: one rank's shards), and `get_state_dict` is the full state dict
  (`gather_state_dict`), which `save_pretrained(path, state_dict=...)` writes whole.

`gather` / `reduce` keep accelerate's meaning (over every process): the Trainer's token counts and
logged losses divide by the ranks sharing a batch (`Trainer.get_tp_size`).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType, DynamoBackend, recursively_apply
from torch import nn

from tplayers.checkpoint import load_checkpoint, save_checkpoint
from tplayers.hf import gather_state_dict
from tplayers.loops.replicas import Replicas, replicas_of
from tplayers.state import set_state, state_of
from tplayers.train import DynamicLossScaler, clip_grad_norm_
from tplayers.train.step import gradient_syncing_modules

_REFUSED_ENGINES = {
    DistributedType.FSDP: "FSDP",
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.MEGATRON_LM: "Megatron-LM",
}


def _gather_over(tensor: torch.Tensor, group) -> torch.Tensor:
    """accelerate's `gather` over `group`: the ranks' tensors concatenated along dim 0."""
    tensor = tensor[None] if tensor.ndim == 0 else tensor
    if group is None:
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


class ReplicaScheduler(AcceleratedScheduler):
    """accelerate's scheduler wrapper, stepping once per replica (not per process) per optimizer
    step when the batch is not split."""

    replicas: int = 1

    def step(self, *args, **kwargs):
        if not self.step_with_optimizer or self.split_batches or not self.gradient_state.sync_gradients:
            return super().step(*args, **kwargs)
        if any(opt.step_was_skipped for opt in self.optimizers):
            return None
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR: never past its last step
        for _ in range(self.replicas):
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)
        return None


class ParallelAccelerator:
    """The methods an accelerator gets from `prepare` (module docstring); placed before its own
    class in the method order."""

    def prepare_model(self, model: nn.Module, device_placement=None, evaluation_mode: bool = False):
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            raise ValueError(
                "accelerator.prepare: torch.compile (the Trainer's torch_compile=True, accelerate's dynamo_backend) "
                "of a model tplayers parallelized is not supported yet: its sharded layers' hooks and collectives do "
                "not trace; train it without compiling"
            )
        replicas = replicas_of(model, "accelerator.prepare")
        if replicas != state_of(self).replicas:
            raise ValueError(
                "accelerator.prepare: this model's replicas differ from those the accelerator was prepared for "
                f"({replicas} vs {state_of(self).replicas}); one accelerator serves models of one layout"
            )
        # evaluation_mode: autocast and torch.compile as configured, no DDP / FSDP wrapper
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        replicas = state_of(self).replicas
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=replicas.size,
            process_index=replicas.index,
            split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(),  # the sampler's generator: one order on every rank
            dispatch_batches=False,  # each rank reads its replica's rows itself (refused when asked, see adopt)
            even_batches=self.even_batches,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return prepared

    def prepare_optimizer(self, optimizer, device_placement=None):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):  # ZeRO-1: its state_dict is a collective; the
            device_placement = False  # state is made on the parameters' device at its first step anyway
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    def prepare_scheduler(self, scheduler):
        prepared = super().prepare_scheduler(scheduler)
        prepared.__class__ = ReplicaScheduler
        prepared.replicas = state_of(self).replicas.size
        return prepared

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        self.unscale_gradients()
        return clip_grad_norm_(list(parameters), max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self, model):
        modules = gradient_syncing_modules(model)
        for module in modules:
            module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for module in modules:
                module.set_requires_gradient_sync(True)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        group = state_of(self).replicas.group
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            tensors = True
        except TypeError:
            tensors = False
        if use_gather_object or not tensors:
            parts = [input_data]
            if group is not None:
                parts = [None] * dist.get_world_size(group)
                dist.all_gather_object(parts, input_data, group=group)
            data = [x for part in parts for x in (part if isinstance(part, list) else [part])]
        else:
            data = recursively_apply(_gather_over, input_data, group=group)
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # the last batch was padded with repeated rows
            trim = lambda t: t[: state.remainder]
            return trim(data) if isinstance(data, list) else recursively_apply(trim, data)
        return data

    def gather_replicas(self, input_data):
        """accelerate's `gather` over the replicas: one copy of each row, none trimmed. What a Trainer
        subclass gathering with `gather` (Seq2SeqTrainer: generated tokens) means over processes."""
        return recursively_apply(_gather_over, input_data, group=state_of(self).replicas.group)

    def get_state_dict(self, model, unwrap: bool = True):
        """The full state dict under the model's own names (every rank: a collective), which
        `save_pretrained(path, state_dict=...)` writes as a whole checkpoint."""
        return gather_state_dict(model)

    # accelerate's own save_state writes each model's state_dict from the main process: one rank's shards.
    def save_state(self, output_dir=None, safe_serialization: bool = True, **kwargs):
        """The model, optimizer, scheduler, loss scaler and each rank's RNG as a tplayers sharded
        checkpoint in `output_dir` (every rank; `load_state` reads it back at any layout)."""
        save_checkpoint(self._state_dir(output_dir, "save_state"), **self._state_parts("save_state"))
        return output_dir

    def load_state(self, input_dir=None, load_kwargs=None, **kwargs):
        load_checkpoint(self._state_dir(input_dir, "load_state"), **self._state_parts("load_state"))

    @staticmethod
    def _state_dir(path, caller):
        if path is None:
            raise ValueError(f"accelerator.{caller} on a parallelized model: pass the checkpoint directory")
        return path

    def _state_parts(self, caller) -> dict:
        if len(self._models) != 1 or len(self._optimizers) > 1 or len(self._schedulers) > 1 or self._custom_objects:
            raise ValueError(
                f"accelerator.{caller} on a parallelized model keeps one model with at most one optimizer and one "
                "scheduler (and no register_for_checkpointing objects); call tplayers.save_checkpoint / "
                "load_checkpoint for each model instead"
            )
        optimizer = self._optimizers[0].optimizer if self._optimizers else None
        scheduler = self._schedulers[0].scheduler if self._schedulers else None
        return dict(model=self._models[0], optimizer=optimizer, scheduler=scheduler, scaler=self.scaler)


def _scaler(scaler):
    """fp16: torch's GradScaler as a DynamicLossScaler with the same settings."""
    if scaler is None or isinstance(scaler, DynamicLossScaler) or not scaler.is_enabled():
        return scaler
    return DynamicLossScaler(
        init_scale=scaler.get_scale(),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
    )


@functools.cache
def _parallel_class(cls: type) -> type:
    return type(f"Parallel{cls.__name__}", (ParallelAccelerator, cls), {})


def adopt(accelerator: Accelerator, replicas: Replicas) -> Accelerator:
    """Make `accelerator` a ParallelAccelerator for models with `replicas` (in place)."""
    if isinstance(accelerator, ParallelAccelerator):
        if state_of(accelerator).replicas != replicas:
            raise ValueError("this accelerator was prepared for a model of another layout")
        return accelerator
    engine = _REFUSED_ENGINES.get(accelerator.distributed_type)
    if engine is not None:
        raise ValueError(
            f"accelerate's {engine} shards the model itself, over every rank, and would cut tensor-parallel shards "
            "again: leave it out of the accelerate config and use tplayers.data_parallel(model, group=mesh['dp'], "
            "zero_stage=...) for ZeRO"
        )
    if getattr(accelerator, "parallelism_config", None) is not None:
        raise ValueError(
            "accelerate's parallelism_config (its own tensor / context parallelism over DTensors) and a model "
            "tplayers parallelized cannot be combined: drop parallelism_config"
        )
    if accelerator.dispatch_batches:
        raise ValueError(
            "dispatch_batches=True makes rank 0 read every batch and send slices to all processes, tensor-parallel "
            "ranks included; leave it unset: each rank reads its replica's rows"
        )
    if accelerator._models:
        raise ValueError(
            "this accelerator has already prepared a model (wrapped in DDP, which overwrote the other ranks' shards "
            "with rank 0's): call tplayers.hf.prepare before accelerator.prepare"
        )
    accelerator.scaler = _scaler(accelerator.scaler)
    accelerator.__class__ = _parallel_class(type(accelerator))
    set_state(accelerator, replicas=replicas)
    return accelerator


def prepare(accelerator: Accelerator, *objects, **kwargs):
    """`accelerator.prepare(*objects, **kwargs)` for a model tplayers parallelized (any of
    `objects`; data loaders, optimizers and schedulers beside it), after making the accelerator
    a ParallelAccelerator (module docstring). Call it on every rank, instead of the first
    `accelerator.prepare`; the accelerator's other methods are then right for the model."""
    models = [o for o in objects if isinstance(o, nn.Module)]
    if not models:
        raise ValueError("tplayers.hf.prepare: pass the model (with its optimizer, data loaders, ...)")
    replicas = {replicas_of(m, "tplayers.hf.prepare") for m in models}
    if len(replicas) > 1:
        raise ValueError("tplayers.hf.prepare: the models' layouts differ; prepare each with its own accelerator")
    adopt(accelerator, replicas.pop())
    return accelerator.prepare(*objects, **kwargs)
