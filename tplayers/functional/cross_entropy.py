"""Vocab-parallel cross-entropy: the loss of logits sharded along the vocabulary, without any
rank materialising the full-vocabulary logits.

Shapes: local_logits (..., V/n) on rank r holding global vocab ids [r V/n, (r+1) V/n); target
(...) global ids, the same on every rank. With eps = label_smoothing and, per row,
lse = logsumexp over all V logits, x_t the target logit and sum_x the sum of all V logits:
    forward   loss = lse - (1 - eps) x_t - eps / V * sum_x     (what F.cross_entropy computes)
    backward  dlogits = w * (softmax(logits) - (1 - eps) onehot(target) - eps / V)
with w = grad_output (reduction "none"), grad_output / #non-ignored ("mean") or grad_output
("sum"), and w = 0 on rows whose target is `ignore_index`. Each rank's backward only touches
its own shard: softmax over the full vocab is exp(logits - lse) with the global lse.

Communication: one fused pass over the local shard (kernels/vocab_ce.py, or its reference)
gives per row the local max, local sum-exp, target logit and logit sum; a single all-gather of
those (R, 4) fp32 statistics, with the target ids beside them (R, 5), lets every rank combine
them (global max, rescaled sum-exps, sums) in the same rank order, so the loss is identical on
every rank, and check that every rank had the same targets: a `group` that is not the
tensor-parallel group of the logits (the world, when data-parallel replicas are in it) is
refused instead of mixing the replicas' tokens into one wrong loss.
"""

import torch
import torch.distributed as dist

from tplayers.backend import uses_triton
from tplayers.distributed import resolve_group
from tplayers.functional import comm

REDUCTIONS = ("mean", "sum", "none")


def _stats(logits, target, vocab_start):
    """The fused local pass on the selected backend (kernels/vocab_ce_ref.py gives the contract)."""
    if uses_triton(logits):
        from tplayers.kernels.vocab_ce import vocab_ce_stats
    else:  # the reference module does not import triton
        from tplayers.kernels.vocab_ce_ref import vocab_ce_stats_ref as vocab_ce_stats
    return vocab_ce_stats(logits, target, vocab_start)


