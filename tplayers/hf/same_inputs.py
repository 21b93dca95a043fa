"""The check that every rank of a tensor-parallel group was given the same batch.

Tensor-parallel ranks each compute part of one model on one batch. A data loader that splits
the data by global rank (a `DistributedSampler` over the world, HF Trainer / accelerate without
tplayers' integration) gives them different rows: each rank's part is then of a different batch,
and the "model" trained is no model, with no error anywhere.

A forward pre-hook on the parallelized model compares, at its first forward after
`parallelize` (and again after `check_same_inputs(model)` re-arms it), a fingerprint of the
inputs (shape, sum and a position-weighted sum of the token ids, labels and masks, or of the
embeddings) across the group: one all-gather of 4 numbers per tensor and one host sync, once.
Ranks that differ raise on every rank, naming them, before the model's first collective.

At its first forward in training mode, where the model draws random numbers there (a dropout
module, or a dropout / router-jitter / layer-drop rate above 0 a module keeps), the check compares
the ranks' default generators too: ranks seeded apart (a data-parallel script's `seed + rank`)
would draw different dropout masks for the activations they hold copies of, each rank a different
model, silently (`tplayers.functional.rng`).
"""

import hashlib

import torch
import torch.distributed as dist

from tplayers.functional.rng import default_generators
from tplayers.state import set_state, state_of

CHECKED = ("input_ids", "inputs_embeds", "labels", "attention_mask", "position_ids")


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    flat = t.reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device) % 1009
    return torch.stack([torch.tensor(float(t.dim()), dtype=torch.float64, device=flat.device),
                        torch.tensor(float(flat.numel()), dtype=torch.float64, device=flat.device),
                        flat.sum(), (flat * weights).sum()])  # fmt: skip


def _inputs(args, kwargs) -> dict:
    found = {k: kwargs.get(k) for k in CHECKED}
    if args and isinstance(args[0], torch.Tensor):
        found["input_ids"] = args[0]
    return {k: v for k, v in found.items() if isinstance(v, torch.Tensor)}


class _Groups(list):
    """The (group, role) pairs checked; shared by a deep copy of the model (a process group cannot
    be copied)."""

    def __deepcopy__(self, memo):
        return self


def check_same_inputs(model, group=None, role="tensor-parallel") -> None:
    """Install (or re-arm) the check on `model` over `group` (the model's tensor-parallel group;
    a context-parallel group, `role`, is checked too: its ranks split one batch's sequence)."""
    groups = state_of(model).same_inputs
    if groups is None:
        groups = set_state(model, same_inputs=_Groups()).same_inputs
    alone = group is not None and dist.get_world_size(group) == 1  # nothing to compare with
    if group is not None and not alone and all(g is not group for g, _ in groups):
        if not groups:  # first: before any hook that splits the inputs (context parallelism)
            model.register_forward_pre_hook(_hook, with_kwargs=True, prepend=True)
        groups.append((group, role))
    set_state(model, check_inputs=True, check_generators=True)


def _hook(model, args, kwargs):
    held = state_of(model)
    if held.check_generators and model.training:
        set_state(model, check_generators=False)
        if draws_random_numbers(model):
            for group, role in held.same_inputs:
                if role == "tensor-parallel":  # (context-parallel ranks hold different tokens: no copies)
                    compare_generators(model, group, role)
    if not held.check_inputs:
        return
    set_state(model, check_inputs=False)
    inputs = _inputs(args, kwargs)
    for group, role in state_of(model).same_inputs:
        compare_inputs(inputs, group, role)


def compare_inputs(inputs: dict, group, role: str) -> None:
    """Raise on every rank of `group` unless its ranks were given the same `inputs` (name -> tensor)."""
    names = list(CHECKED)
    device = next(iter(inputs.values())).device if inputs else torch.device("cpu")
    mine = torch.stack([_fingerprint(inputs[k]) if k in inputs else torch.zeros(4, dtype=torch.float64,
                        device=device) for k in names])  # fmt: skip
    ranks, every = _every_rank(mine, group)  # (ranks, tensors, 4)
    differ = [ranks[r] for r in range(len(ranks)) if not torch.equal(every[r], every[0])]
    if differ:
        which = [
            k for i, k in enumerate(names) if not all(torch.equal(every[r, i], every[0, i]) for r in range(len(ranks)))
        ]
        raise ValueError(
            f"parallelize: the {role} ranks {ranks} were given different inputs ({', '.join(which)}: ranks "
            f"{differ} differ from rank {ranks[0]}). Every rank of a {role} group computes its part of one "
            "model on one batch: give them the same rows, and split the data over the data-parallel group only "
            "(e.g. DistributedSampler(num_replicas=mesh['dp'].size(), rank=mesh['dp'].get_local_rank()))"
        )


RATES = ("dropout", "pdrop", "jitter", "layerdrop", "drop_prob")


def draws_random_numbers(model) -> bool:
    """Whether `model` draws random numbers in training: a dropout module with p > 0, or a module
    holding a rate above 0 that its code reads (HF's attention modules keep `attention_dropout`,
    routers `jitter_noise`, models their `layerdrop`, for functional calls)."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if any(type(v) is float and v > 0 and any(r in k for r in RATES) for k, v in vars(m).items()):
            return True
    return False


def _generator_fingerprint(model) -> torch.Tensor:
    states = b"".join(g.get_state().numpy().tobytes() for g in default_generators(model))
    digest = hashlib.blake2b(states, digest_size=7).digest()
    return torch.tensor([int.from_bytes(digest, "little")], dtype=torch.int64, device=next(model.parameters()).device)


def compare_generators(model, group, role: str) -> None:
    """Raise on every rank of `group` unless its ranks' default generators are alike (module docstring)."""
    ranks, every = _every_rank(_generator_fingerprint(model), group)
    differ = [ranks[r] for r in range(len(ranks)) if not torch.equal(every[r], every[0])]
    if differ:
        raise ValueError(
            f"parallelize: the {role} ranks {ranks} hold different random generators (ranks {differ} differ from "
            f"rank {ranks[0]}: seeded apart?), and the model draws random numbers in training (dropout, router "
            "jitter): ranks holding copies of one activation would drop different parts of it, each rank a different "
            f"model. Seed every rank of a {role} group alike: torch.manual_seed(seed), or seed + the data-parallel "
            "rank where the replicas should differ"
        )


def _every_rank(mine: torch.Tensor, group) -> tuple[list[int], torch.Tensor]:
    """(the group's global ranks, every rank's `mine` stacked on the CPU): one all-gather, not counted
    as the model's traffic (a check)."""
    ranks = dist.get_process_group_ranks(group)
    gathered = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(gathered, mine, group=group)
    return ranks, torch.stack(gathered).cpu()
