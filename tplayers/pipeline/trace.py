"""`trace(schedule)`: what a schedule's steps did on this rank, from the stages' real compute.

    with tplayers.pipeline.trace(schedule) as t:
        schedule.step(x, target=y)
    t.bubble        # idle share of the step on this rank: 1 - compute / step time
    t.peak_in_flight  # most micro-batches whose activations this rank held at once

Compute is the time inside torch's per-micro-batch stage calls (`forward_one_chunk`,
`backward_one_chunk`, `backward_weight_one_chunk`) and the last stage's loss: the module's
forward and backward, never the waits for a neighbour's send. The bubble is then everything else in the step:
the pipeline's fill and drain, and what the sends cost. A micro-batch's activations are in
flight from its forward until its backward releases them (the weight-gradient half, for the
zero-bubble schedules); several stages on one rank (interleaved) each hold 1 / stages-per-rank
of the rank's layers, so `peak_in_flight` counts in micro-batches of the whole rank's layers,
as `tplayers.plan.microbatches_in_flight` predicts.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class ScheduleTrace:
    compute_seconds: float = 0.0  # inside the stages' forward / backward calls
    step_seconds: float = 0.0  # inside schedule.step
    peak_in_flight: float = 0.0  # in micro-batches of this rank's layers
    calls: dict[str, int] = field(default_factory=dict)

    @property
    def bubble(self) -> float:
        """Idle share of the traced steps on this rank."""
        return 1.0 - self.compute_seconds / self.step_seconds if self.step_seconds else 0.0


def _timed(fn, done):
    """`fn`, calling done(seconds, kwargs) after each call."""

    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            done(time.perf_counter() - start, kwargs)

    return call


@contextmanager
def trace(schedule):
    """Trace every `schedule.step` (or `forward_backward`) in the block; yields a ScheduleTrace."""
    out = ScheduleTrace()
    chunks = len(schedule.stages)  # per rank: each stage is 1 / chunks of the rank's layers
    in_flight = [0]

    def compute(name, delta):
        def done(seconds, kwargs):
            out.compute_seconds += seconds
            out.calls[name] = out.calls.get(name, 0) + 1
            in_flight[0] += delta(kwargs)
            out.peak_in_flight = max(out.peak_in_flight, in_flight[0] / chunks)

        return done

    def released_by_backward(kwargs):  # a split backward keeps them for the weight gradient
        return -1 if kwargs.get("full_backward", True) else 0

    deltas = {"forward_one_chunk": lambda kwargs: 1, "backward_one_chunk": released_by_backward,
              "backward_weight_one_chunk": lambda kwargs: -1}  # fmt: skip
    stages = [s.torch_stage for s in schedule.stages]
    for stage in stages:
        for name, delta in deltas.items():
            setattr(stage, name, _timed(getattr(stage, name), compute(name, delta)))
    torch_schedule = schedule._schedule
    loss_fn = torch_schedule._loss_fn  # the last stage's loss is its compute too
    torch_schedule._loss_fn = _timed(loss_fn, compute("loss", lambda kwargs: 0))
    schedule.step = _timed(schedule.step, lambda seconds, _: setattr(out, "step_seconds", out.step_seconds + seconds))
    try:
        yield out
    finally:
        del schedule.step
        torch_schedule._loss_fn = loss_fn
        for stage in stages:
            for name in deltas:
                delattr(stage, name)
