"""Dynamic loss scaling whose overflow decision is the same on every rank.

`DynamicLossScaler` is a drop-in for `torch.amp.GradScaler`'s methods (`scale`, `unscale_`,
`step`, `update`, `get_scale`, `state_dict`, `load_state_dict`), plus hysteresis (a number of
consecutive overflows tolerated before backing off) and a `min_scale` floor.

Why the overflow flag is reduced across ranks
---------------------------------------------
Under tensor parallelism each rank holds a different slice of a sharded gradient, so an inf /
nan produced by one rank's shard is seen by that rank only. A scaler that decides locally then
skips the step on that rank while the others step: the shards of one weight stop belonging to the
same model, replicated parameters drift apart (silent divergence), and with a sharded optimizer
or a collective inside `optimizer.step()` the ranks that step wait forever for the one that did
not (a hang). The scales also drift apart, so the next steps disagree again.

So `unscale_` reduces the found-inf flag with MAX over every process group that holds part of
the model: each group named by the placement of any of the optimizer's parameters (TP groups,
expert groups, read off `tplayers.get_placement`), then the extra `group` given to the scaler (e.g. the
data-parallel or pipeline group, or the world). Every rank then skips, or steps, together, and
their scales stay identical. The reduction is an all-gather of one float plus `amax` (comm has
no MAX all-reduce), issued in a deterministic order so that all ranks issue identical
collectives: the placement groups sorted by the ranks they hold (then by name), then `group`
(or each group of a sequence, in the order given). Reducing over the TP groups first and the
extra group last reaches every rank of a (tp x other) grid: after the TP step every rank holds its
TP group's verdict, and the extra group joins one rank of each TP group.
"""

import math
from collections.abc import Iterable, Sequence
from enum import Enum

import torch
import torch.distributed as dist

from tplayers.backend import unscale_and_stats_, uses_triton
from tplayers.distributed import resolve_group
from tplayers.functional import comm
from tplayers.placement import get_placement, local_tensor
from tplayers.train.clip import clip_grad_norm_

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the fused Triton pass takes


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _f32(x: float) -> float:
    """`x` rounded to float32, as GradScaler's fp32 scale tensor would hold it."""
    return torch.tensor(x, dtype=torch.float32).item()


def _max_over(flag: torch.Tensor, group) -> torch.Tensor:
    """MAX of `flag` (shape (1,)) over `group`, via an all-gather (one float per rank)."""
    n = dist.get_world_size(group)
    if n == 1:
        return flag
    gathered = torch.empty((n, *flag.shape), dtype=flag.dtype, device=flag.device)
    comm.all_gather_into(gathered, flag, group)
    return gathered.amax(dim=0)


def _group_key(pg) -> tuple:
    return (tuple(dist.get_process_group_ranks(pg)), str(getattr(pg, "group_name", "")))


