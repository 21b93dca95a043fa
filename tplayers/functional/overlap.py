"""The overlap engine: GEMMs decomposed per rank chunk so communication hides behind compute.

Notation: n ranks in `group`, this rank r; sequence-sharded activations are (B, s, *) with
the full sequence S = n * s (or, where the group does not divide S, each rank's s as the
`sizes` the ops take: tplayers.functional.sequence). GEMMs follow nn.Linear: y = x @ weight^T, weight (N, K).

    all_gather_matmul      x (B, s, K) -> y (B, S, N)   ring all-gather; step i multiplies the
                           chunk it holds into its rows of y while the next chunk is in flight.
    matmul_reduce_scatter  x (B, S, K) -> y (B, s, N)   ring reduce-scatter; step i computes the
                           partial block for one rank, adds the partial sum received from the
                           previous rank and passes it on; the last block computed is our own.
    matmul_all_reduce      x (..., K) -> y (..., N)     GEMM split along rows, overlapped with
                           the all-reduce (chunked all-reduces on NCCL; the reduce-scatter
                           ring plus an all-gather ring on gloo, see its docstring).

overlap="auto" (the default) takes, per op and shape, the path the cost model expects to be
faster, the same on every rank (auto_overlap.py); True forces the ring, False the plain
one-collective path. Communication is asynchronous: NCCL runs it on its own CUDA streams, gloo
on its own threads, so either GEMM backend (Triton or torch) overlaps with it. Per-rank chunks
are contiguous buffers (chunk-major, (n, B, s, K)) so they can be sent and received without
copies; the GEMMs read and write strided views of them.
"""

import math

import torch
import torch.distributed as dist

from tplayers.backend import gemm
from tplayers.functional import comm
from tplayers.functional.auto_overlap import measured_op, use_ring
from tplayers.functional.cost_model import all_reduce_chunks


def all_gather_chunks(x, group, sizes=None):
    """Every rank's x (B, s_j, K) as chunks (n, B, max s_j, K), chunk j from rank j, zero past s_j
    (`sizes`: every rank's s_j, an uneven split of the sequence; default x's own on every rank)."""
    n, widest = dist.get_world_size(group), max(sizes) if sizes else x.shape[1]
    if widest != x.shape[1]:  # the collective moves equal blocks
        x = torch.cat([x, x.new_zeros((x.shape[0], widest - x.shape[1], *x.shape[2:]))], 1)
    chunks = x.new_empty((n, *x.shape))
    comm.all_gather_into(chunks, x.contiguous(), group)
    return chunks


def chunk_rows(chunks, sizes):
    """The rows each rank sent of `all_gather_chunks`' chunks (its padding left off)."""
    return [chunk[:, :size] for chunk, size in zip(chunks, sizes, strict=True)]


def _starts(sizes):
    return [sum(sizes[:j]) for j in range(len(sizes))]


def _swiglu_rows(swiglu_out, start, size):
    return {} if swiglu_out is None else {"swiglu_out": swiglu_out[:, start : start + size]}


