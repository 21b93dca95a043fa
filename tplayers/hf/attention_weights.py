"""`output_attentions=True` on a parallelized model: the whole model's attention weights.

Each rank's attention modules compute the weights of their own heads, (batch, its heads, queries,
keys), and the model would return those: part of the heads, without an error. A forward hook on
each attention module split by heads gathers them over the group along the heads (ranks in head
order, parts of any size), when the forward was asked for them (`output_attentions` passed, or the
config's), so every rank returns the unsharded model's. A forward not asked for them gathers
nothing. Under context parallelism a rank's weights are its queries' over the keys it saw: refused.
"""

import threading

import torch
import torch.distributed as dist
from torch import nn

from tplayers.functional.collectives import gather_from_tp_region
from tplayers.nn.linear import RowParallelLinear

_asked = threading.local()  # the nesting of forwards asked for attention weights, on this thread


def _split_by_heads(module: nn.Module) -> bool:
    """An HF attention module (its forward kept) whose heads tplayers split: its output projection is
    row-parallel (its query / key / value projections column-parallel, or fused layouts of them)."""
    return "att" in type(module).__name__.lower() and any(isinstance(c, RowParallelLinear) for c in module.children())


def gather_attention_weights(model: nn.Module, group, context_parallel: bool = False) -> None:
    """Install the hooks of the module docstring on `model`, parallelized over `group`."""
    if dist.get_world_size(group) == 1:
        return
    attention = [m for m in model.modules() if _split_by_heads(m)]
    if not attention:
        return

    def asked(module, args, kwargs):
        wanted = kwargs.get("output_attentions")
        if wanted is None:
            wanted = getattr(getattr(module, "config", None), "output_attentions", False)
        _asked.stack = [*getattr(_asked, "stack", []), bool(wanted)]  # popped by `done`, whatever is raised
        if wanted and context_parallel:
            raise ValueError(
                "output_attentions under context parallelism: each rank's attention weights are its queries' "
                "over the keys it saw, not the model's; run the forward without context parallelism"
            )

    def done(module, args, kwargs, output):
        if getattr(_asked, "stack", None):
            _asked.stack.pop()

    def gathered(module, args, output):
        if not getattr(_asked, "stack", None) or not _asked.stack[-1]:
            return output
        if not (isinstance(output, tuple) and len(output) > 1 and isinstance(output[1], torch.Tensor)):
            return output
        weights = output[1]
        if weights.dim() != 4:
            return output
        heads = [torch.zeros((), dtype=torch.int64, device=weights.device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(heads, torch.tensor(weights.shape[1], device=weights.device), group=group)  # uneven splits
        whole = gather_from_tp_region(weights, group, dim=1, sizes=[int(h) for h in heads])
        return (output[0], whole, *output[2:])

    model.register_forward_pre_hook(asked, with_kwargs=True)
    model.register_forward_hook(done, with_kwargs=True, always_call=True)
    for module in attention:
        module.register_forward_hook(gathered)
