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
from tplayers.placement import shard_range

REDUCTIONS = ("mean", "sum", "none")


def local_stats(logits, target, vocab_start):
    """The fused local pass on the selected backend (kernels/vocab_ce_ref.py gives the contract)."""
    if logits.shape[1] == 0:  # a rank holding none of the vocabulary: a shard that adds nothing
        empty = torch.tensor([float("-inf"), 0.0, 0.0, 0.0], device=logits.device)
        return empty.expand(logits.shape[0], 4).contiguous()
    if uses_triton(logits):
        from tplayers.kernels.vocab_ce import vocab_ce_stats
    else:  # the reference module does not import triton
        from tplayers.kernels.vocab_ce_ref import vocab_ce_stats_ref as vocab_ce_stats
    return vocab_ce_stats(logits, target, vocab_start)


def combined_lse(local_max, local_sum_exp):
    """(R,) log-sum-exp over the whole vocabulary from every shard's (n, R) max and sum-exp,
    combined in rank order (the same on every rank)."""
    row_max = local_max.amax(0)
    # A shard masked to -inf contributes nothing (its sum-exp is 0), never a nan.
    scale = torch.where(local_max == float("-inf"), 0.0, torch.exp(local_max - row_max))
    return row_max + torch.log((local_sum_exp * scale).sum(0))


def check_cross_entropy_args(local_logits, target, ignore_index, label_smoothing, reduction, vocab_size=None):
    """Every check made before any collective. All ranks see the same target and shapes, so all
    raise together instead of one hanging in the all-gather. (What depends on the split, which
    a wrong call may give each rank differently, is checked on what the all-gather brings.)"""
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
    if target.device != local_logits.device:
        raise ValueError(f"{name}: target is on {target.device} but local_logits are on {local_logits.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
        raise ValueError(f"{name}: vocab_size must be a positive int, got {vocab_size!r}")


def _refuse_what_ranks_disagree_on(gathered, group, ignore_index) -> None:
    """gathered (n, R + 1, 5): every rank's statistics and target ids, then the split it was told
    (local size, start, vocabulary) and whether a target fell outside that vocabulary. Raised on
    every rank alike (they all hold the same tensor), so none goes on to another collective."""
    ranks, name = dist.get_process_group_ranks(group), "vocab_parallel_cross_entropy"
    told = gathered[:, -1, :4].long().tolist()  # per rank: [local size, start, vocabulary, bad target]
    vocab = told[0][2]
    expected = [shard_range(vocab, len(ranks), i) for i in range(len(ranks))]
    if any(t[2] != vocab or (t[1], t[0]) != e for t, e in zip(told, expected, strict=True)):
        held = ", ".join(f"rank {r}: {t[0]} from {t[1]} of {t[2]}" for r, t in zip(ranks, told, strict=True))
        raise ValueError(
            f"{name}: the ranks' vocabulary shards are not one split of a vocabulary ({held}); split as torch.chunk "
            f"splits it ({[e[1] for e in expected]} of {vocab}), and pass vocab_size= when it does not divide by "
            f"the group's {len(ranks)} ranks"
        )
    targets = gathered[:, :-1, 4]
    differ = (targets != targets[:1]).any(1)
    if bool(differ.any()):
        other = int(differ.nonzero()[0])
        row = int((targets[other] != targets[0]).nonzero()[0])
        raise ValueError(
            f"{name}: the ranks of group {ranks} hold different targets (row {row}: id {int(targets[0, row])} on the "
            f"first, {int(targets[other, row])} on rank {ranks[other]}); group must be the tensor-parallel group the "
            "logits are split over, whose ranks see the same tokens (e.g. mesh['tp'], not the world under data "
            "parallelism)"
        )
    if told[0][3]:
        bad = targets[0][((targets[0] < 0) | (targets[0] >= vocab)) & (targets[0] != ignore_index)]
        raise ValueError(
            f"{name}: target id {int(bad[0])} is outside the vocabulary [0, {vocab}) and is not ignore_index "
            f"({ignore_index})"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """logits (R, V/n) this rank's vocab shard, target (R,) global ids -> loss per `reduction`."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, reduction, vocab_size):
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        rows, v_local = logits.shape
        vocab = n * v_local if vocab_size is None else vocab_size
        vocab_start = shard_range(vocab, n, rank)[0]
        valid = target != ignore_index
        if rows == 0:  # every rank has no rows: nothing to communicate
            lse = logits.new_zeros((0,), dtype=torch.float32)
            loss = lse
        else:
            stats = local_stats(logits, target, vocab_start)  # (R, 4): max, sum-exp, target logit, logit sum
            # the target ids travel along (exact in fp32 below 2**24): ranks that disagree on them
            # are not one tensor-parallel group (e.g. data-parallel replicas in `group`)
            stats = torch.cat([stats, target.to(stats.dtype)[:, None]], 1)
            bad = bool((((target < 0) | (target >= vocab)) & valid).any())
            told = stats.new_tensor([[v_local, vocab_start, vocab, bad, 0]])  # exact in fp32 below 2**24
            gathered = stats.new_empty((n, rows + 1, 5))
            comm.all_gather_into(gathered, torch.cat([stats, told]), group)
            _refuse_what_ranks_disagree_on(gathered, group, ignore_index)
            local_max, local_sum_exp, target_logit, logit_sum = gathered[:, :-1, :4].unbind(-1)  # each (n, R)
            lse = combined_lse(local_max, local_sum_exp)
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
        return grad.to(logits.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits, target, *, group=None, ignore_index=-100, label_smoothing=0.0, reduction="mean", vocab_size=None
):
    """F.cross_entropy(full_logits, target, ...) from this rank's vocab shard of the logits.

    local_logits (..., V_r): rank r's columns of the logits (the output of a vocab-parallel LM
    head), any float dtype, fp32 math: V / n each, or, with `vocab_size` = V that does not divide
    by the group's n ranks, the columns torch.chunk gives rank r (`tplayers.placement.shard_range`;
    a rank may hold none). target (...): global ids, the same on every rank; rows whose target is
    `ignore_index` add nothing and leave the mean's denominator. label_smoothing spreads eps over
    the full vocabulary V, as torch does. Returns a scalar for "mean" / "sum", a (...) tensor for
    "none", in local_logits' dtype, identical on every rank. Ranks whose shards are not one such
    split (an uneven vocabulary without `vocab_size`) or whose targets differ raise on every rank.
    `group`: ProcessGroup, 1-D DeviceMesh or None.
    """
    group = resolve_group(group)
    check_cross_entropy_args(local_logits, target, ignore_index, label_smoothing, reduction, vocab_size)
    lead = target.shape
    logits2d = local_logits.reshape(target.numel(), local_logits.shape[-1])  # a view where it can be
    loss = _VocabParallelCrossEntropy.apply(
        logits2d, target.reshape(-1), group, ignore_index, float(label_smoothing), reduction, vocab_size
    )
    return loss.reshape(lead) if reduction == "none" else loss
