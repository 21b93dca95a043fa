"""Training loops others wrote, on models tplayers parallelized: HF's Trainer (and any subclass,
TRL's among them) and accelerate. Named in the contract as `tplayers.hf.Trainer`,
`tplayers.hf.parallel_trainer` and `tplayers.hf.prepare`, which `tplayers.hf` imports from here
on first use (importing transformers' Trainer and accelerate takes seconds).

    replicas.py    which ranks share a batch, read from the placement records
    accelerate.py  ParallelAccelerator and `prepare(accelerator, ...)`
    trainer.py     Trainer, parallel_trainer
    trl.py         TRL's fused LM head computed from the whole logits

May import everything below it: tplayers.checkpoint, tplayers.hf, tplayers.train, ... and
transformers / accelerate / trl; nothing imports it but `tplayers.hf`'s lazy names.
"""

from tplayers.loops.accelerate import ParallelAccelerator, prepare
from tplayers.loops.trainer import Trainer, parallel_trainer

__all__ = ["ParallelAccelerator", "Trainer", "parallel_trainer", "prepare"]
