"""The HF model's own methods that a parallelized model changes, each kept in the model's own
`__dict__` in place of its class's (`ModelMethod`; a peft model's base model gets them too):

- `save_pretrained` (and `push_to_hub`, which calls it) refuses to write the shards unless handed
  the full state dict, as `tplayers.save_pretrained` hands it;
- `resize_token_embeddings` is refused by name: the embeddings and LM head are split by vocabulary,
  and a resize moves every rank's slice;
- `generate()` samples alike on every rank of the tensor-parallel group. Sampling (`do_sample=True`)
  draws each next token from the default generator. The ranks of a tensor-parallel group compute
  one model's logits, whole on every rank; drawing from generators seeded apart (a data-parallel
  script seeding each rank by its rank, accelerate's `set_seed(device_specific=True)`), they would
  pick different tokens and feed them to the next step: each rank's shards of one forward run on a
  different sequence, summed, with no error. So a rank whose generators differ from the group's
  first rank's draws from that rank's stream (one broadcast of its generators' states per call)
  and gets its own back after: ranks seeded apart stay apart, ranks seeded alike stay alike, one
  stream further.
"""

import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

from tplayers.functional.rng import default_generators
from tplayers.placement import placement_or_none, recorded_groups


class ModelMethod:
    """A method of a parallelized model kept in the model's own `__dict__` under the class method's
    `name`, in place of it. It holds the model weakly (a bound method there would be a reference
    cycle, keeping every dropped model alive until the garbage collector runs); copies of the model
    get their own."""

    name: str

    def __init__(self, model):
        self._model = weakref.ref(model)
        self.__doc__ = getattr(type(model), self.name).__doc__

    def __deepcopy__(self, memo):
        model = self._model()
        return type(self)(memo.get(id(model), model))

    def __reduce__(self):
        return type(self), (self._model(),)

    @classmethod
    def install(cls, model) -> None:
        """In place of the class's method on `model` (and, for a peft model, on its base model too)."""
        for m in (model, *((model.get_base_model(),) if hasattr(model, "get_base_model") else ())):
            if callable(getattr(type(m), cls.name, None)):
                object.__setattr__(m, cls.name, cls(m))


class _GuardedSave(ModelMethod):
    """`model.save_pretrained` on a parallelized model: refuses to write the shards."""

    name = "save_pretrained"

    def __call__(self, path, *args, state_dict=None, **kwargs):
        model = self._model()
        if state_dict is None:
            raise ValueError(
                f"{type(model).__name__}.save_pretrained on a model tplayers parallelized would write this rank's "
                "shards under tplayers' module names, a checkpoint from_pretrained cannot load: call "
                "tplayers.save_pretrained(model, path) on every rank (full tensors, HF names; a peft model's adapter "
                "as peft writes it), as tplayers.hf.Trainer's save_model does"
            )
        shards = _shards(model)
        if any(_held_here(v) & shards for v in state_dict.values()):
            raise ValueError(
                f"{type(model).__name__}.save_pretrained was handed this rank's shards (model.state_dict() of a model "
                "tplayers parallelized): hand it the full state dict, tplayers.gather_state_dict(model) (or "
                "accelerator.get_state_dict(model)) on every rank, or call tplayers.save_pretrained(model, path)"
            )
        return type(model).save_pretrained(model, path, *args, state_dict=state_dict, **kwargs)  # HF's, on a full dict


def _held_here(t) -> set[int]:
    """The storage address of a tensor (a DTensor's local part), as a set: empty for other values."""
    t = getattr(t, "_local_tensor", t)
    return {t.untyped_storage().data_ptr()} if isinstance(t, torch.Tensor) and t.numel() else set()


def _shards(model) -> set[int]:
    """The storages of the parameters this rank holds a slice of (split over a group of several)."""
    out = set()
    for p in model.parameters():
        record = placement_or_none(p)
        if record is not None and record.group is not None and not isinstance(record.placement, Replicate):
            if dist.get_world_size(record.group) > 1:
                out |= _held_here(p)
    return out


class _RefusedResize(ModelMethod):
    """`model.resize_token_embeddings` on a parallelized model: refused by name."""

    name = "resize_token_embeddings"

    def __call__(self, *args, **kwargs):
        raise ValueError(
            f"{type(self._model()).__name__}.resize_token_embeddings on a model tplayers parallelized: its "
            "embeddings and LM head are split by vocabulary, and a new size moves every rank's slice; resize the "
            "unsharded model (model.resize_token_embeddings(n)), then parallelize it"
        )


class _AlikeGenerate(ModelMethod):
    """`model.generate` sampling alike (module docstring); the group read from the model's records."""

    name = "generate"

    def __call__(self, *args, **kwargs):
        model = self._model()
        generate = type(model).generate
        groups = recorded_groups(list(model.parameters()), "tp")
        if not groups or dist.get_world_size(groups[0]) == 1:
            return generate(model, *args, **kwargs)
        generators = default_generators(model)
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


def install(model) -> None:
    """The methods of the module docstring on `model`, a parallelized model (or peft model)."""
    for method in (_GuardedSave, _RefusedResize, _AlikeGenerate):
        method.install(model)