def check_cross_entropy_args(local_logits, target, tp_size, ignore_index, label_smoothing, reduction):
    """Every check made before any collective. All ranks see the same target and shapes, so all
    raise together instead of one hanging in the all-gather."""
    name = "vocab_parallel_cross_entropy"
    if not isinstance(local_logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"{name}: local_logits and target must be Tensors")
    if not local_logits.dtype.is_floating_point:
        raise TypeError(f"{name}: local_logits must be a float tensor, got {local_logits.dtype}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"{name}: target must be an integer tensor of token ids, got {target.dtype}")
    if local_logits.dim() == 0 or tuple(target.shape) != tuple(local_logits.shape[:-1]):
        raise ValueError(
            f"{name}: target shape {tuple(target.shape)} does not match local_logits {tuple(local_logits.shape)} "
            "without its last (vocab) dim"
        )
    if local_logits.shape[-1] == 0:
        raise ValueError(f"{name}: the local vocab shard is empty")
    if target.device != local_logits.device:
        raise ValueError(f"{name}: target is on {target.device} but local_logits are on {local_logits.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {label_smoothing}")
    vocab = local_logits.shape[-1] * tp_size
    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if target.numel() and bool(bad.any()):
        first = int(target[bad].flatten()[0])
        raise ValueError(
            f"{name}: target id {first} is outside the vocabulary [0, {vocab}) "
            f"({local_logits.shape[-1]} per rank of {tp_size}) and is not ignore_index ({ignore_index})"
        )


def _refuse_different_targets(targets, group) -> None:
    """targets (n, R): every rank's ids, gathered. Raised on every rank alike (they all hold the
    same gathered tensor), so none goes on to another collective."""
    differ = (targets != targets[:1]).any(1)
    if bool(differ.any()):
        other = int(differ.nonzero()[0])
        row = int((targets[other] != targets[0]).nonzero()[0])
        raise ValueError(
            f"vocab_parallel_cross_entropy: the ranks of group {dist.get_process_group_ranks(group)} hold different "
            f"targets (row {row}: id {int(targets[0, row])} on the first, {int(targets[other, row])} on rank "
            f"{dist.get_process_group_ranks(group)[other]}); group must be the tensor-parallel group the logits are "
            "split over, whose ranks see the same tokens (e.g. mesh['tp'], not the world under data parallelism)"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """logits (R, V/n) this rank's vocab shard, target (R,) global ids -> loss per `reduction`."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, reduction):
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        rows, v_local = logits.shape
        vocab, vocab_start = n * v_local, rank * v_local
        valid = target != ignore_index
        if rows == 0:  # every rank has no rows: nothing to communicate
            lse = logits.new_zeros((0,), dtype=torch.float32)
            loss = lse
        else:
            stats = _stats(logits, target, vocab_start)  # (R, 4): max, sum-exp, target logit, logit sum
            # the target ids travel along (exact in fp32 below 2**24): ranks that disagree on them
            # are not one tensor-parallel group (e.g. data-parallel replicas in `group`)
            stats = torch.cat([stats, target.to(stats.dtype)[:, None]], 1)
            gathered = stats.new_empty((n, rows, 5))
            comm.all_gather_into(gathered, stats, group)
            _refuse_different_targets(gathered[..., 4], group)
            local_max, local_sum_exp, target_logit, logit_sum = gathered[..., :4].unbind(-1)  # each (n, R)
            row_max = local_max.amax(0)
            # A shard masked to -inf contributes nothing (its sum-exp is 0), never a nan.
            scale = torch.where(local_max == float("-inf"), 0.0, torch.exp(local_max - row_max))
            lse = row_max + torch.log((local_sum_exp * scale).sum(0))
            eps = label_smoothing
            loss = lse - (1.0 - eps) * target_logit.sum(0)
            if eps:
                loss = loss - (eps / vocab) * logit_sum.sum(0)
            loss = torch.where(valid, loss, 0.0)
        count = valid.sum()
        ctx.save_for_backward(logits, target, lse, valid, count)
        ctx.vocab, ctx.vocab_start = vocab, vocab_start
        ctx.label_smoothing, ctx.reduction = label_smoothing, reduction
        if reduction == "mean":  # 0 / 0 = nan when every row is ignored, as in F.cross_entropy
            loss = loss.sum() / count
        elif reduction == "sum":
            loss = loss.sum()
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse, valid, count = ctx.saved_tensors
        eps, vocab = ctx.label_smoothing, ctx.vocab
        weight = grad_loss.float()
        if ctx.reduction == "mean":
            weight = weight / count
        weight = torch.where(valid, weight, 0.0)  # ignored rows get no gradient (and no 0 * inf)
        grad = torch.exp(logits.float() - lse[:, None])  # the full-vocab softmax, this rank's columns
        if eps:
            grad -= eps / vocab
        local = target.long() - ctx.vocab_start
        hit = (local >= 0) & (local < logits.shape[1])
        rows = hit.nonzero().squeeze(1)
        grad[rows, local[rows]] -= 1.0 - eps
        grad *= weight[:, None]
        return grad.to(logits.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits, target, *, group=None, ignore_index=-100, label_smoothing=0.0, reduction="mean"
):
    """F.cross_entropy(full_logits, target, ...) from this rank's vocab shard of the logits.

    local_logits (..., V/n): rank r's columns [r V/n, (r+1) V/n) of the logits (the output of a
    vocab-parallel LM head), any float dtype, fp32 math. target (...): global ids, the same on
    every rank; rows whose target is `ignore_index` add nothing and leave the mean's denominator.
    label_smoothing spreads eps over the full vocabulary V, as torch does. Returns a scalar for
    "mean" / "sum", a (...) tensor for "none", in local_logits' dtype, identical on every rank.
    Every rank's vocab shard must have the same size. `group`: ProcessGroup, 1-D DeviceMesh or None.
    """
    group = resolve_group(group)
    check_cross_entropy_args(local_logits, target, dist.get_world_size(group), ignore_index, label_smoothing, reduction)
    lead = target.shape
    logits2d = local_logits.reshape(-1, local_logits.shape[-1])  # a view where it can be
    loss = _VocabParallelCrossEntropy.apply(
        logits2d, target.reshape(-1), group, ignore_index, float(label_smoothing), reduction
    )
    return loss.reshape(lead) if reduction == "none" else loss
