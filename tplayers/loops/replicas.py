"""Who shares a batch: the data-parallel replicas of a parallelized model, read from its
placement records.

A training loop written for data parallelism (HF Trainer, accelerate) thinks of every process as
one replica with its own rows. Under tensor parallelism the ranks of one tensor-parallel group
hold parts of one model and must see the same rows, as do the ranks of a context-parallel group
(each splits the same rows' sequence); only the data-parallel replicas (`tplayers.data_parallel`'s
group) split them. The records name both groups, so nothing here is
guessed: a parameter without a record inside a parallelized model raises (`get_placement`), and
ranks that no record accounts for are refused rather than taken as replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from tplayers.placement import ranks_of, recorded_groups
from tplayers.state import state_of


@dataclass(frozen=True)
class Replicas:
    """This rank's place among the data-parallel replicas of a model."""

    size: int  # replicas: batches per optimizer step (each tensor-parallel group reads one)
    index: int  # which of them this rank belongs to
    group: dist.ProcessGroup | None  # the ranks holding this rank's shards in the other replicas
    sharing: int  # ranks that read each batch: the tensor-parallel group's size (x the context-parallel one)

    @property
    def parallel(self) -> bool:
        return self.size * self.sharing > 1


def replicas_of(model: nn.Module, caller: str) -> Replicas:
    """The replicas of `model` (parallelized by tplayers, or plain in a one-rank world). Refuses
    pipeline stages and worlds whose ranks the model's groups do not account for."""
    params = list(model.parameters())
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if recorded_groups(params, "pp"):
        raise ValueError(
            f"{caller}: the model is split into pipeline stages, which a schedule drives "
            "(tplayers.pipeline_split + ScheduleGPipe / Schedule1F1B / train_step); a Trainer runs the whole "
            "model's forward on every rank: give it a model parallelized with tensor (and data) parallelism only"
        )
    tp = recorded_groups(params, "tp")
    dp = recorded_groups(params, "dp")
    for kind, groups in (("tensor-parallel", tp), ("data-parallel", dp)):
        if len(groups) > 1:
            raise ValueError(
                f"{caller}: the parameters are placed over {len(groups)} {kind} groups "
                f"({', '.join(str(list(ranks_of(g))) for g in groups)}); one model takes one of each"
            )
    sharing = len(ranks_of(tp[0])) if tp else 1
    group = dp[0] if dp else None
    context = next((s for m in model.modules() if (s := state_of(m).context) is not None), None)
    if context is not None:  # the context-parallel ranks split one batch's sequence: they read the same rows
        sharing *= dist.get_world_size(context.group)
        group = context.replica_group  # the records' data-parallel group is dp x cp (data_parallel)
    size = len(ranks_of(group)) if group is not None else 1
    if size * sharing != world:
        hint = (
            "the other ranks would train their own copies on their own rows, never averaged: make the model "
            "data-parallel over the replicas first, tplayers.data_parallel(model, group=mesh['dp'], zero_stage=...)"
            if world % (size * sharing) == 0
            else "launch as many ranks as the model's groups hold"
        )
        raise ValueError(
            f"{caller}: {world} ranks, but the model's records account for {size * sharing} "
            f"({size} data-parallel replica(s) x {sharing} {'tensor- / context-' if context else 'tensor-'}parallel "
            f"rank(s)): {hint}"
        )
    index = dist.get_rank(group) if group is not None else 0
    return Replicas(size=size, index=index, group=group, sharing=sharing)
