"""The LM head's GEMM fused with cross-entropy: the loss of `hidden @ weight^T + bias` against
target ids, without the (tokens x vocabulary) logits ever held.

Shapes: hidden (N, H) the same on every rank of `group` (the LM head's input), weight (V_r, H)
and bias (V_r,) this rank's slice of the vocabulary (rank r holds global ids
[start_r, start_r + V_r), split as torch.chunk splits V), target (N,) global ids. With
lse = logsumexp over all V logits of a row and x_t its target logit:
    loss      sum over rows whose target is not ignore_index of (lse - x_t), over `divisor`
              (HF's num_items_in_batch), or over the number of those rows (the mean)
    dlogits   s (softmax - onehot(target)),  s = 1 / divisor on counted rows, 0 on ignored
    dhidden   dlogits @ weight            summed over the group (each rank has its slice of V)
    dweight   dlogits^T @ hidden,  dbias = sum_rows dlogits

`transforms` are elementwise steps the model takes from the head's output to the logits it scores,
in order: ("mul", c), ("div", c), ("tanh", None) (Gemma 2's softcap is div, tanh, mul; Cohere's
logit scale a mul). Each chunk takes them in place, in its dtype, as the model's own ops would;
the gradient goes back through them (tanh' from the tanh's output, kept per chunk).

The rows go through in chunks of at most `chunk_bytes` of logits: each chunk's logits are one
GEMM in the operands' dtype (what the unfused head computes), the statistics pass reads them
(kernels/vocab_ce.py: max, sum-exp, target logit in fp32), one all-gather of those (rows, 4)
statistics over the group gives every rank the global lse, and the gradient pass overwrites the
chunk with dlogits, which the dhidden / dweight GEMMs read. Everything the backward needs is
computed in the forward (as Liger Kernel's fused linear cross-entropy does): the backward only
scales the gradients by the loss's gradient. Where no gradient is needed (no_grad, frozen
head and input) only the loss is computed. Communication: one (rows, 4) fp32 all-gather per
chunk and one all-reduce of dhidden; none on a group of one.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tplayers.backend import uses_triton
from tplayers.functional import comm
from tplayers.functional.cross_entropy import combined_lse, local_stats
from tplayers.placement import shard_range

DEFAULT_CHUNK_BYTES = 256 * 2**20  # of logits per chunk: GEMMs big enough to run at speed, a bounded buffer


def _gradient(logits, target, lse, scale, vocab_start):
    """scale * (softmax - onehot) of a chunk, over the chunk in place on the Triton backend."""
    if logits.shape[1] == 0:
        return logits
    if uses_triton(logits):
        from tplayers.kernels.vocab_ce import vocab_ce_grad
    else:  # the reference module does not import triton
        from tplayers.kernels.vocab_ce_ref import vocab_ce_grad_ref as vocab_ce_grad
    return vocab_ce_grad(logits, target, lse, scale, vocab_start)


def _transform(logits, transforms) -> list:
    """Apply the model's logit transforms to a chunk in place; the tanh outputs, for the backward."""
    kept = []
    for op, value in transforms:
        if op == "mul":
            logits.mul_(value)
        elif op == "div":
            logits.div_(value)
        else:
            kept.append(logits.tanh_().clone())
    return kept


def _back_through(grad, transforms, tanh_outputs):
    """d loss / d (the head's output) from d loss / d (the scored logits), in the chunk's dtype."""
    for op, value in reversed(transforms):
        if op == "mul":
            grad.mul_(value)
        elif op == "div":
            grad.div_(value)
        else:
            grad = torch.ops.aten.tanh_backward(grad, tanh_outputs.pop())
    return grad


def _global_lse_and_target(stats, group, n):
    """(lse, target logit) per row over the whole vocabulary from this rank's (rows, 4) statistics."""
    if n == 1:
        return combined_lse(stats[None, :, 0], stats[None, :, 1]), stats[:, 2]
    gathered = stats.new_empty((n, *stats.shape))
    comm.all_gather_into(gathered, stats.contiguous(), group)
    return combined_lse(gathered[..., 0], gathered[..., 1]), gathered[..., 2].sum(0)


