"""tplayers: tensor-parallel transformer layers on fused Triton GEMMs with overlapped communication.

Layers, each importing only those below it (a test checks):

    tplayers.kernels       Triton kernels, launchers and pure-torch `<op>_ref` (no torch.distributed)
    backend, distributed, placement
                           foundations: GEMM backend choice; meshes, groups, launch; the placement record
    tplayers.functional    autograd Functions with their collectives; the overlap engine
    tplayers.nn            tensor-parallel modules: linear, attention, MLP, embedding
    tplayers.train         loss scaler, clipping, master weights, train_step
    tplayers.hf            HuggingFace integration: parallelize, state-dict gather / load
    tplayers.checkpoint    sharded checkpoints on torch.distributed.checkpoint, resharding between layouts
    tplayers.plan          the layout estimator, its validation and CLI
    tplayers.tools         the `tplayers` command: demo, bench, compile-report
    tplayers.testing       worker pool, tolerance table, shard-aware comparisons

This module holds the public names of DESIGN.md's contract and nothing else.
"""

from tplayers.backend import get_backend, set_backend
from tplayers.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_pretrained,
    parameters_on_meta,
    save_checkpoint,
    save_pretrained,
)
from tplayers.data_parallel import Compression, ZeRO3, data_parallel, data_parallel_optimizer
from tplayers.distributed import RankError, init_mesh, launch
from tplayers.functional.comm import count_bytes
from tplayers.functional.cross_entropy import vocab_parallel_cross_entropy
from tplayers.hf import gather_state_dict, load_full_state_dict, next_token_loss, parallelize, pipeline_split
from tplayers.hf.lora_targets import get_peft_model
from tplayers.nn import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    ParallelRMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tplayers.pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from tplayers.placement import ParamPlacement, get_placement
from tplayers.train import DynamicLossScaler, MixedPrecisionOptimizer, StepResult, clip_grad_norm_, train_step

__all__ = [
    "CheckpointError",
    "ColumnParallelLinear",
    "DynamicLossScaler",
    "MixedPrecisionOptimizer",
    "ParallelAttention",
    "ParallelMLP",
    "ParallelRMSNorm",
    "ParamPlacement",
    "PipelineStage",
    "RankError",
    "RowParallelLinear",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "StepResult",
    "VocabParallelEmbedding",
    "ZeRO3",
    "Compression",
    "clip_grad_norm_",
    "count_bytes",
    "data_parallel",
    "data_parallel_optimizer",
    "gather_state_dict",
    "get_backend",
    "get_placement",
    "init_mesh",
    "launch",
    "parameters_on_meta",
    "load_checkpoint",
    "load_full_state_dict",
    "load_pretrained",
    "next_token_loss",
    "parallelize",
    "pipeline_split",
    "save_checkpoint",
    "save_pretrained",
    "get_peft_model",
    "set_backend",
    "train_step",
    "vocab_parallel_cross_entropy",
]
