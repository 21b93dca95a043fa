"""Global gradient clipping over tensor-parallel (and pipeline) ranks, read off the placements.

`clip_grad_norm_` returns the norm of the full, unsharded gradient, as
`torch.nn.utils.clip_grad_norm_` would on the unsharded model, and scales every local gradient
by the same factor on every rank. Each parameter is counted once by construction:

- a sharded gradient (placement `Shard(dim)` over group G) is split over the ranks of G, so its
  local contribution is summed over G (max for the inf-norm);
- a replicated gradient (placement `Replicate()`, or a parameter tplayers does not manage) is
  whole and identical on every rank of its group, so it is counted locally, once, and never
  reduced (reducing it is the classic bug that inflates the norm by up to the TP size);
- rows several ranks of G hold (`counted`: key / value heads the query heads of several ranks
  read) are counted by the first rank holding them, and summed over G like a shard;
- a parameter passed twice (tied / shared weights: the same Parameter object) counts once;
- under ZeRO 2-3 (`tplayers.data_parallel`) each replica holds a disjoint shard of every
  gradient (a DTensor over the data-parallel group): its local part is summed over the
  data-parallel group too, after the TP sum. Under stages 0-1 the replicas hold the same
  gradients, which are counted once.

`torch.nn.utils.clip_grad_norm_` itself, called in a user's own loop on parameters tplayers placed,
would clip each rank by its local norm: each rank scales its copy of a replicated weight by its
own factor, and the ranks train apart, silently. At `import tplayers` it is wrapped (once) to run
this `clip_grad_norm_` where any parameter it is given has a placement record (a pipeline stage's
too: the records name the stage group), and torch's own for every other model.
"""

import functools
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from tplayers.distributed import resolve_group
from tplayers.functional import comm
from tplayers.placement import (
    counted_rows,
    get_placement,
    local_tensor,
    placement_or_none,
    ranks_of,
    recorded_groups,
    refuse_overlap,
)
from tplayers.state import set_state, state_of

_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
_OVERLAP = (
    "those ranks hold parts of the same gradients, which would be counted more than once. group= is for "
    "ranks that hold disjoint parameters (pipeline stages the records do not name); the records' groups are "
    "always used"
)


def _unique_params(parameters) -> list:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    seen, unique = set(), []
    for p in parameters:
        if id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    return unique


def _local_norms(grads: list, norm_type: float, foreach: bool | None, known=None) -> list:
    """The norm of each gradient, accumulated and returned in fp32 (a 16-bit gradient's norm can
    exceed its dtype's range; fp64 stays fp64), in the order given. `known(grad)` may supply a norm already
    measured (by the loss scaler's unscale pass); the others are computed here."""
    if not grads:
        return []
    norms: list = [known(g) if known is not None else None for g in grads]
    for i, g in enumerate(grads):  # nothing held or counted here (no identity for the inf-norm of none)
        if norms[i] is None and g.numel() == 0:
            norms[i] = torch.zeros((), dtype=_norm_dtype(g.dtype), device=g.device)
    by_key: dict = {}
    for i, g in enumerate(grads):
        if norms[i] is None:
            by_key.setdefault((g.device, g.dtype), []).append(i)
    for (device, _), indices in by_key.items():
        tensors = [grads[i] for i in indices]
        use_foreach = foreach if foreach is not None else device.type in ("cpu", "cuda")
        if use_foreach:
            values = torch._foreach_norm(tensors, norm_type, dtype=_norm_dtype(tensors[0].dtype))
        else:
            values = [torch.linalg.vector_norm(t, norm_type, dtype=_norm_dtype(t.dtype)) for t in tensors]
        for i, v in zip(indices, values, strict=True):
            norms[i] = v if v.dtype == torch.float64 else v.to(torch.float32)
    return norms


