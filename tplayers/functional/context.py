"""Attention over a sequence split across a context-parallel group: ring, all-gather, Ulysses.

Each rank holds L tokens of every row (`tplayers.functional.context_layout`: any permutation, with
their positions and documents) and its q, k, v (B, H, L, D) / (B, KH, L, D). The three ways:

    ring       K / V rotate around the group, cp - 1 hops, each hop's transfer in flight while the
               current block is attended; partial outputs merged by log-sum-exp in fp32 (the
               kernel writes them in fp32: no low-precision round trip per hop). Backward rotates
               K / V again with their fp32 gradients travelling beside them, cp hops home.
    allgather  K / V gathered once (cheap with few key/value heads), gradients reduce-scattered.
    ulysses    all-to-all from sequence-split to head-split (heads and key/value heads divisible
               by cp), whole-sequence attention on H / cp heads, all-to-all back.

Attention sinks (gpt-oss: a learned logit per head with no value, in every query's softmax) join
after the keys are merged: lse' = logaddexp(lse, sink), o' = o exp(lse - lse'). The backward of
every key block then takes o' and lse' (the sink only adds to the denominator), and the sink's own
gradient is -sum_i exp(sink - lse'_i) rowsum(do_i o'_i).

K / V are never expanded to the query heads before they are sent: a ring hop moves
2 x L x KH x D elements. Every way calls one local attention (kernels/flash_attention.py on the
Triton backend, its reference otherwise) whose backward takes the final o and lse, so each key
block's share of every gradient is exact.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tplayers.backend import uses_triton
from tplayers.functional import comm

METHODS = ("ring", "allgather", "ulysses")


@dataclass(frozen=True)
class AttentionOptions:
    scale: float
    causal: bool = True
    window: int | None = None
    softcap: float | None = None

    def kwargs(self):
        return dict(scale=self.scale, causal=self.causal, window=self.window, softcap=self.softcap)


def _attend(q, k, v, qp, qd, kp, kd, opts, out_dtype=None):
    if uses_triton(q):
        from tplayers.kernels.flash_attention import flash_attention as attend
    elif _fused_on_cpu(q, opts):
        o, lse = _cpu_flash(q, k, v, qp, qd, kp, kd, opts)
        return o.to(out_dtype or q.dtype), lse
    else:  # the reference module does not import triton
        from tplayers.kernels.flash_attention_ref import flash_attention_ref as attend
    return attend(q, k, v, qp, qd, kp, kd, out_dtype=out_dtype, **opts.kwargs())


def _attend_backward(do, q, k, v, o, lse, qp, qd, kp, kd, opts):
    if uses_triton(q):
        from tplayers.kernels.flash_attention import flash_attention_backward as backward
    elif _fused_on_cpu(q, opts):
        return _cpu_flash_backward(do, q, k, v, o, lse, qp, qd, kp, kd, opts)
    else:
        from tplayers.kernels.flash_attention_ref import flash_attention_backward_ref as backward
    return backward(do, q, k, v, o, lse, qp, qd, kp, kd, **opts.kwargs())


# -- the CPU path: torch's fused CPU flash attention with the metadata's mask ---------------------
# The reference materialises every score in fp32 with the heads expanded; torch's CPU kernel is
# tiled and returns the log-sum-exp, and its backward takes the final o / lse, as the ring needs.
# It takes no softcap (the reference serves) and no GQA (K / V expanded here, after any transfer).


def _fused_on_cpu(q, opts):
    return q.device.type == "cpu" and not opts.softcap and q.dtype in (torch.float32, torch.bfloat16)


def _additive_mask(qp, qd, kp, kd, opts, dtype):
    allowed = qd[:, :, None] == kd[:, None, :]
    diff = qp[:, :, None].long() - kp[:, None, :].long()
    if opts.causal:
        allowed &= diff >= 0
    if opts.window is not None:
        allowed &= diff.abs() < opts.window
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))[:, None], allowed


def _expanded(q, t):
    return t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


def _cpu_flash(q, k, v, qp, qd, kp, kd, opts):
    mask, allowed = _additive_mask(qp, qd, kp, kd, opts, q.dtype)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _expanded(q, k), _expanded(q, v), 0.0, False, attn_mask=mask, scale=opts.scale
    )
    seen = allowed.any(-1)[:, None]  # a query that sees no key here: lse -inf (torch's kernel says 0)
    return o, torch.where(seen, lse.float(), float("-inf"))


def _cpu_flash_backward(do, q, k, v, o, lse, qp, qd, kp, kd, opts):
    mask, _ = _additive_mask(qp, qd, kp, kd, opts, q.dtype)
    lse = torch.where(torch.isinf(lse), 0.0, lse)  # rows that see nothing anywhere: every p is 0 anyway
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do.to(q.dtype), q, _expanded(q, k), _expanded(q, v), o.to(q.dtype), lse, 0.0, False,
        attn_mask=mask, scale=opts.scale,
    )  # fmt: skip
    B, KH, N, D = k.shape

    def grouped(t):  # the query heads' shares of each key/value head summed
        return t.float().view(B, KH, -1, N, D).sum(2)

    return dq.float(), grouped(dk), grouped(dv)


def merge_partials(o, lse, o_i, lse_i):
    """Merge a partial attention (o_i, lse_i) into (o, lse) in place (fp32 o): the softmax over
    both key sets. Rows that saw no key in either keep o = 0, lse = -inf."""
    new = torch.logaddexp(lse, lse_i)
    shift = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    o.mul_(torch.exp(lse - shift).unsqueeze(-1)).add_(o_i * torch.exp(lse_i - shift).unsqueeze(-1))
    return o, new


def with_sinks(o, lse, sinks):
    """(o, lse) over the keys -> with each head's sink logit in the softmax (module docstring); o in
    its own dtype, lse fp32. A query that saw no key gets o = 0 (the sink takes all of it)."""
    if sinks is None:
        return o, lse
    new = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
    return (o.float() * torch.exp(lse - new).unsqueeze(-1)).to(o.dtype), new


def sink_grad(do, o, lse, sinks):
    """d loss / d sinks from the final o' and lse' (with the sinks); None without sinks."""
    if sinks is None:
        return None
    p = torch.exp(sinks.float().view(1, -1, 1) - lse)
    return -(p * (do.float() * o.float()).sum(-1)).sum((0, 2)).to(sinks.dtype)


def _neighbours(group):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return n, r, (r + 1) % n, (r - 1) % n


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, layout, group, opts):
        n, r, nxt, prev = _neighbours(group)
        qp, qd, _ = layout.local()
        kv = torch.stack([k, v])
        o = lse = None
        for step in range(n):
            if step < n - 1:  # the next block's transfer runs while this one is attended
                incoming = torch.empty_like(kv)
                works = comm.exchange(kv, nxt, incoming, prev, group, axis="cp")
            o_i, lse_i = _attend(q, kv[0], kv[1], qp, qd, *layout.keys((r - step) % n), opts, out_dtype=torch.float32)
            o, lse = (o_i, lse_i) if o is None else merge_partials(o, lse, o_i, lse_i)
            if step < n - 1:
                for w in works:
                    w.wait()
                kv = incoming
        o, lse = with_sinks(o, lse, sinks)
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.layout, ctx.group, ctx.opts = layout, group, opts
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, sinks, o, lse = ctx.saved_tensors
        layout, group, opts = ctx.layout, ctx.group, ctx.opts
        n, r, nxt, prev = _neighbours(group)
        qp, qd, _ = layout.local()
        do = do.contiguous()
        kv, dkv, dq, in_flight = torch.stack([k, v]), None, None, None
        for step in range(n):
            if step < n - 1:
                incoming = torch.empty_like(kv)
                works = comm.exchange(kv, nxt, incoming, prev, group, axis="cp")
            dq_i, dk_i, dv_i = _attend_backward(do, q, kv[0], kv[1], o, lse, qp, qd, *layout.keys((r - step) % n), opts)
            dq = dq_i if dq is None else dq.add_(dq_i)
            if in_flight is not None:  # the gradient of the block now held, from the rank before
                for w in in_flight[0]:
                    w.wait()
                dkv = in_flight[1]
                dkv[0].add_(dk_i)
                dkv[1].add_(dv_i)
            else:
                dkv = torch.stack([dk_i, dv_i])
            received = torch.empty_like(dkv)  # it follows its block: after the last hop, home
            in_flight = (comm.exchange(dkv, nxt, received, prev, group, axis="cp"), received)
            if step < n - 1:
                for w in works:
                    w.wait()
                kv = incoming
        for w in in_flight[0]:
            w.wait()
        dkv = in_flight[1]
        dsinks = sink_grad(do, o, lse, sinks)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None, None, None


def _gathered(kv, group):
    """Every rank's stacked (2, B, KH, L, D) K / V -> (2, B, KH, n * L, D), rank-major."""
    n = dist.get_world_size(group)
    out = torch.empty((n, *kv.shape), dtype=kv.dtype, device=kv.device)
    comm.all_gather_into(out, kv.contiguous(), group, axis="cp")
    two, B, KH, L, D = kv.shape
    return out.permute(1, 2, 3, 0, 4, 5).reshape(two, B, KH, n * L, D)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, layout, group, opts):
        qp, qd, _ = layout.local()
        kp, _, kd = layout.whole()
        kv = _gathered(torch.stack([k, v]), group)
        o, lse = with_sinks(*_attend(q, kv[0], kv[1], qp, qd, kp, kd, opts), sinks)
        ctx.save_for_backward(q, k, v, sinks, o, lse)
        ctx.layout, ctx.group, ctx.opts = layout, group, opts
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, sinks, o, lse = ctx.saved_tensors
        layout, group = ctx.layout, ctx.group
        n = dist.get_world_size(group)
        qp, qd, _ = layout.local()
        kp, _, kd = layout.whole()
        kv = _gathered(torch.stack([k, v]), group)  # gathered again: not held from forward to backward
        dq, dk, dv = _attend_backward(do.contiguous(), q, kv[0], kv[1], o, lse, qp, qd, kp, kd, ctx.opts)
        B, KH, _, D = dk.shape
        L = k.shape[2]
        blocks = torch.stack([dk, dv]).view(2, B, KH, n, L, D).permute(3, 0, 1, 2, 4, 5).contiguous()
        dkv = torch.empty((2, B, KH, L, D), dtype=blocks.dtype, device=blocks.device)
        comm.reduce_scatter_into(dkv, blocks, group, axis="cp")
        dsinks = sink_grad(do, o, lse, sinks)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None, None, None