class _LinearCrossEntropy(torch.autograd.Function):
    """hidden (N, H), weight (V_r, H), bias (V_r,) or None, target (N,) -> the fp32 scalar loss."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, target, divisor, group, ignore_index, vocab_size, chunk_bytes, transforms, grad_mode
    ):  # fmt: skip
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        rows, v_local = hidden.shape[0], weight.shape[0]
        vocab_start = shard_range(vocab_size, n, rank)[0]
        valid = target != ignore_index
        count = valid.sum()
        divisor = count if divisor is None else divisor
        scale = valid / divisor  # fp32 per-row weight of the loss, 0 on ignored rows
        # needs_input_grad says True under no_grad too: grad mode, as the caller saw it, decides
        want_hidden, want_weight, want_bias = [grad_mode and need for need in ctx.needs_input_grad[:3]]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        losses = hidden.new_zeros((rows,), dtype=torch.float32)
        step = max(1, chunk_bytes // max(1, v_local * hidden.element_size()))
        fused = uses_triton(hidden)  # the Triton statistics and gradient kernels read the chunk as it is
        with torch.autocast(hidden.device.type, enabled=False):  # the operands are already in their GEMM dtype
            for start in range(0, rows, step):
                end = min(rows, start + step)
                h, t = hidden[start:end], target[start:end]
                logits = F.linear(h, weight, bias)  # (chunk, V_r): what the unfused head computes
                tanh_outputs = _transform(logits, transforms)
                # torch's ops read 16-bit logits through one fp32 copy, for the statistics and the gradient
                scored = logits if fused or logits.shape[1] == 0 else logits.float()
                lse, target_logit = _global_lse_and_target(local_stats(scored, t, vocab_start), group, n)
                losses[start:end] = torch.where(valid[start:end], lse - target_logit, 0.0)
                if not (want_hidden or want_weight or want_bias):
                    continue
                grad = _gradient(scored, t, lse, scale[start:end], vocab_start)
                grad = _back_through(grad if grad is logits else logits.copy_(grad), transforms, tanh_outputs)
                if want_hidden:
                    torch.mm(grad, weight, out=grad_hidden[start:end])
                if want_weight:
                    grad_weight.addmm_(grad.t(), h)
                if want_bias:
                    grad_bias += grad.float().sum(0)
        if want_hidden:  # every rank's part of the vocabulary adds to the input's gradient
            comm.all_reduce(grad_hidden, group)
        ctx.grads = [grad_hidden, grad_weight, None if grad_bias is None else grad_bias.to(bias.dtype)]
        return losses.sum() / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError(
                "the fused LM-head cross-entropy was backpropagated twice; its gradients are computed in the "
                "forward and given once (run the forward again, or parallelize(training_logits=True))"
            )
        if _graph_kept():  # retain_graph (a zero-bubble schedule's input pass, then its weight pass): kept
            return (*[None if g is None else g * grad_loss for g in ctx.grads], *[None] * 8)
        grads, ctx.grads = ctx.grads, None  # the last use: scaled in place, no copy at the step's peak
        for g in grads:
            if g is not None:
                g.mul_(grad_loss)  # a 0-d fp32 factor keeps g's dtype: no cast
        return (*grads, None, None, None, None, None, None, None, None)


def _graph_kept() -> bool:
    """Whether the backward running now keeps the graph for another (retain_graph=True). torch's own
    query; where a version lacks it, False: a second backward is then refused, never wrong."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(query()) if query is not None else False


def linear_cross_entropy(
    hidden, weight, bias, target, *, group, vocab_size, ignore_index=-100, divisor=None, transforms=(),
    chunk_bytes=DEFAULT_CHUNK_BYTES,
):  # fmt: skip
    """F.cross_entropy(hidden @ full_weight^T + full_bias, target) (see the module docstring)
    from this rank's vocabulary slice of the head, without the logits. hidden (..., H), target
    (...): flattened together. divisor: None for the mean over rows not ignored, else the sum's
    divisor (a number or a tensor, HF's num_items_in_batch). Returns an fp32 scalar, the same on
    every rank. `group`: a ProcessGroup (the head's). `transforms`: the model's steps from the
    head's output to its logits (module docstring)."""
    bad = [t for t in transforms if not (t[0] == "tanh" or (t[0] in ("mul", "div") and isinstance(t[1], int | float)))]
    if bad:
        raise ValueError(
            f"linear_cross_entropy: transforms must be ('mul' | 'div', number) or ('tanh', None), got {bad}"
        )
    if hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"linear_cross_entropy: target {tuple(target.shape)} does not match the hidden states "
            f"{tuple(hidden.shape)} without their last dim"
        )
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: weight {tuple(weight.shape)} does not take hidden {tuple(hidden.shape)}"
        )
    if torch.is_tensor(divisor):
        divisor = divisor.to(device=hidden.device, dtype=torch.float32)
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1), divisor, group, ignore_index,
        vocab_size, chunk_bytes, tuple(transforms), torch.is_grad_enabled(),
    )  # fmt: skip