@measured_op
def all_gather_matmul(x, weight, group, *, bias=None, overlap="auto", swiglu_out=None, widest=None, sizes=None):
    """y = all_gather(x, dim=1) @ weight^T + bias.

    x (B, s, K), weight (N, K) (any strides), bias (N,) -> y (B, S, N) and the gathered
    input as chunks (n, B, s, K), chunk j being rank j's x (reused for the weight gradient).
    swiglu_out (B, S, N/2): also receives silu(y[..., 0::2]) * y[..., 1::2] from each GEMM.
    `widest`: the largest N of any rank, when the ranks' N differ (an uneven split; see
    `use_ring`: every rank must ask about one shape). `sizes`: every rank's s, where they differ
    (an uneven split of the sequence: the chunks are padded to the largest, `chunk_rows` reads
    them; the ring, which passes equal chunks on, is not taken).
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    B, s, K = x.shape
    sizes = list(sizes) if sizes is not None else [s] * n
    uneven = len(set(sizes)) > 1
    y = x.new_empty((B, sum(sizes), weight.shape[0]))
    if uneven or not use_ring("all_gather_matmul", overlap, group, x, B * n * s, K, widest or weight.shape[0]):
        chunks = all_gather_chunks(x, group, sizes)
        for j, (rows, start) in enumerate(zip(chunk_rows(chunks, sizes), _starts(sizes), strict=True)):
            gemm(
                rows, weight, bias=bias, out=y[:, start : start + sizes[j]], **_swiglu_rows(swiglu_out, start, sizes[j])
            )
        return y, chunks
    chunks = x.new_empty((n, B, s, K))
    chunks[r].copy_(x)
    prev, nxt = (r - 1) % n, (r + 1) % n
    for step in range(n):
        held = (r - step) % n
        in_flight = []
        if step < n - 1:  # pass on what we hold, receive what the previous rank holds
            in_flight = comm.exchange(chunks[held], nxt, chunks[(held - 1) % n], prev, group)
        rows = slice(held * s, (held + 1) * s)
        gemm(chunks[held], weight, bias=bias, out=y[:, rows], **_swiglu_rows(swiglu_out, held * s, s))
        for work in in_flight:
            work.wait()
    return y, chunks


def _ring_reduce_scatter(block_input, weight, group, *, bias=None, out=None):
    """The reduce-scatter ring: block j of the output, `block_input(j) @ weight^T`, summed over
    ranks lands on rank j. At each step a rank computes its partial sum for one block while the
    running sum of the block before travels to the next rank; its own block comes last, and
    only that final sum gets the bias, so the bias is added exactly once. Returns this rank's
    block (written into `out` when given).

    Blocks may differ in size (matmul_all_reduce's uneven row split), so the ring's buffers are
    allocated once at the largest block and viewed per step: two partial sums (the one in flight
    and the one being computed; one for two ranks) and one receive buffer. Separate allocations,
    not one: on CPU a block above glibc's 32 MiB mmap threshold is mapped and page-faulted anew
    on every call, which cost more than the whole ring saves (measured: 21 ms for 48 MiB)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return gemm(block_input(0), weight, bias=bias, out=out)
    prev, nxt = (r - 1) % n, (r + 1) % n
    N = weight.shape[0]
    inputs = [block_input((r - 1 - step) % n) for step in range(n)]  # the block computed at each step
    shapes = [(*x_block.shape[:-1], N) for x_block in inputs]
    rows = [math.prod(x_block.shape[:-1]) for x_block in inputs]  # (a rank may hold no columns: K = 0)
    buffers = [inputs[0].new_empty(max(rows) * N) for _ in range(3 if n > 2 else 2)]  # partial(s), then received
    view = lambda buf, step: buf[: rows[step] * N].view(shapes[step])  # noqa: E731
    partial = gemm(inputs[0], weight, out=view(buffers[0], 0))
    for step in range(1, n):
        last = step == n - 1
        received = view(buffers[-1], step)  # the previous rank's running sum of the block we compute now
        in_flight = comm.exchange(partial, nxt, received, prev, group)
        if not last:
            target = view(buffers[step % 2], step)
        else:
            target = out if out is not None else inputs[step].new_empty(shapes[step])
        partial = gemm(inputs[step], weight, bias=bias if last else None, out=target)
        for work in in_flight:
            work.wait()
        partial += received
    return partial


def _ring_all_gather_rows(y, bounds, group, side_work=()):
    """Complete y (M, N), of which this rank holds rows bounds[r]:bounds[r+1], with every other
    rank's rows, passed around the ring in place; `side_work` runs while the first steps are in
    flight."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    prev, nxt = (r - 1) % n, (r + 1) % n
    rows = lambda j: y[bounds[j] : bounds[j + 1]]  # noqa: E731
    side_work = list(side_work)
    for step in range(n - 1):
        in_flight = comm.exchange(rows((r - step) % n), nxt, rows((r - step - 1) % n), prev, group)
        if side_work:
            side_work.pop(0)()
        for work in in_flight:
            work.wait()
    for work in side_work:
        work()


@measured_op
def matmul_reduce_scatter(x, weight, group, *, bias=None, overlap="auto", widest=None, sizes=None):
    """y = reduce_scatter(x @ weight^T, dim=1) + bias.

    x (B, S, K), weight (N, K) (any strides), bias (N,) added once -> y (B, s, N).
    `widest`: the largest K of any rank, when the ranks' K differ (an uneven split).
    `sizes`: every rank's s, where the group does not divide S (default S / n each).
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    B, S, K = x.shape
    if sizes is None and S % n:
        raise ValueError(f"sequence length {S} is not divisible by the TP size {n}")
    sizes = list(sizes) if sizes is not None else [S // n] * n
    starts, N = _starts(sizes), weight.shape[0]
    block = lambda j: x[:, starts[j] : starts[j] + sizes[j]]  # noqa: E731
    if n == 1 or use_ring("matmul_reduce_scatter", overlap, group, x, B * S, widest or K, N):
        return _ring_reduce_scatter(block, weight, group, bias=bias)  # its blocks may differ in size
    widest_rows = max(sizes)
    partials = (x.new_zeros if len(set(sizes)) > 1 else x.new_empty)((n, B, widest_rows, N))  # padding: zeros
    for j in range(n):
        gemm(block(j), weight, out=partials[j, :, : sizes[j]])
    y = x.new_empty((B, widest_rows, N))
    comm.reduce_scatter_into(y, partials, group)
    y = y if widest_rows == sizes[r] else y[:, : sizes[r]].clone()  # its own tensor: callers add to it in place
    return y if bias is None else y.add_(bias)


@measured_op
def matmul_all_reduce(x, weight, group, *, bias=None, overlap="auto", side_work=(), widest=None):
    """y = all_reduce(x @ weight^T) + bias, x (..., K) -> y (..., N); bias added once.
    `widest`: the largest K of any rank, when the ranks' K differ (an uneven split).

    `side_work`: callables with no collectives (a weight gradient, say) to run while the
    reduction is in flight. With overlap on, the GEMM is split along the rows of x and
    overlapped with the reduction (when the ring is taken) in one of two ways, chosen by the
    group's backend:
      NCCL: row chunks, each chunk's all-reduce in flight while the next chunk is computed;
      gloo: n row blocks in the reduce-scatter ring, then a ring all-gather of the reduced
            blocks with `side_work` in its shadow. gloo's all-reduce competes with the GEMM
            for the same CPU cores, while its point-to-point transfers hide behind it (measured
            in bench/linear.py); both send the ring minimum, 2(n-1)/n of y's bytes.
    """
    n = dist.get_world_size(group)
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # (a rank may hold no columns: K = 0)
    M, N = x2.shape[0], weight.shape[0]
    # The result is returned as allocated, not as a view: callers may modify it in place (Falcon's
    # residual +=), which autograd forbids on a view made inside a Function.
    result = x.new_empty((*x.shape[:-1], N))
    y = result.view(M, N)
    if n == 1:  # nothing to reduce: the GEMM alone
        gemm(x2, weight, bias=bias, out=y)
        for work in side_work:
            work()
        return result
    r = dist.get_rank(group)
    overlap = use_ring("matmul_all_reduce", overlap, group, x, M, widest or x2.shape[1], N, side=len(side_work))
    if overlap and dist.get_backend(group) == "gloo":
        bounds = [M * j // n for j in range(n + 1)]
        own = y[bounds[r] : bounds[r + 1]]
        _ring_reduce_scatter(lambda j: x2[bounds[j] : bounds[j + 1]], weight, group, bias=bias, out=own)
        _ring_all_gather_rows(y, bounds, group, side_work)
        return result
    # Rank 0 alone adds the bias inside its GEMM: the sum then holds it once, at no extra pass.
    own_bias = bias if r == 0 else None
    chunks = all_reduce_chunks(M * N * x.element_size()) if overlap else 1
    bounds = [M * i // chunks for i in range(chunks + 1)]
    works = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        gemm(x2[lo:hi], weight, bias=own_bias, out=y[lo:hi])
        works.append(comm.all_reduce(y[lo:hi], group, async_op=overlap))
    for work in side_work:
        work()
    for work in works:
        if work is not None:
            work.wait()
    return result