def _to_heads(x, group):
    """(B, Hx, L, D) sequence-split -> (B, Hx / n, n * L, D) head-split (rank order)."""
    n = dist.get_world_size(group)
    B, Hx, L, D = x.shape
    send = x.reshape(B, n, Hx // n, L, D).transpose(0, 1).contiguous()
    out = torch.empty_like(send)
    comm.all_to_all(out, send, [1] * n, group, axis="cp")
    return out.permute(1, 2, 0, 3, 4).reshape(B, Hx // n, n * L, D)


def _to_sequence(y, group):
    """The inverse of `_to_heads`: (B, Hx / n, n * L, D) -> (B, Hx, L, D)."""
    n = dist.get_world_size(group)
    B, h, NL, D = y.shape
    send = y.reshape(B, h, n, NL // n, D).permute(2, 0, 1, 3, 4).contiguous()
    out = torch.empty_like(send)
    comm.all_to_all(out, send, [1] * n, group, axis="cp")
    return out.transpose(0, 1).reshape(B, n * h, NL // n, D)


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, layout, group, opts):
        pos, q_doc, k_doc = layout.whole()
        qh, kh, vh = (_to_heads(t, group) for t in (q, k, v))
        mine = None if sinks is None else sinks.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
        o, lse = with_sinks(*_attend(qh, kh, vh, pos, q_doc, pos, k_doc, opts), mine)
        ctx.save_for_backward(qh, kh, vh, sinks, o, lse)
        ctx.layout, ctx.group, ctx.opts = layout, group, opts
        return _to_sequence(o, group)

    @staticmethod
    def backward(ctx, do):
        qh, kh, vh, sinks, o, lse = ctx.saved_tensors
        group = ctx.group
        pos, q_doc, k_doc = ctx.layout.whole()
        do = _to_heads(do, group)
        grads = _attend_backward(do, qh, kh, vh, o, lse, pos, q_doc, pos, k_doc, ctx.opts)
        dq, dk, dv = (_to_sequence(g.to(qh.dtype), group) for g in grads)
        dsinks = None
        if sinks is not None:  # this rank's heads' share, for every query; the sum over cp adds the others'
            n, r = dist.get_world_size(group), dist.get_rank(group)
            dsinks = torch.zeros_like(sinks).view(n, -1)
            dsinks[r] = sink_grad(do, o, lse, sinks.view(n, -1)[r])
            dsinks = dsinks.view_as(sinks)
        return dq, dk, dv, dsinks, None, None, None


class _LocalAttention(torch.autograd.Function):
    """The one-block case: every key on this rank (ParallelAttention's core on the Triton backend)."""

    @staticmethod
    def forward(ctx, q, k, v, meta, opts):
        o, lse = _attend(q, k, v, *meta, opts)
        ctx.save_for_backward(q, k, v, o, lse, *meta)
        ctx.opts = opts
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, *meta = ctx.saved_tensors
        dq, dk, dv = _attend_backward(do.contiguous(), q, k, v, o, lse, *meta, ctx.opts)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def local_attention(q, k, v, q_pos, q_doc, k_pos, k_doc, opts: AttentionOptions):
    """Attention of q (B, H, M, D) over k, v (B, KH, N, D) by the metadata (kernels/flash_attention_ref.py)."""
    return _LocalAttention.apply(q, k, v, (q_pos, q_doc, k_pos, k_doc), opts)


def ulysses_fits(heads, kv_heads, cp) -> bool:
    return heads % cp == 0 and kv_heads % cp == 0


def context_attention(q, k, v, layout, group, opts: AttentionOptions, method="ring", sinks=None):
    """Attention of this rank's queries q (B, H, L, D) over every rank's keys; k, v (B, KH, L, D);
    `sinks` (H,): each head's sink logit, or None."""
    if method == "ulysses" and not ulysses_fits(q.shape[1], k.shape[1], dist.get_world_size(group)):
        raise ValueError(
            f"context='ulysses' needs the heads ({q.shape[1]}) and key/value heads ({k.shape[1]}) on each rank to "
            f"divide by the context-parallel size ({dist.get_world_size(group)}); use 'ring' or 'allgather'"
        )
    fn = {"ring": _RingAttention, "allgather": _AllGatherAttention, "ulysses": _UlyssesAttention}[method]
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"context attention: sinks of shape {tuple(sinks.shape)} for {q.shape[1]} heads")
    return fn.apply(q, k, v, sinks, layout, group, opts)
