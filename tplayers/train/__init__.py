"""Training-step pieces that read the placement record: the dynamic loss scaler, global
gradient clipping, fp32 master weights, and `train_step`, which composes them in order.

    scaler.py  DynamicLossScaler (GradScaler API, hysteresis, overflow agreed across ranks)
    clip.py    clip_grad_norm_ (the norm of the full, unsharded gradient; torch's own redirected to it
               on parameters tplayers placed)
    master.py  MixedPrecisionOptimizer (fp32 masters of 16-bit parameters)
    step.py    train_step, StepResult

May import: tplayers.nn, tplayers.functional and the foundations; never tplayers.hf,
tplayers.checkpoint, tplayers.plan or tplayers.tools.
"""

from tplayers.train.clip import clip_grad_norm_, redirect_torch_clipping
from tplayers.train.master import MixedPrecisionOptimizer
from tplayers.train.scaler import DynamicLossScaler
from tplayers.train.step import StepResult, train_step

redirect_torch_clipping()  # torch's clip_grad_norm_ on a parallelized model: the full gradient's norm

__all__ = ["DynamicLossScaler", "MixedPrecisionOptimizer", "StepResult", "clip_grad_norm_", "train_step"]
