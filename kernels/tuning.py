"""Which of a kernel's tuned configs run on this GPU (shared by the autotuned GEMMs).

TPLAYERS_AUTOTUNE=0 launches, untimed, the config of least shared memory for the running GPU
instead of timing each on every new shape: for the kernel tests on a GPU (each hypothesis
example is a new shape) and for runs that must not spend their first steps tuning. It fits
whatever the dtype, where the largest tiles may not with fp32 inputs."""

import os

import torch

AUTOTUNE = os.environ.get("TPLAYERS_AUTOTUNE", "1") != "0"


def _footprint(cfg):
    """Shared memory it asks for, up to a constant: its tiles' sizes times its stages."""
    size = 1
    for name, value in cfg.kwargs.items():
        if name.startswith("BLOCK_"):
            size *= value
    return size * cfg.num_stages


def configs_for_running_gpu(configs, named_args, **kwargs):
    """Triton's `early_config_prune`: the configs written for this GPU's architecture (each
    config's `.arch`: 80 for Ampere, 90 for Hopper and later), or only the least of them."""
    major, _ = torch.cuda.get_device_capability()
    arch = 90 if major >= 9 else 80
    mine = [cfg for cfg in configs if cfg.arch == arch]
    return mine if AUTOTUNE else [min(mine, key=_footprint)]
