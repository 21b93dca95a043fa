"""`vocab_ce_stats_ref`: the pure-torch version of the fused statistics pass that vocab-parallel
cross-entropy makes over one rank's vocab shard of the logits, with the Triton
`vocab_ce_stats`'s signature, and the argument checks both share. No triton import here: it is
the CPU path, the test oracle and the benchmark baseline.

Shapes: logits (R, V_local) (any float dtype, any strides), target (R,) global token ids (any
integer dtype), `vocab_start` the global id of this shard's first column. Returns fp32 (R, 4):
    [:, MAX]     max_j logits[r, j]
    [:, SUMEXP]  sum_j exp(logits[r, j] - max)
    [:, TARGET]  logits[r, target[r] - vocab_start] if the target falls in this shard, else 0
    [:, SUM]     sum_j logits[r, j]                 (the label-smoothing term)

`vocab_ce_grad_ref` is the pure-torch version of the gradient pass the fused LM-head loss makes
over the same shard once the rows' global log-sum-exp `lse` (R,) fp32 is known: with `scale` (R,)
fp32 each row's weight (0 on ignored rows) and `target` global ids,
    grad[r, j] = scale[r] * (exp(logits[r, j] - lse[r]) - [j == target[r] - vocab_start])
in logits' dtype, fp32 math, written over `logits` in place (as the Triton `vocab_ce_grad` does).
"""

import torch

MAX, SUMEXP, TARGET, SUM = range(4)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_args(logits, target, vocab_start):
    if logits.dim() != 2:
        raise ValueError(f"vocab_ce_stats: logits must be 2-D (rows, vocab shard), got {tuple(logits.shape)}")
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"vocab_ce_stats: logits must be fp32/fp16/bf16, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("vocab_ce_stats: the vocab shard is empty")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"vocab_ce_stats: target must be an integer tensor, got {target.dtype}")
    if tuple(target.shape) != (logits.shape[0],):
        raise ValueError(f"vocab_ce_stats: target must have shape ({logits.shape[0]},), got {tuple(target.shape)}")
    if target.device != logits.device:
        raise ValueError(f"vocab_ce_stats: target is on {target.device} but logits are on {logits.device}")
    if not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"vocab_ce_stats: vocab_start must be a non-negative int, got {vocab_start!r}")


def check_grad_args(logits, target, lse, scale, vocab_start):
    check_args(logits, target, vocab_start)
    for name, t in (("lse", lse), ("scale", scale)):
        if t.dtype != torch.float32 or tuple(t.shape) != (logits.shape[0],) or t.device != logits.device:
            raise ValueError(
                f"vocab_ce_grad: {name} must be fp32 ({logits.shape[0]},) on {logits.device}, got {t.dtype} "
                f"{tuple(t.shape)} on {t.device}"
            )


def vocab_ce_grad_ref(logits, target, lse, scale, vocab_start=0):
    """Overwrite `logits` with their cross-entropy gradient and return it (see the module
    docstring); fp32 math in one fp32 copy of a 16-bit shard, none of an fp32 one."""
    check_grad_args(logits, target, lse, scale, vocab_start)
    grad = logits.float()  # the shard itself when fp32
    grad.sub_(lse[:, None]).exp_()
    local = target.long() - vocab_start
    hit = (local >= 0) & (local < logits.shape[1])  # no host sync (no nonzero()): the one-hot by scatter
    grad.scatter_add_(1, local.clamp(0, logits.shape[1] - 1)[:, None], -hit.to(grad.dtype)[:, None])
    grad.mul_(scale[:, None])
    return logits if grad is logits else logits.copy_(grad)


def vocab_ce_stats_ref(logits, target, vocab_start=0):
    """Per-row max, sum-exp, target logit and logit sum of a vocab shard, in fp32 (see the module docstring)."""
    check_args(logits, target, vocab_start)
    x = logits.float()
    stats = x.new_empty((x.shape[0], 4))
    if x.shape[0] == 0:
        return stats
    row_max = x.amax(dim=1)
    stats[:, MAX] = row_max
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)  # an all -inf shard: sum 0, not nan
    stats[:, SUMEXP] = torch.exp(x - shift[:, None]).sum(dim=1)
    local = target.long() - vocab_start
    in_shard = (local >= 0) & (local < x.shape[1])
    picked = x.gather(1, local.clamp(0, x.shape[1] - 1)[:, None]).squeeze(1)
    stats[:, TARGET] = torch.where(in_shard, picked, 0.0)
    stats[:, SUM] = x.sum(dim=1)
    return stats
