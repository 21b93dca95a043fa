"""Pipeline schedules (GPipe, 1F1B, interleaved): the micro-batches a stage holds in flight and the
bubble (Narayanan et al. 2021)."""

from __future__ import annotations

from tplayers.plan.specs import SCHEDULE_CHOICES, _choice


def microbatches_in_flight(schedule: str, stage: int, pp: int, num_microbatches: int, virtual_stages: int = 1):
    """Micro-batches (in units of a whole stage's layers) whose activations a stage holds at peak.

    GPipe: all m forwards run before any backward. 1F1B (Narayanan et al. 2021 Sec. 2.2.1):
    stage i runs pp - i warm-up forwards, so min(pp - i, m); stage 0 holds pp micro-batches of
    layers/pp layers = all L layers' worth (Korthikanti Sec. 4.2.3). Interleaved: Megatron's
    warm-up of 2*(pp - i - 1) + (v - 1)*pp chunk forwards, +1, each chunk 1/v of the stage;
    for stage 0 that is L*(1 + (pp - 1)/(pp*v)) layers, Korthikanti Sec. 4.2.3.
    """
    m, v = num_microbatches, virtual_stages
    if pp == 1:  # no pipeline: plain gradient accumulation, one micro-batch at a time
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(pp - stage, m))
    chunks = min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v)
    return chunks / v


def bubble_fraction(pp: int, num_microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Pipeline bubble time / ideal time, Narayanan et al. 2021 Sec. 2.2.

    GPipe and 1F1B: (p - 1)/m (Sec. 2.2.1); interleaved with v model chunks per GPU:
    (p - 1)/(v*m) (Sec. 2.2.2). As a fraction of the total step: b / (1 + b).
    """
    _choice(schedule, SCHEDULE_CHOICES, "schedule")
    v = virtual_stages if schedule == "interleaved" else 1
    return (pp - 1) / (v * num_microbatches)
