"""Sharded checkpoints on torch.distributed.checkpoint: each rank writes and reads only its own
shards, under the unsharded HF names, so a checkpoint saved at one layout (TP, DP / ZeRO, PP,
sequence parallel or not) loads at any other.

    chunks.py    what each rank holds of every tensor, as chunks of the unsharded tensor
    planners.py  DCP save / load planners for those chunks (staged loads, deduplicated replicas)
    api.py       save_checkpoint, load_checkpoint: model, masters, optimizer, scaler, extra, RNG
    hf.py        load_pretrained (each rank its slices of a HF safetensors directory, into a model
                 built with parameters_on_meta), save_pretrained (back to a HF directory)

May import everything below it (hf, train, pipeline, data_parallel, nn, functional, foundations).
"""

from tplayers.checkpoint.api import load_checkpoint, save_checkpoint
from tplayers.checkpoint.hf import load_pretrained, parameters_on_meta, save_pretrained
from tplayers.checkpoint.planners import CheckpointError

__all__ = [
    "CheckpointError",
    "load_checkpoint",
    "load_pretrained",
    "parameters_on_meta",
    "save_checkpoint",
    "save_pretrained",
]