def _norm_dtype(dtype):
    """fp32 for 16-bit (and fp32) gradients, fp64 kept as is (torch refuses a narrowing dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _combine(values: list, norm_type: float, device) -> torch.Tensor:
    """sum of p-th powers of per-tensor norms (max for inf), as an fp32 scalar on `device`."""
    if not values:
        return torch.zeros((), dtype=torch.float32, device=device)
    stacked = torch.stack([v.to(device) for v in values])
    return stacked.amax() if math.isinf(norm_type) else stacked.pow(norm_type).sum()


def _reduce(buf: torch.Tensor, group, is_max: bool) -> torch.Tensor:
    """Sum `buf` over `group`, or take its max (through an all-gather: comm has no MAX all-reduce,
    and an all-gather then `amax` propagates nan, which gloo's MAX does not guarantee)."""
    if dist.get_world_size(group) == 1:
        return buf
    if not is_max:
        comm.all_reduce(buf, group)
        return buf
    gathered = torch.empty((dist.get_world_size(group), *buf.shape), dtype=buf.dtype, device=buf.device)
    comm.all_gather_into(gathered, buf, group)
    return gathered.amax(dim=0)


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group=None,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    _known_norms=None,
) -> torch.Tensor:
    """Clip the gradients of `parameters` by the norm of the full, unsharded gradient; return that norm.

    With ``G_i`` the full gradient of parameter ``i`` (each distinct parameter once), the norm is

    - p finite (any p > 0):  ``total = (sum_i ||G_i||_p^p) ** (1/p)``, where for a parameter
      sharded over group G, ``||G_i||_p^p = sum_{r in G} ||g_i^(r)||_p^p`` (local shards' sums,
      all-reduced over G) and for a replicated one ``||G_i||_p^p = ||g_i||_p^p`` (local, once);
    - p = inf:  ``total = max_i ||G_i||_inf``, with a max over G for sharded parameters.

    One collective per distinct placement group (the sharded contributions of all parameters on
    that group travel in one buffer), then, if `group` (ProcessGroup, 1-D DeviceMesh) is given,
    one more over it: the per-rank totals are combined over `group` (sum of p-th powers, max for
    inf). Pass there ranks that hold *disjoint* parts of the model, e.g. pipeline stages; not
    data-parallel replicas holding the same gradients (that would count them once per replica).

    Then, like torch, every gradient is multiplied by ``min(max_norm / (total + 1e-6), 1)``.
    The total is the same on every rank, and so is the non-finite decision: nan / inf anywhere
    travel as flags with the reductions, so every rank sees ``nan`` (any nan) or ``inf``; with
    `error_if_nonfinite` every rank raises RuntimeError, otherwise the gradients are scaled by the
    resulting factor as torch does. Parameters whose grad is None are skipped; all-zero gradients
    give 0. `foreach` as in torch (None: use the foreach kernels on CPU / CUDA).
    (`_known_norms(grad) -> fp32 norm | None` is for `DynamicLossScaler.clip_grad_norm_`, whose
    fused unscale pass has already measured the gradients.)
    """
    norm_type = float(norm_type)
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 (or inf), got {norm_type}")
    max_norm = float(max_norm)
    every = _unique_params(parameters)  # all of them are clipped
    # a weight two pipeline stages share (tied embeddings) enters the norm on one stage only
    params = [p for p in every if not getattr(get_placement(p), "counted_by_another_stage", False)]
    extra = resolve_group(group) if group is not None else None
    if extra is not None:  # it combines per-rank totals: its ranks must hold disjoint parameters
        refuse_overlap(every, extra, "clip_grad_norm_", ("tp", "dp"), _OVERLAP)
    is_max = math.isinf(norm_type)

    # rows several ranks hold (shared key / value heads) are counted by the first of them only
    grads = [counted_rows(get_placement(p), p.grad) for p in params if p.grad is not None]
    norms = _local_norms(grads, norm_type, foreach, _known_norms)
    if grads:
        device = grads[0].device
        # torch returns the grads' dtype; fp16 / bf16 norms are returned in fp32, where a norm
        # above 65504 is not an overflow (torch's fp16 inf would zero every gradient)
        out_dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)
    else:
        device = params[0].device if params else torch.device("cpu")
        out_dtype = torch.float32

    # Every group some parameter is sharded over, in parameter order (the same on every rank of
    # it, grads or not, so collectives match); sharded norms go to their group, the rest stay local.
    sharded: dict = {}
    local = []
    norms_in_order = iter(norms)
    for p in params:
        placement = get_placement(p)
        groups = placement.reduce_groups() if placement is not None else ()
        if groups:
            sharded.setdefault(groups, [])
        if p.grad is None:
            continue
        (sharded[groups] if groups else local).append(next(norms_in_order))

    all_norms = torch.stack(norms) if norms else torch.zeros(0, device=device)
    flags = torch.stack([all_norms.isnan().any(), all_norms.isinf().any()]).to(torch.float32).to(device)
    total = _combine(local, norm_type, device)
    for groups, values in sharded.items():  # over TP, then over DP (ZeRO 2-3 shards)
        reduced = torch.cat([_combine(values, norm_type, device).reshape(1), flags])
        for pg in groups:
            reduced = _reduce(reduced, pg, is_max)
        part, flags = reduced[0], torch.maximum(flags, reduced[1:].clamp(max=1))
        total = torch.maximum(total, part) if is_max else total + part
    # Pipeline stages hold disjoint parameters: their totals are combined over the stage group
    # their placements name (then over `group`, unless it is that group).
    stage_groups = {ranks_of(g): g for g in recorded_groups(params, "pp")}
    if extra is not None:
        stage_groups.setdefault(ranks_of(extra), extra)
    for pg in stage_groups.values():
        reduced = _reduce(torch.cat([total.reshape(1), flags]), pg, is_max)
        total, flags = reduced[0], reduced[1:].clamp(max=1)

    if not is_max:
        total = total.pow(1.0 / norm_type)
    # the same verdict everywhere: any nan -> nan, else any inf -> inf
    total = torch.where(flags[1] > 0, torch.full_like(total, math.inf), total)
    total = torch.where(flags[0] > 0, torch.full_like(total, math.nan), total)
    total = total.to(out_dtype)

    if error_if_nonfinite and not torch.isfinite(total).item():
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    clip_coef = (max_norm / (total.to(torch.float32) + _EPS)).clamp(max=1.0)
    by_device: dict = {}
    for g in (local_tensor(p.grad) for p in every if p.grad is not None):
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), group_grads in by_device.items():
        coef = clip_coef.to(dev)
        if foreach is not False and dev.type in ("cpu", "cuda"):
            torch._foreach_mul_(group_grads, coef)
        else:
            for g in group_grads:
                g.mul_(coef)
    return total


def redirect_torch_clipping() -> None:
    """Wrap `torch.nn.utils.clip_grad_norm_` (once) to clip parameters tplayers placed by the full
    gradient's norm (module docstring); torch's own for any other parameters."""
    from torch.nn.utils import clip_grad

    original = clip_grad.clip_grad_norm_
    if state_of(original).guarded:
        return

    @functools.wraps(original)
    def clip(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not any(placement_or_none(p) is not None for p in params):
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    set_state(clip, guarded=True)
    clip_grad.clip_grad_norm_ = clip
    torch.nn.utils.clip_grad_norm_ = clip
