"""`generate()` on a parallelized model samples alike on every rank of its tensor-parallel group.

Sampling (`do_sample=True`) draws each next token from the default generator. The ranks of a
tensor-parallel group compute one model's logits, whole on every rank; drawing from generators
seeded apart (a data-parallel script seeding each rank by its rank, accelerate's
`set_seed(device_specific=True)`), they would pick different tokens and feed them to the next
step: each rank's shards of one forward run on a different sequence, summed, with no error.

So `model.generate` draws, on a rank whose generators differ from the group's first rank's, from
that rank's stream (one broadcast of its generators' states per call), and gives the rank its own
back after: ranks seeded apart stay apart, ranks seeded alike stay alike, one stream further.
"""

import torch
import torch.distributed as dist

from tplayers.hf.state_dict import ModelMethod
from tplayers.placement import recorded_groups


def _generators(model) -> list[torch.Generator]:
    """The default generators sampling may draw from: the CPU's, and the model's CUDA device's."""
    device = next(model.parameters()).device
    found = [torch.default_generator]
    if device.type == "cuda":
        found.append(torch.cuda.default_generators[device.index if device.index is not None else 0])
    return found


class _AlikeGenerate(ModelMethod):
    """`model.generate` on a parallelized model (module docstring); the group read from the model's records."""

    name = "generate"

    def __call__(self, *args, **kwargs):
        model = self._model()
        generate = type(model).generate
        groups = recorded_groups(list(model.parameters()), "tp")
        if not groups or dist.get_world_size(groups[0]) == 1:
            return generate(model, *args, **kwargs)
        generators = _generators(model)
        own = [g.get_state() for g in generators]
        first = [own]
        dist.broadcast_object_list(first, src=dist.get_global_rank(groups[0], 0), group=groups[0])
        apart = any(not torch.equal(mine, theirs) for mine, theirs in zip(own, first[0], strict=True))
        if not apart:
            return generate(model, *args, **kwargs)
        for g, state in zip(generators, first[0], strict=True):
            g.set_state(state)
        try:
            return generate(model, *args, **kwargs)
        finally:
            for g, state in zip(generators, own, strict=True):
                g.set_state(state)


def sample_alike(model) -> None:
    """Make `model.generate` (a peft model's and its base model's) sample alike on every rank."""
    _AlikeGenerate.install(model)
