"""`output_attentions=True` on a parallelized model: the whole model's attention weights.

Each rank's attention modules compute the weights of their own heads, (batch, its heads, queries,
keys), and the model would return those: part of the heads, without an error. A forward hook on
each attention module split by heads gathers them over the group along the heads (ranks in head
order, parts of any size), when the forward was asked for them (`output_attentions` passed, or the
config's), so every rank returns the unsharded model's. A forward not asked for them gathers
nothing. Under context parallelism a rank's weights are its queries' over the keys it saw: refused.
"""

import functools
import threading

import torch
import torch.distributed as dist
from torch import nn

from tplayers.functional.collectives import gather_from_tp_region, sizes_along
from tplayers.nn.linear import RowParallelLinear

_asked = threading.local()  # the nesting of forwards asked for attention weights, on this thread


def _split_by_heads(module: nn.Module) -> bool:
    """A module holding attention whose heads tplayers split: a row-parallel output projection in it."""
    return any(isinstance(m, RowParallelLinear) for m in module.modules())


def _recorded(model: nn.Module) -> dict[nn.Module, int]:
    """{module: index of its output that HF records as attention weights} where tplayers split its
    heads: read from each (sub)model's `_can_record_outputs` (transformers 5: a class, or an
    OutputRecorder with its index, layer name or class-name suffix), as HF's own output capturing
    reads it; a model declaring none: its attention modules' second output."""
    found = {}
    for prefix, owner in model.named_modules():
        recordable = getattr(type(owner), "_can_record_outputs", None)
        if not isinstance(recordable, dict):
            continue
        for key, specs in recordable.items():
            if "attentions" not in key:
                continue
            for spec in specs if isinstance(specs, list) else [specs]:
                target = getattr(spec, "target_class", spec if isinstance(spec, type) else None)
                suffix = getattr(spec, "class_name", spec if isinstance(spec, str) else None)
                layer = getattr(spec, "layer_name", None)
                index = getattr(spec, "index", 1)
                for name, module in owner.named_modules(prefix=prefix):
                    if not ((target is not None and isinstance(module, target)) or (suffix and name.endswith(suffix))):
                        continue
                    if layer is not None and f".{layer.strip('.')}." not in f".{name}.":
                        continue
                    if _split_by_heads(module):
                        found[module] = index
    if not found:
        for module in model.modules():
            if "att" in type(module).__name__.lower() and any(
                isinstance(c, RowParallelLinear) for c in module.children()
            ):
                found[module] = 1
    return found


def gather_attention_weights(model: nn.Module, group, context_parallel: bool = False) -> None:
    """Install the hooks of the module docstring on `model`, parallelized over `group`."""
    if dist.get_world_size(group) == 1:
        return
    attention = _recorded(model)
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

    def gathered(index, module, args, output):
        if not getattr(_asked, "stack", None) or not _asked.stack[-1]:
            return output
        if not (isinstance(output, tuple) and -len(output) <= index < len(output)):
            return output
        weights = output[index]
        if not (isinstance(weights, torch.Tensor) and weights.dim() == 4):
            return output
        whole = gather_from_tp_region(weights, group, dim=1, sizes=sizes_along(weights, 1, group))  # uneven heads
        return tuple(whole if i == index % len(output) else out for i, out in enumerate(output))

    model.register_forward_pre_hook(asked, with_kwargs=True)
    model.register_forward_hook(done, with_kwargs=True, always_call=True)
    for module, index in attention.items():
        module.register_forward_hook(functools.partial(gathered, index))
