"""`unscale_and_stats_ref`: the pure-torch version of the fused gradient pass that dynamic loss
scaling and global gradient clipping share, with the Triton launcher's signature and contract,
and the argument checks both use. No triton import here: it is the CPU path, the test oracle
and the benchmark baseline.

One pass over a list of gradients (fp32 / fp16 / bf16, mixed, any layout, empty ones too):
    unscale   g <- round_to_dtype(fp32(g) * inv_scale)   in place, only if inv_scale is not None;
              exactly the arithmetic of torch._amp_foreach_non_finite_check_and_unscale_
    stats     per tensor, on the stored (unscaled, rounded) values upcast to fp32:
              [sum |g|, sum g^2, max |g|]; a row of zeros for an empty tensor
    found_inf 1.0 if any stored element is inf / -inf / nan, else 0.0
Returned as (stats fp32 (len(tensors), 3), found_inf fp32 (1,)), on the tensors' device.
sum |g| is the 1-norm, sqrt(sum g^2) the 2-norm and max |g| the inf-norm of each gradient: a
clipper sums rows (and across ranks) before taking the root. nan propagates into every column
of its tensor's row, as in torch.linalg.vector_norm.

found_inf differs from torch's op in one corner: torch checks the values *before* unscaling,
this contract the stored values *after*, so a finite fp16 value that inv_scale > 1 pushes past
65504 (stored as inf) is reported here and not by torch. A gradient that holds an inf must
never reach the optimizer, whichever way it got there.
"""

import math
import numbers

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensors(op, tensors, inv_scale):
    """Floating tensors on one device and an inv_scale that is None, a python number or a
    1-element fp32 tensor on that device. Returns the device of the result (cpu for no tensors
    and no inv_scale tensor)."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, list | tuple):
        raise TypeError(f"{op}: tensors must be a list of tensors, got {type(tensors).__name__}")
    device = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: tensors[{i}] must be a Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: tensors[{i}] must be fp32/fp16/bf16, got {t.dtype}")
        if t.layout != torch.strided:
            raise TypeError(f"{op}: tensors[{i}] must be a strided (dense) tensor, got {t.layout}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{op}: tensors[{i}] is on {t.device} but tensors[0] is on {device}")
    if inv_scale is None:
        pass
    elif isinstance(inv_scale, torch.Tensor):
        if inv_scale.dtype != torch.float32:
            raise TypeError(f"{op}: inv_scale must be an fp32 tensor, got {inv_scale.dtype}")
        if inv_scale.numel() != 1:
            raise ValueError(f"{op}: inv_scale must be a 1-element fp32 tensor, got shape {tuple(inv_scale.shape)}")
        if device is None:
            device = inv_scale.device
        elif inv_scale.device != device:
            raise ValueError(f"{op}: inv_scale is on {inv_scale.device} but the tensors are on {device}")
    elif isinstance(inv_scale, bool) or not isinstance(inv_scale, numbers.Real):
        raise TypeError(f"{op}: inv_scale must be None, a float or a 1-element fp32 tensor, got {inv_scale!r}")
    return device if device is not None else torch.device("cpu")


def inv_scale_tensor(inv_scale, device):
    """inv_scale as a (1,) fp32 tensor on `device`: a python number is rounded to fp32 here, so
    both implementations multiply by the same fp32 value (as GradScaler's fp32 scale tensor)."""
    if isinstance(inv_scale, torch.Tensor):
        return inv_scale.reshape(1)
    return torch.full((1,), float(inv_scale), dtype=torch.float32, device=device)


def unscale_and_stats_ref(tensors, inv_scale):
    """Unscale `tensors` in place by `inv_scale` (None: no write) and return (stats, found_inf)
    of the stored values; see the module docstring for the contract."""
    device = check_tensors("unscale_and_stats_ref", tensors, inv_scale)
    tensors = list(tensors)
    stats = torch.zeros((len(tensors), 3), dtype=torch.float32, device=device)
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    if inv_scale is not None and tensors:
        # The arithmetic of torch's _amp_foreach_non_finite_check_and_unscale_ (fp32 product, one
        # rounding to the dtype), written out: torch's CUDA op has no bf16 kernel. Its flag looks at
        # the values before unscaling; ours is taken below, after.
        inv = inv_scale_tensor(inv_scale, device)
        for t in tensors:
            t.copy_(t.float() * inv)
    nonempty = [i for i, t in enumerate(tensors) if t.numel()]
    if not nonempty:  # the inf-norm of an empty tensor has no identity: its row stays zeros
        return stats, found_inf
    grads = [tensors[i] for i in nonempty]
    # dtype=fp32 upcasts every element before it is summed (and keeps fp16 sums from overflowing)
    l1, l2, linf = (torch.stack(torch._foreach_norm(grads, p, dtype=torch.float32)) for p in (1, 2, math.inf))
    # A sum of |g| >= 0 is nan only if some |g| is nan (inf + inf stays inf): make the max say
    # so too, whatever the max kernel of this device does with nan.
    linf = torch.where(torch.isnan(l1), torch.nan, linf)
    stats[nonempty] = torch.stack([l1, l2.square(), linf], dim=1)
    # max |g| is finite exactly when every element is: one flag for all tensors.
    found_inf.copy_((~torch.isfinite(linf)).any().float().reshape(1))
    return stats, found_inf
