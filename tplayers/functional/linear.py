"""Autograd Functions of the column- and row-parallel linear layers.

n = TP size. Shard shapes (weight layout is nn.Linear's (out, in)):

ColumnParallel: weight (N/n, K), bias (N/n,)
    plain: x (..., K) replicated    -> y (..., N/n) = x W^T + b
           dgrad dx = matmul_all_reduce(dy, W^T), the wgrad dW = dy^T x computed while its
           reduction is in flight (reduce_input_grad=False: dx = dy W, summed by the caller)
    SP:    x (B, s, K) seq-sharded  -> y (B, S, N/n) = all_gather_matmul(x, W)
           dgrad dx = matmul_reduce_scatter(dy, W^T);  wgrad dW = sum_j dy_j^T x_j over the
           gathered chunks saved in forward (no second all-gather)
RowParallel:    weight (N, K/n), bias (N,) replicated
    plain: x (..., K/n)             -> y (..., N) = matmul_all_reduce(x, W) + b
           dgrad dx = dy W;  wgrad dW = dy^T x;  db = sum dy (dy is whole on every rank)
    SP:    x (B, S, K/n)            -> y (B, s, N) = matmul_reduce_scatter(x, W) + b
           dgrad dx = all_gather_matmul(dy, W^T); wgrad dW = sum_j dy_j^T x_j and
           db = sum of the gathered dy, both from the chunks the dgrad gathered: every rank
           gets the whole bias gradient without another collective.
Under SP each rank's s is its part of the sequence as tplayers.functional.sequence records it
(S = n * s, or a length the group does not divide), kept in the context for backward.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tplayers.backend import gemm, gemm_runs_triton
from tplayers.functional.overlap import (
    all_gather_chunks,
    all_gather_matmul,
    chunk_rows,
    matmul_all_reduce,
    matmul_reduce_scatter,
)
from tplayers.functional.sequence import gathered_sizes, scattered_sizes


def _flat(t):
    """(..., N) -> (rows, N), also where N is 0 (a rank holding none of an uneven split)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _wgrad(dy, x, dtype):
    """dW = dy^T x over all rows: dy (..., N), x (..., K) -> (N, K)."""
    return gemm(_flat(dy).t(), _flat(x).t(), out_dtype=dtype)


def _wgrad_from_chunks(dy_chunks, x_chunks, dtype):
    """dW = sum_j dy_j^T x_j with dy_j (B, s, N), x_j (B, s, K): fp32 accumulation across chunks."""
    N, K = dy_chunks[0].shape[-1], x_chunks[0].shape[-1]
    acc = dy_chunks[0].new_zeros((N, K), dtype=torch.float32)
    for dy_j, x_j in zip(dy_chunks, x_chunks, strict=True):
        gemm(dy_j.transpose(1, 2), x_j.transpose(1, 2), reduce_batch=True, out=acc, accumulate=True)
    return acc.to(dtype)


def _seq_chunks(t, sizes):
    """t (B, S, ...) -> each rank's part of the sequence, (B, sizes[j], ...) views."""
    return t.split(list(sizes), dim=1)


class ColumnParallelLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, overlap, reduce_input_grad, widest):
        ctx.group, ctx.sequence_parallel, ctx.overlap = group, sequence_parallel, overlap
        ctx.has_bias, ctx.reduce_input_grad, ctx.widest = bias is not None, reduce_input_grad, widest
        if sequence_parallel:
            ctx.sizes = gathered_sizes(x, 1, group)  # every rank's part of the sequence
            y, chunks = all_gather_matmul(x, weight, group, bias=bias, overlap=overlap, widest=widest, sizes=ctx.sizes)
            ctx.save_for_backward(chunks, weight)
            return y
        ctx.save_for_backward(x, weight)
        return gemm(_flat(x), weight, bias=bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        saved, weight = ctx.saved_tensors
        return (*column_backward(ctx, dy, saved, weight), None, None, None, None, None)


def column_backward(ctx, dy, saved, weight):
    """(dx, dW, db) of a column-parallel GEMM from its output gradient dy; `saved` is the input
    (plain) or the gathered input chunks (sequence parallel). Shared with the fused SwiGLU GEMM."""
    group = ctx.group
    widest = getattr(ctx, "widest", None)  # the widest rank's output features (uneven splits)
    dx = dw = db = None
    if ctx.sequence_parallel:
        if ctx.needs_input_grad[0]:
            dx = matmul_reduce_scatter(dy, weight.t(), group, overlap=ctx.overlap, widest=widest, sizes=ctx.sizes)
        if ctx.needs_input_grad[1]:
            dw = _wgrad_from_chunks(_seq_chunks(dy, ctx.sizes), chunk_rows(saved, ctx.sizes), weight.dtype)
    else:
        grads = {}
        wgrad = lambda: grads.setdefault("dw", _wgrad(dy, saved, weight.dtype))  # noqa: E731
        if ctx.needs_input_grad[0] and not ctx.reduce_input_grad:  # the caller sums dx once, later
            dx = gemm(_flat(dy), weight.t()).view(*dy.shape[:-1], weight.shape[1])
            if ctx.needs_input_grad[1]:
                wgrad()
        elif ctx.needs_input_grad[0]:  # the weight gradient is computed in the all-reduce's shadow
            side_work = [wgrad] if ctx.needs_input_grad[1] else []
            dx = matmul_all_reduce(dy, weight.t(), group, overlap=ctx.overlap, side_work=side_work, widest=widest)
        elif ctx.needs_input_grad[1]:
            wgrad()
        dw = grads.get("dw")
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = _flat(dy).sum(0)
    return dx, dw, db


class RowParallelLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, overlap, widest):
        ctx.group, ctx.sequence_parallel, ctx.overlap, ctx.widest = group, sequence_parallel, overlap, widest
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        if sequence_parallel:
            ctx.sizes = scattered_sizes(x, 1, group)  # every rank's part of the sequence
            return matmul_reduce_scatter(x, weight, group, bias=bias, overlap=overlap, widest=widest, sizes=ctx.sizes)
        return matmul_all_reduce(x, weight, group, bias=bias, overlap=overlap, widest=widest)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.sequence_parallel:
            if ctx.needs_input_grad[0]:
                dx, dy_chunks = all_gather_matmul(
                    dy, weight.t(), ctx.group, overlap=ctx.overlap, widest=ctx.widest, sizes=ctx.sizes
                )
            else:  # only the weight / bias grads: gather dy, skip the dgrad GEMM
                dy_chunks = all_gather_chunks(dy, ctx.group, ctx.sizes)
            if ctx.needs_input_grad[1]:
                dw = _wgrad_from_chunks(chunk_rows(dy_chunks, ctx.sizes), _seq_chunks(x, ctx.sizes), weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy_chunks.sum((0, 1, 2))  # the chunks' padding (an uneven split) is zeros
            return dx, dw, db, None, None, None, None
        if ctx.needs_input_grad[0]:
            dx = gemm(_flat(dy), weight.t()).view(*dy.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            dw = _wgrad(dy, x, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = _flat(dy).sum(0)
        return dx, dw, db, None, None, None, None


def _alone(x, weight, bias, group, sequence_parallel) -> bool:
    """A group of one without SP, where torch runs the GEMM: nn.Linear's own op then, whose backward
    autograd runs without a Python Function (the same GEMMs; ~50 us less host time per layer)."""
    return (
        not sequence_parallel and dist.get_world_size(group) == 1 and not gemm_runs_triton(_flat(x), weight, bias=bias)
    )


def column_parallel_linear(
    x, weight, bias, group, *, sequence_parallel=False, overlap="auto", reduce_input_grad=True, widest=None
):
    """reduce_input_grad=False (plain mode only) leaves dx as this rank's partial sum, for callers
    that feed several column layers one input and sum its gradient once (copy_to_tp_region or
    all_gather_sequence before them): one collective instead of one per layer. `widest`: the
    largest rank's output features where a split is uneven (the overlap choice is asked about
    one shape on every rank)."""
    if sequence_parallel and not reduce_input_grad:
        raise ValueError("reduce_input_grad=False applies to plain (not sequence-parallel) column layers")
    if _alone(x, weight, bias, group, sequence_parallel):
        return F.linear(x, weight, bias)
    return ColumnParallelLinearFn.apply(x, weight, bias, group, sequence_parallel, overlap, reduce_input_grad, widest)


def row_parallel_linear(x, weight, bias, group, *, sequence_parallel=False, overlap="auto", widest=None):
    """`widest`: the largest rank's input features where a split is uneven."""
    if _alone(x, weight, bias, group, sequence_parallel):
        return F.linear(x, weight, bias)
    return RowParallelLinearFn.apply(x, weight, bias, group, sequence_parallel, overlap, widest)
