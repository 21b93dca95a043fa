"""Guards where other libraries' data-parallel wrappers meet a tensor-parallel model.

torch's `DistributedDataParallel` (and FSDP1) synchronise a module by broadcasting rank 0's
parameters over their process group and averaging gradients over it. Over ranks that hold
different tensor-parallel shards (or pipeline stages), that overwrites every other rank's shards
with rank 0's and averages gradients of different tensors: a model that is no model, with no
error. Neither wrapper has an extension point to refuse a module, so their constructors are
wrapped (once, at `import tplayers`) to refuse, before any collective, a group that overlaps a
tensor-parallel or pipeline group the module's placement records name. Over the data-parallel
group (`mesh["dp"]`: every rank holding the same shards) they work as before; that is what
`tplayers.data_parallel` (composable DDP and FSDP2) uses.

accelerate's `Accelerator.prepare_model` (which HF's Trainer and TRL call) is wrapped the same way,
once a model is parallelized (`guard_accelerate`): on a parallelized model it raises, naming the
integration that is right (`tplayers.hf.Trainer`, `parallel_trainer`, `tplayers.hf.prepare`),
unless the accelerator is one of those (`ParallelAccelerator`, marked by its replicas).
"""

import functools
import inspect

import torch.distributed as dist

from tplayers.placement import placement_or_none, refuse_overlap, spans_ranks
from tplayers.state import set_state, state_of


def _group(process_group, device_mesh):
    if process_group is not None:
        return process_group
    if device_mesh is not None:
        return device_mesh.get_group()
    return dist.group.WORLD


def _refuse(wrapper: str, module, process_group, device_mesh) -> None:
    if not dist.is_initialized():
        return
    params = [p for p in module.parameters() if placement_or_none(p) is not None]
    if not params:
        return
    refuse_overlap(
        params, _group(process_group, device_mesh), wrapper, ("tp", "pp"),
        f"{wrapper} would broadcast one rank's shards over the others and average the gradients of different "
        "tensors; use tplayers.data_parallel(model, group=mesh['dp'], zero_stage=...) (the data-parallel group: "
        "ranks holding the same shards), or pass that group as its process_group (HF Trainer / accelerate: "
        "tplayers.hf.Trainer, tplayers.hf.parallel_trainer(cls), tplayers.hf.prepare(accelerator, ...))",
        role="its process group",
    )  # fmt: skip


def guard(cls, wrapper: str) -> None:
    """Wrap `cls.__init__` (a torch data-parallel wrapper) with the refusal above."""
    init = cls.__init__
    if state_of(init).guarded:
        return
    signature = inspect.signature(init)

    @functools.wraps(init)
    def guarded(self, module, *args, **kwargs):
        bound = signature.bind_partial(self, module, *args, **kwargs).arguments
        _refuse(wrapper, module, bound.get("process_group"), bound.get("device_mesh"))
        init(self, module, *args, **kwargs)

    set_state(guarded, guarded=True)
    cls.__init__ = guarded


def install() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    guard(DistributedDataParallel, "DistributedDataParallel")
    guard(FullyShardedDataParallel, "FullyShardedDataParallel")


_INTEGRATIONS = (
    "use tplayers.hf.Trainer (a drop-in transformers.Trainer), tplayers.hf.parallel_trainer(cls) for a Trainer "
    "subclass (TRL's SFTTrainer, ...), or tplayers.hf.prepare(accelerator, model, optimizer, dataloader, ...) "
    "in an accelerate loop"
)


def guard_accelerate() -> None:
    """Wrap accelerate's `Accelerator.prepare_model` (once) to refuse a parallelized model (module docstring)."""
    try:
        from accelerate import Accelerator
    except ImportError:  # accelerate is not installed: nothing to guard
        return
    prepare_model = Accelerator.prepare_model
    if state_of(prepare_model).guarded:
        return

    @functools.wraps(prepare_model)
    def guarded(self, model, *args, **kwargs):
        if state_of(self).replicas is None and spans_ranks(model):
            raise ValueError(
                f"accelerate.Accelerator.prepare (called by transformers.Trainer and TRL) on a model tplayers "
                f"parallelized: it would wrap it in DDP over every rank, give each rank its own rows and clip by each "
                f"rank's local norm, training another model without an error; {_INTEGRATIONS}"
            )
        return prepare_model(self, model, *args, **kwargs)

    set_state(guarded, guarded=True)
    Accelerator.prepare_model = guarded
