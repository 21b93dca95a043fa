"""`PipelineStage(module, stage_index, num_stages, group=...)`: torch.distributed.pipelining's
stage, with its parameters entered in the placement record (the pipeline group), so that
`clip_grad_norm_` and `DynamicLossScaler` combine every stage without being told.

Stages are looped over the ranks of the pipeline group: stage i lives on rank i % n (one stage
per rank, or `num_stages / n` of them for the interleaved schedules).
"""

import torch
import torch.distributed as dist
from torch import nn

from tplayers.distributed import resolve_group
from tplayers.functional import comm
from tplayers.placement import get_placement, refuse_overlap, seal, update_placement
from tplayers.state import set_state


def _counted_sends(get_ops, group):
    """torch's stage method returning a micro-batch's send ops, their tensors counted as pipeline
    bytes (`tplayers.count_bytes`)."""

    def counted(chunk_id):
        ops = get_ops(chunk_id)
        for op in ops:
            if op.op is dist.isend:
                comm.record("send", op.tensor, group, "pp")
        return ops

    return counted


class PipelineStage:
    """Stage `stage_index` of `num_stages`, computed by `module` on this rank of `group`
    (ProcessGroup or 1-D DeviceMesh such as `init_mesh(pp=2, tp=2)["pp"]`; None: every rank).

    `tied`: parameters this stage shares with another stage on another rank (tied input /
    output embeddings): after each schedule step their gradients are summed over the pipeline
    group, as Megatron does, so both copies take the same step; `counted_here=False` on all but
    one copy keeps the global norm from counting them twice (`tplayers.pipeline_split` sets both)."""

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, *, group=None, tied=(), counted_here=True):
        pg = resolve_group(group)
        refuse_overlap(module.parameters(), pg, "PipelineStage", ("tp", "dp"),
                       "its ranks hold the same stage's shards or replicas, not stages (pass mesh['pp'])",
                       role="the pipeline group")  # fmt: skip
        n, rank = dist.get_world_size(pg), dist.get_rank(pg)
        if not isinstance(num_stages, int) or num_stages < 1 or num_stages % n:
            raise ValueError(
                f"PipelineStage: num_stages ({num_stages}) must be a positive multiple of the pipeline ranks ({n})"
            )
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index {stage_index} is outside 0..{num_stages - 1}")
        if stage_index % n != rank:
            raise ValueError(
                f"PipelineStage: stage {stage_index} of {num_stages} belongs on pipeline rank {stage_index % n}, "
                f"not {rank} (stages are looped over the ranks)"
            )
        replicas = [get_placement(p) for p in module.parameters()]
        if any(r is not None and r.dp_group is not None and not r.dp_sharded and not r.grad_summed for r in replicas):
            raise ValueError(
                "PipelineStage: the module is data-parallel at ZeRO stage 0 or 1 (DDP), whose gradient sync cannot "
                "follow a schedule's interleaved forwards and backwards; use tplayers.data_parallel(..., zero_stage=2 "
                "or 3) on pipeline stages (FSDP2, which torch's schedules drive)"
            )
        device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else torch.device("cpu")
        )
        self.module, self.stage_index, self.num_stages, self.group = module, stage_index, num_stages, pg
        self.tied, self.device = list(tied), device
        self.reset()
        for p in module.parameters():
            update_placement(p, pp_group=pg)
        for p in self.tied:
            if not counted_here:
                update_placement(p, counted_by_another_stage=True)
        if self.tied:
            set_state(module, tied_across_stages=True)  # data_parallel refuses ZeRO over it
        seal(module)

    def reset(self):
        """A new torch stage: it infers the shapes it receives and sends from its first step, so
        a schedule calls this on every stage when the micro-batch shape changes."""
        # torch.distributed.pipelining imports triton: imported here, so that `import tplayers` does not
        from torch.distributed.pipelining import PipelineStage as TorchPipelineStage

        self.torch_stage = TorchPipelineStage(
            self.module, self.stage_index, self.num_stages, self.device, group=self.group
        )
        for name in ("get_fwd_send_ops", "get_bwd_send_ops"):  # activations and their gradients
            setattr(self.torch_stage, name, _counted_sends(getattr(self.torch_stage, name), self.group))

    def tell_batch(self, shape):
        """The schedule tells every stage, on every rank, the shape of the micro-batch entering the
        first stage, before each step and each shape check; passed on to a module that defines
        `set_pipeline_batch(shape)` (a context-parallel decoder stage: the sequence length decides
        which tokens each rank holds, and a stage past the first receives only its share)."""
        setter = getattr(self.module, "set_pipeline_batch", None)
        if setter is not None:
            setter(tuple(shape))

    def check_batch(self, x) -> str | None:
        """The first stage's module's refusal of the batch `x` (None: accepted), from its
        `check_pipeline_batch(x)` where it defines one; the schedule raises it on every rank."""
        check = getattr(self.module, "check_pipeline_batch", None)
        return check(x) if check is not None else None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def parameters(self):
        return self.module.parameters()

    def __repr__(self):
        return f"PipelineStage({self.stage_index} of {self.num_stages}, {type(self.module).__name__})"
