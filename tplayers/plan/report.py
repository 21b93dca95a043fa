"""Output: one estimate as a flat row for CSV / JSON (`ESTIMATE_FIELDS`, `estimate_to_dict`) and as
text (`format_estimate`, `format_ranking`)."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from tplayers.plan.estimate import Estimate
from tplayers.plan.layout import Layout
from tplayers.plan.specs import GROUPS

ESTIMATE_FIELDS = (
    *(f.name for f in fields(Layout)),
    "num_gpus",
    "num_params",
    "valid",
    "fits",
    "memory_stage",
    "memory_params_bytes",
    "memory_grads_bytes",
    "memory_optimizer_bytes",
    "memory_activations_bytes",
    "memory_buffers_bytes",
    "memory_total_bytes",
    "usable_hbm_bytes",
    "model_flops",
    "hardware_flops",
    "bubble_fraction",
    "comm_intra_node_bytes",
    "comm_inter_node_bytes",
    "comm_tp_bytes",
    "comm_pp_bytes",
    "comm_dp_bytes",
    "comm_ep_bytes",
    "comm_tp_r_bytes",
    "comm_tp_c_bytes",
    "comm_tp_all_bytes",
    "critical_stage",
    "time_compute_s",
    "time_bubble_s",
    "time_tp_s",
    "time_pp_s",
    "time_dp_s",
    "time_ep_s",
    "time_optimizer_s",
    "step_time_s",
    "tokens_per_s",
    "mfu",
    "reasons",
)


def estimate_to_dict(est: Estimate) -> dict[str, Any]:
    """One flat row (keys `ESTIMATE_FIELDS`, bytes and seconds unscaled) for CSV / JSON."""
    row: dict[str, Any] = dict.fromkeys(ESTIMATE_FIELDS)
    row.update(asdict(est.layout))
    if est.layout.tp_grid:
        row["tp_grid"] = "{}x{}".format(*est.layout.tp_grid)
    row.update(num_gpus=est.num_gpus, num_params=est.num_params, valid=est.valid, fits=est.fits)
    row.update(usable_hbm_bytes=est.usable_hbm_bytes, reasons="; ".join(est.reasons))
    if est.memory is not None:
        mem = est.memory
        row.update(memory_stage=mem.stage, memory_params_bytes=mem.params, memory_grads_bytes=mem.grads)
        row.update(memory_optimizer_bytes=mem.optimizer, memory_activations_bytes=mem.activations)
        row.update(memory_buffers_bytes=mem.buffers, memory_total_bytes=mem.total)
    for key in ("model_flops", "hardware_flops", "bubble_fraction", "critical_stage", "step_time_s", "mfu"):
        row[key] = getattr(est, key)
    row["tokens_per_s"] = est.tokens_per_s
    for link, nbytes in (est.comm_bytes or {}).items():
        row[f"comm_{link}_bytes"] = nbytes
    for group, nbytes in (est.comm_bytes_by_group or {}).items():
        row[f"comm_{group}_bytes"] = nbytes
    for axis, nbytes in (est.comm_bytes_by_axis or {}).items():
        row[f"comm_{axis}_bytes"] = nbytes
    for part, seconds in (est.time_breakdown or {}).items():
        row[f"time_{part}_s"] = seconds
    return row


def _gb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f}"


def format_estimate(est: Estimate) -> str:
    """A human-readable table of one estimate (GB = 1e9 bytes)."""
    lines = [f"layout    {est.layout.describe()}  ({est.num_gpus} GPUs, {est.num_params:.4g} params)"]
    if not est.valid:
        lines.append("INVALID")
        lines += [f"  - {r}" for r in est.reasons]
        return "\n".join(lines)
    mem = est.memory
    lines.append(f"memory per GPU, stage {mem.stage} of {est.layout.pp}    GB")
    for name in ("params", "grads", "optimizer", "activations", "buffers"):
        lines.append(f"  {name:<12}{_gb(getattr(mem, name)):>10}")
    verdict = "fits" if est.fits else "DOES NOT FIT"
    lines.append(f"  {'total':<12}{_gb(mem.total):>10}  / {_gb(est.usable_hbm_bytes)} usable -> {verdict}")
    if est.model_flops is not None:
        lines.append(
            f"FLOPs per step (job)  model {est.model_flops:.3e}  hardware {est.hardware_flops:.3e}  "
            f"bubble {est.bubble_fraction:.1%} of ideal"
        )
    by_group = est.comm_bytes_by_group or {}
    shown = [g for g in GROUPS if g != "ep" or est.layout.ep > 1]
    groups = "  ".join(f"{g} {_gb(by_group.get(g))} ({est.comm_links[g]})" for g in shown)
    lines.append(
        f"comm per GPU per step GB  intra-node {_gb(est.comm_bytes['intra_node'])}  "
        f"inter-node {_gb(est.comm_bytes['inter_node'])}  [{groups}]"
    )
    if est.comm_bytes_by_axis:
        axes = "  ".join(f"{a} {_gb(b)} ({est.comm_links[a]})" for a, b in est.comm_bytes_by_axis.items())
        lines.append(f"  tp on the grid's axes GB  {axes}")
    if est.step_time_s is not None:
        parts = "  ".join(f"{k} {v:.3f}" for k, v in est.time_breakdown.items())
        lines.append(f"step time {est.step_time_s:.3f} s (stage {est.critical_stage}: {parts})  MFU {est.mfu:.1%}")
    lines += [f"  - {r}" for r in est.reasons]
    lines += [f"  note: {n}" for n in est.notes]
    return "\n".join(lines)


def format_ranking(ranked: list[tuple[Layout, Estimate]], top: int = 10) -> str:
    """A table of the first `top` search results: layout, memory, step time, MFU."""
    header = f"{'#':>3}  {'layout':<72}{'mem GB':>9}{'step s':>10}{'MFU':>8}  fits"
    lines = [header]
    for i, (layout, est) in enumerate(ranked[:top], 1):
        mem = _gb(est.memory.total if est.memory else None)
        step = "-" if est.step_time_s is None else f"{est.step_time_s:.3f}"
        mfu = "-" if est.mfu is None else f"{est.mfu:.1%}"
        lines.append(f"{i:>3}  {layout.describe():<72}{mem:>9}{step:>10}{mfu:>8}  {'yes' if est.fits else 'no'}")
    return "\n".join(lines)