class DynamicLossScaler:
    """GradScaler-style dynamic loss scaling with a cross-rank consensus on overflow.

    - ``scale(loss)``: ``loss * scale`` (tensors or nested lists / tuples of tensors).
    - ``unscale_(optimizer)``: at most once per optimizer per step; multiplies every grad in place
      by the fp32 reciprocal of the scale (fp32 math, exactly as GradScaler) and detects inf / nan;
      the found-inf flag is MAX-reduced over the placement groups of the optimizer's parameters
      and then over `group` (see the module docstring), so every rank gets the same verdict.
    - ``step(optimizer, *args, **kwargs)``: unscales if not done yet; calls ``optimizer.step()``
      only if no rank found an overflow; returns its result, or None when skipped
      (``last_step_skipped`` tells which).
    - ``update(new_scale=None)``: on an overflow the hysteresis counter drops by one; when it
      reaches zero (``hysteresis`` consecutive overflow steps) the scale is multiplied by
      ``backoff_factor`` and the counter resets. A clean step resets the hysteresis counter and
      counts towards growth: after ``growth_interval`` consecutive clean steps the scale is
      multiplied by ``growth_factor`` (when the result is finite). Every overflow step resets the
      growth counter. The scale never drops below ``min_scale``: it is clamped there, or, with
      ``raise_on_min_scale``, a back-off below it raises RuntimeError (on every rank alike).
      With ``hysteresis=1`` the sequence of scales and skipped steps equals GradScaler's (as
      long as the scale stays above ``min_scale``; GradScaler has no floor).

    fp16 gradients are refused, as GradScaler refuses them: unscaled in fp16 they underflow; keep
    fp32 master weights (`MixedPrecisionOptimizer`) or pass ``allow_fp16_grads=True``.

    `group`: a ProcessGroup, a 1-D DeviceMesh, a sequence of them (reduced in that order), or
    None for the default group (every rank of the job; without torch.distributed initialised,
    a single process: no collective at all).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        *,
        group=None,
        raise_on_min_scale: bool = False,
        enabled: bool = True,
        allow_fp16_grads: bool = False,
    ):
        self._check_hyperparameters(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale)
        self._scale = _f32(float(init_scale))
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._min_scale = float(min_scale)
        self._raise_on_min_scale = bool(raise_on_min_scale)
        self._enabled = bool(enabled)
        self._allow_fp16_grads = bool(allow_fp16_grads)
        self._growth_tracker = 0
        self._hysteresis_tracker = self._hysteresis
        self._skipped_steps = 0
        if group is None:  # the default group, as for every tplayers object
            self._extra_groups = [dist.group.WORLD] if dist.is_available() and dist.is_initialized() else []
        elif isinstance(group, Sequence):
            self._extra_groups = [resolve_group(g) for g in group]
        else:
            self._extra_groups = [resolve_group(group)]
        self._per_optimizer: dict = {}
        self.last_step_skipped = False

    @staticmethod
    def _check_hyperparameters(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale):
        def bad(name, value, rule):
            raise ValueError(f"DynamicLossScaler: {name} must be {rule}, got {value!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not (math.isfinite(float(init_scale)) and init_scale > 0):
            bad("init_scale", init_scale, "finite and > 0")
        if not (math.isfinite(float(growth_factor)) and growth_factor > 1):
            bad("growth_factor", growth_factor, "finite and > 1")
        if not 0 < backoff_factor < 1:
            bad("backoff_factor", backoff_factor, "in (0, 1)")
        if not is_int(growth_interval) or growth_interval < 1:
            bad("growth_interval", growth_interval, "an int >= 1")
        if not is_int(hysteresis) or hysteresis < 1:
            bad("hysteresis", hysteresis, "an int >= 1")
        if not (math.isfinite(float(min_scale)) and min_scale > 0):
            bad("min_scale", min_scale, "finite and > 0")
        if init_scale < min_scale:
            raise ValueError(f"DynamicLossScaler: init_scale {init_scale!r} is below min_scale {min_scale!r}")

    # -- GradScaler API ---------------------------------------------------------------------

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def scale(self, outputs):
        """`outputs` (a tensor or nested lists / tuples of tensors) multiplied by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * torch.tensor(self._scale, dtype=torch.float32, device=outputs.device)
        if isinstance(outputs, Iterable) and not isinstance(outputs, str | bytes):
            scaled = [self.scale(o) for o in outputs]
            return type(outputs)(scaled) if isinstance(outputs, list | tuple) else scaled
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def _state(self, optimizer) -> dict:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": _Stage.READY, "found_inf": None})

    def _groups_of(self, optimizer) -> list:
        """The process groups to reduce the flag over, in the order every rank uses."""
        by_id = {}
        for param_group in optimizer.param_groups:
            for p in param_group["params"]:
                placement = get_placement(p)
                if placement is None:
                    continue
                for pg in (placement.group, placement.dp_group, placement.pp_group, placement.ep_group):
                    if pg is not None:  # TP groups, data-parallel replicas, stages, expert groups
                        by_id.setdefault(id(pg), pg)
        placed = list(by_id.values())
        if len(placed) > 1:
            placed.sort(key=_group_key)
        extra = [g for g in self._extra_groups if id(g) not in by_id]
        return placed + extra

    def unscale_(self, optimizer) -> None:
        """Unscale `optimizer`'s grads in place and compute the consensus found-inf flag."""
        if self._enabled:
            self._unscale(optimizer)

    def _unscale(self, optimizer) -> dict:
        """`unscale_`; returns {id(grad): (grad, [sum |g|, sum g^2, max |g|])} for the gradients
        the fused pass measured (Triton backend), for `clip_grad_norm_` to use at once."""
        state = self._state(optimizer)
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")

        inv_scale = torch.tensor([self._scale], dtype=torch.float64).reciprocal().float()
        found_inf = torch.zeros(1, dtype=torch.float32)
        dense: dict = {}
        sparse: dict = {}
        with torch.no_grad():
            for param_group in optimizer.param_groups:
                for p in param_group["params"]:
                    if p.grad is None:
                        continue
                    g = local_tensor(p.grad)  # ZeRO 2-3: this replica's shard
                    if g.is_sparse:
                        if g.dtype is torch.float16:  # coalesce so duplicate indices cannot overflow
                            p.grad = g = g.coalesce()
                        sparse.setdefault((g.device, g.dtype), []).append(g._values())
                    else:
                        if g.dtype == torch.float16 and not self._allow_fp16_grads:
                            raise ValueError(
                                "Attempting to unscale fp16 gradients: grad / scale underflows in fp16. Keep fp32 "
                                "master weights (tplayers.MixedPrecisionOptimizer) or pass allow_fp16_grads=True"
                            )
                        dense.setdefault(g.device, []).append(g)
            # With the Triton backend, one fused pass per device unscales, checks, and measures
            # each fp32 / fp16 / bf16 gradient for clipping (others take torch's op). The torch
            # backend unscales with torch's op and lets clipping take its one norm: on CPU torch's
            # 1- and inf-norms cost more than the second read they would save (bench/amp.py).
            stats_of = {}
            for device, grads in dense.items():
                device_found = torch.zeros(1, dtype=torch.float32, device=device)
                fused = [g for g in grads if g.dtype in FUSED_DTYPES] if uses_triton(grads[0]) else []
                if fused:
                    stats, fused_found = unscale_and_stats_(fused, inv_scale.to(device))
                    device_found = torch.maximum(device_found, fused_found)
                    stats_of.update((id(g), (g, row)) for g, row in zip(fused, stats, strict=True))
                by_dtype: dict = {}
                for g in grads:
                    if id(g) not in stats_of:
                        by_dtype.setdefault(g.dtype, []).append(g)
                for dtype, same_dtype in by_dtype.items():
                    if dtype == torch.bfloat16:  # torch's op has no CUDA bf16 kernel: the same arithmetic
                        _, bf16_found = unscale_and_stats_(same_dtype, inv_scale.to(device))
                        device_found = torch.maximum(device_found, bf16_found)
                    else:
                        torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, device_found, inv_scale.to(device))
                found_inf = torch.maximum(found_inf, device_found.cpu())
            for (device, _), values in sparse.items():
                device_found = torch.zeros(1, dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(values, device_found, inv_scale.to(device))
                found_inf = torch.maximum(found_inf, device_found.cpu())

        # Collectives run on the parameters' device (NCCL needs CUDA tensors), the same on every
        # rank whether or not this rank has grads.
        flag = found_inf.to(_param_device(optimizer))
        for pg in self._groups_of(optimizer):
            flag = _max_over(flag, pg)
        state["found_inf"] = flag.cpu()
        state["stage"] = _Stage.UNSCALED
        return stats_of

    def step(self, optimizer, *args, **kwargs):
        """`optimizer.step(*args, **kwargs)` unless any rank found an overflow; its result or None."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if DynamicLossScaler is enabled.")
        state = self._state(optimizer)
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        result = None
        self.last_step_skipped = bool(state["found_inf"].item() > 0)
        if not self.last_step_skipped:
            result = optimizer.step(*args, **kwargs)
        elif hasattr(optimizer, "step_skipped"):  # MixedPrecisionOptimizer: its grads are now stale
            optimizer.step_skipped()
        state["stage"] = _Stage.STEPPED
        return result

    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0, *, group=None, **kwargs):
        """Unscale `optimizer`'s gradients (if not done yet this step), then
        `tplayers.clip_grad_norm_` over its parameters, returning the total norm.

        Called before `unscale_` (as `train_step` does), it unscales with the fused pass and, on
        the Triton backend, clips with the norms that pass measured (sum |g|, sum g^2, max |g|
        for norm types 1, 2, inf): the gradients are read once. Nothing can change them in
        between, which is why the measured norms are used only within this one call; after a
        separate `unscale_` (the gradients may have been reduced or edited since) every norm is
        measured afresh. On an overflow the norm is inf / nan on every rank of the clip groups
        and `step` will skip.
        """
        stats_of = {}
        if self._enabled and self._state(optimizer)["stage"] is _Stage.READY:
            stats_of = self._unscale(optimizer)
        column = {1.0: 0, 2.0: 1, math.inf: 2}.get(float(norm_type))

        def known(grad):
            entry = stats_of.get(id(grad))
            if column is None or entry is None or entry[0] is not grad:
                return None
            value = entry[1][column]
            return value.sqrt() if column == 1 else value

        params = [p for param_group in optimizer.param_groups for p in param_group["params"]]
        return clip_grad_norm_(params, max_norm, norm_type, group=group, _known_norms=known, **kwargs)

    def update(self, new_scale=None) -> None:
        """Adjust the scale from this step's (consensus) overflow verdict, or set `new_scale`."""
        if not self._enabled:
            return
        if new_scale is not None:
            value = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"new_scale must be finite and > 0, got {value!r}")
            self._scale = _f32(value)
            self._per_optimizer.clear()
            return
        found = [s["found_inf"] for s in self._per_optimizer.values() if s["found_inf"] is not None]
        if not found:
            raise RuntimeError("No inf checks were recorded prior to update().")
        overflow = bool(sum(f.item() for f in found) > 0)
        if overflow:
            self._skipped_steps += 1
            self._growth_tracker = 0
            if self._hysteresis_tracker - 1 <= 0:
                backed_off = _f32(self._scale * _f32(self._backoff_factor))
                if backed_off < self._min_scale:
                    if self._raise_on_min_scale:
                        raise RuntimeError(
                            f"DynamicLossScaler: an overflow at scale {self._scale} would back the scale off to "
                            f"{backed_off}, below min_scale {self._min_scale}"
                        )
                    backed_off = self._min_scale
                self._scale = backed_off
                self._hysteresis_tracker = self._hysteresis
            else:
                self._hysteresis_tracker -= 1
        else:
            self._hysteresis_tracker = self._hysteresis
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                grown = _f32(self._scale * _f32(self._growth_factor))
                if math.isfinite(grown):
                    self._scale = grown
                self._growth_tracker = 0
        self._per_optimizer.clear()

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Every tracker and hyperparameter; GradScaler's keys are a subset (it can load this)."""
        if not self._enabled:
            return {}
        return {
            "scale": self._scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._growth_tracker,
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": self._hysteresis_tracker,
            "min_scale": self._min_scale,
            "raise_on_min_scale": self._raise_on_min_scale,
            "_skipped_steps": self._skipped_steps,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load `state_dict()` (or a GradScaler's: keys it lacks keep their current values)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled scaler.")
        get = state_dict.get
        scale = float(get("scale", self._scale))
        growth_factor = float(get("growth_factor", self._growth_factor))
        backoff_factor = float(get("backoff_factor", self._backoff_factor))
        growth_interval = int(get("growth_interval", self._growth_interval))
        hysteresis = int(get("hysteresis", self._hysteresis))
        min_scale = float(get("min_scale", self._min_scale))
        self._check_hyperparameters(scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale)
        growth_tracker = int(get("_growth_tracker", self._growth_tracker))
        hysteresis_tracker = int(get("_hysteresis_tracker", hysteresis))
        if not 0 <= growth_tracker < growth_interval:
            raise ValueError(f"_growth_tracker {growth_tracker} out of range for growth_interval {growth_interval}")
        if not 1 <= hysteresis_tracker <= hysteresis:
            raise ValueError(f"_hysteresis_tracker {hysteresis_tracker} out of range for hysteresis {hysteresis}")
        self._scale = _f32(scale)
        self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
        self._growth_interval, self._hysteresis, self._min_scale = growth_interval, hysteresis, min_scale
        self._growth_tracker, self._hysteresis_tracker = growth_tracker, hysteresis_tracker
        self._raise_on_min_scale = bool(get("raise_on_min_scale", self._raise_on_min_scale))
        self._skipped_steps = int(get("_skipped_steps", self._skipped_steps))

    def __getstate__(self):
        raise TypeError("DynamicLossScaler holds process groups and cannot be pickled; save state_dict() instead")


def _param_device(optimizer) -> torch.device:
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            return p.device
    return torch.device("cpu")
