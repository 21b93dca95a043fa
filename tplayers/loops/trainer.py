"""`tplayers.hf.Trainer`: HF's Trainer on a model tplayers parallelized, and
`parallel_trainer(cls)`: the same for any Trainer subclass (TRL's SFTTrainer, DPOTrainer, ...).

An unmodified Trainer trains such a model wrongly without an error (DDP broadcasts rank 0's
shards, each rank reads its own rows, clipping uses each rank's local norm, checkpoints hold
rank 0's shards). What changes here, each at the Trainer's own extension points:

- the accelerator becomes a `ParallelAccelerator` (`accelerate.py`): no DDP, rows per replica,
  the global gradient norm (clipped and logged), accumulation through the data-parallel engines'
  sync switch, metrics and predictions gathered once per replica (also where a subclass gathers
  with `gather`, as Seq2SeqTrainer does), fp16 overflows agreed on by every rank;
- `get_tp_size` is the number of ranks that read each batch, which the Trainer already divides
  its token counts, batch sizes and loss scaling by;
- `save_model` writes the HF checkpoint from every rank cooperatively (`save_pretrained`: full
  tensors under HF's names, a peft model's adapter as peft writes it): call it on every rank;
- `save_strategy` checkpoints hold a tplayers sharded checkpoint in `checkpoint-N/tplayers`
  (model, optimizer, scheduler, loss scaler, each rank's RNG) beside the Trainer's own
  `trainer_state.json` and RNG files; resuming reads it at any layout (`load_checkpoint`
  reshards), exactly at the same one;
- TRL's fused LM head, which would score labels against one rank's slice of the vocabulary, is
  computed from the model's whole logits instead (`trl.py`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

from tplayers.checkpoint import load_checkpoint, save_checkpoint, save_pretrained
from tplayers.checkpoint.api import MARKER
from tplayers.data_parallel import shard_optimizer_state
from tplayers.loops.accelerate import adopt
from tplayers.loops.replicas import replicas_of
from tplayers.loops.trl import unfuse_lm_head
from tplayers.placement import recorded_groups, spans_ranks
from tplayers.state import set_state, state_of

SHARDED = "tplayers"  # the sharded checkpoint's folder inside checkpoint-N


def _inner(optimizer):
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def _refuse_per_process_seeds(name: str, model: nn.Module) -> None:
    """A trainer that seeds each process apart (TRL's online trainers, GRPO / RLOO / distillation:
    `set_seed(seed, device_specific=True)`, for different completions per process) treats every
    process as a replica of its own: it gathers its rewards over every process (each replica's
    completions once per rank of its group, its groups of completions then misaligned across
    replicas) and keeps the slice of its process index. Refused, by name. (The completions
    themselves would be alike: `generate` samples from the group's first rank's stream.)"""
    groups = recorded_groups(list(model.parameters()), "tp")
    if not groups or dist.get_world_size(groups[0]) == 1:
        return
    seeds = [None] * dist.get_world_size(groups[0])
    dist.all_gather_object(seeds, torch.initial_seed(), group=groups[0])
    if len(set(seeds)) > 1:
        raise ValueError(
            f"{name} seeds each process apart (set_seed(device_specific=True), as TRL's GRPO / RLOO trainers do "
            "to sample different completions per process), treating every process as a replica: it gathers its "
            "rewards over every process, each replica's completions once per rank of its tensor-parallel group, "
            "and slices them by process index. tplayers does not run such online-generation trainers: generate "
            "outside the Trainer, or train with SFT / DPO"
        )


class ParallelTrainer:
    """The methods `parallel_trainer` puts before a Trainer class's own (module docstring)."""

    def __init__(self, model=None, *rest, **kwargs):  # every Trainer takes the model first; the rest as given
        name = type(self).__name__
        if model is None:
            raise ValueError(
                f"{name}: pass the parallelized model; model_init would build a new, unsharded model for each run"
            )
        if kwargs.get("peft_config") is not None:
            raise ValueError(
                f"{name}: peft_config would have peft wrap layers tplayers already sharded; add the adapters first "
                "(peft.get_peft_model before parallelize, or tplayers.get_peft_model after) and pass the peft model"
            )
        set_state(self, replicas=replicas_of(model, name))  # refusals before anything is built
        super().__init__(model, *rest, **kwargs)
        if (
            getattr(self.args, "train_sampling_strategy", None) == "batch_rebalance"
            and state_of(self).replicas.sharing > 1
        ):
            raise ValueError(
                f"{name}: train_sampling_strategy='batch_rebalance' assigns batches by process index, so the ranks of "
                "one tensor-parallel group would read different rows; use 'random', 'sequential' or 'group_by_length'"
            )
        _refuse_per_process_seeds(name, model)
        for value in list(vars(self).values()):  # the model, and a reference model beside it (DPO, GRPO, ...)
            if isinstance(value, nn.Module) and spans_ranks(value):
                unfuse_lm_head(value)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        adopt(self.accelerator, state_of(self).replicas)
        # the Trainer bound gather_for_metrics before the accelerator's class changed
        self.gather_function = functools.partial(
            self.accelerator.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
        )

    def evaluation_loop(self, *args, **kwargs):
        # Seq2SeqTrainer binds accelerate's `gather` just before: over every process, each row once per
        # rank of its replica (the predictions repeated tp times)
        if self.gather_function == self.accelerator.gather:
            self.gather_function = self.accelerator.gather_replicas
        return super().evaluation_loop(*args, **kwargs)

    def create_optimizer(self, model=None):
        """The Trainer's optimizer; at ZeRO-1 (`tplayers.data_parallel(..., zero_stage=1)`) with its
        state sharded over the replicas."""
        super().create_optimizer(model)
        self.optimizer = shard_optimizer_state(self.model, self.optimizer)
        return self.optimizer

    def get_tp_size(self) -> int:
        """The ranks that read each batch (one replica's tensor-parallel group)."""
        return state_of(self).replicas.sharing

    def _track_num_input_tokens(self, inputs):
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)  # summed over every rank: each replica's rows `sharing` times
        seen = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + seen // state_of(self).replicas.sharing

    # ---- saving ----

    def _scaler(self):
        return getattr(self.accelerator, "scaler", None)

    def _save_checkpoint(self, model, trial) -> None:
        set_state(self, checkpointing=True)  # the Trainer's save_model call inside writes the sharded checkpoint
        try:
            super()._save_checkpoint(model, trial)
        finally:
            set_state(self, checkpointing=False)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if state_dict is not None:
            raise ValueError(f"{type(self).__name__}._save: the weights come from the model's shards, not a state_dict")
        if state_of(self).checkpointing:
            everything = not self.args.save_only_model
            save_checkpoint(
                Path(output_dir) / SHARDED,
                model=self.model,
                optimizer=_inner(self.optimizer) if everything else None,
                scheduler=self.lr_scheduler if everything else None,
                scaler=self._scaler() if everything else None,
            )
            return
        save_pretrained(self.model, output_dir)  # every rank: each writes the tensors it gathered
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        import torch

        torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        pass  # in the sharded checkpoint, with the model

    def _save_scaler(self, output_dir: str) -> None:
        pass  # in the sharded checkpoint, with the model

    # ---- resuming ----

    def _sharded(self, checkpoint: str) -> Path:
        path = Path(checkpoint) / SHARDED
        if not (path / MARKER).is_file():
            raise ValueError(
                f"{type(self).__name__}: {checkpoint} holds no tplayers checkpoint ({SHARDED}/): it was not written by "
                "tplayers.hf.Trainer. A plain Trainer's checkpoint holds one rank's shards at best; load full HF "
                "weights into the model with tplayers.load_pretrained instead"
            )
        return path

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        path = self._sharded(resume_from_checkpoint)  # refused here, before training starts, if it is not ours
        if self.args.save_only_model:  # otherwise the weights come with the optimizer state, read once
            load_checkpoint(path, model=model if model is not None else self.model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self.args.save_only_model:
            return
        load_checkpoint(  # the model's weights with the optimizer state stored under their names
            self._sharded(checkpoint),
            model=self.model,
            optimizer=_inner(self.optimizer),
            scheduler=self.lr_scheduler,
            scaler=self._scaler(),
        )

    def _load_scaler(self, checkpoint: str | None) -> None:
        pass  # with the optimizer

    def _load_best_model(self) -> None:
        load_checkpoint(self._sharded(self.state.best_model_checkpoint), model=self.model)


@functools.cache
def parallel_trainer(cls: type) -> type:
    """`cls` (transformers.Trainer or a subclass, e.g. trl.SFTTrainer) for models tplayers
    parallelized: a subclass with ParallelTrainer's methods first (module docstring), the same
    arguments. `parallel_trainer(trl.SFTTrainer)(model=model, args=..., train_dataset=...)`."""
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise TypeError(f"parallel_trainer: {cls!r} is not a transformers.Trainer class")
    if issubclass(cls, ParallelTrainer):
        return cls
    return type(f"Parallel{cls.__name__}", (ParallelTrainer, cls), {"__doc__": cls.__doc__})


class Trainer(ParallelTrainer, transformers.Trainer):
    """`transformers.Trainer` for a model tplayers parallelized (TP, TP + SP, 2-D grids, TP x DP
    with `tplayers.data_parallel` at any ZeRO stage, peft LoRA): the same arguments, no extra
    call. See `tplayers.loops.trainer` for what differs."""
