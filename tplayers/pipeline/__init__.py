"""Pipeline parallelism on torch.distributed.pipelining: stages and schedules, composed with the
tensor-parallel layers and the placement record.

    stage.py      PipelineStage: a module as one stage of `num_stages` over the pipeline group
    schedules.py  ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
    trace.py      trace(schedule): per-rank compute time, bubble and activations in flight of real steps

May import: tplayers.nn, tplayers.functional and the foundations (backend, distributed,
placement); never tplayers.hf or anything above it (`tplayers.pipeline_split`, which splits
HuggingFace models, lives in tplayers.hf).
"""

from tplayers.pipeline.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from tplayers.pipeline.stage import PipelineStage
from tplayers.pipeline.trace import ScheduleTrace, trace

__all__ = [
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleTrace",
    "trace",
]
