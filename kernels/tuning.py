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


class TunedLaunch:
    """An autotuned kernel launched through its tuned config once that is known. Triton's Autotuner
    re-derives its key from every argument on each call (dicts over some 40 arguments and each
    tensor's dtype, ~10-20 us of Python per launch, which a GEMM-bound training step pays hundreds
    of times); here a known shape class is one dict lookup. `key` must determine everything the
    Autotuner's key does (its key arguments and the tensors' dtypes)."""

    def __init__(self, autotuned):
        self.autotuned, self.kernel, self.known = autotuned, autotuned.fn, {}

    def __call__(self, grid, key, *args, **kwargs):
        config = self.known.get(key)
        if config is None:  # first launch of this class: the Autotuner times the configs
            self.autotuned[grid](*args, **kwargs)
            self.known[key] = self.autotuned.best_config.all_kwargs()
            return
        self.kernel[grid](*args, **kwargs, **config)
