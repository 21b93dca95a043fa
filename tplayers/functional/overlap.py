"""The overlap engine: GEMMs decomposed per rank chunk so communication hides behind compute.

Notation: n ranks in `group`, this rank r; sequence-sharded activations are (B, s, *) with
the full sequence S = n * s. GEMMs follow nn.Linear: y = x @ weight^T, weight (N, K).

    all_gather_matmul      x (B, s, K) -> y (B, S, N)   ring all-gather; step i multiplies the
                           chunk it holds into its rows of y while the next chunk is in flight.
    matmul_reduce_scatter  x (B, S, K) -> y (B, s, N)   ring reduce-scatter; step i computes the
                           partial block for one rank, adds the partial sum received from the
                           previous rank and passes it on; the last block computed is our own.
    matmul_all_reduce      x (..., K) -> y (..., N)     GEMM chunked along rows, each chunk's
                           all-reduce in flight while the next chunk is computed.

Communication is asynchronous: NCCL runs it on its own CUDA streams, gloo on its own threads,
so either GEMM backend (Triton or torch) overlaps with it. overlap=False is the plain
one-collective path, kept for comparison. Per-rank chunks are contiguous buffers
(chunk-major, (n, B, s, K)) so they can be sent and received without copies; the GEMMs read
and write strided views of them.
"""

import torch.distributed as dist

from tplayers.backend import gemm
from tplayers.functional import comm

ALL_REDUCE_CHUNKS = 4
# Below this many bytes per chunk, a chunk's collective latency outweighs what overlap hides.
MIN_ALL_REDUCE_CHUNK_BYTES = 1 << 20


def all_gather_chunks(x, group):
    """Every rank's x (B, s, K) as chunks (n, B, s, K), chunk j from rank j."""
    n = dist.get_world_size(group)
    chunks = x.new_empty((n, *x.shape))
    comm.all_gather_into(chunks, x.contiguous(), group)
    return chunks


def all_gather_matmul(x, weight, group, *, bias=None, overlap=True):
    """y = all_gather(x, dim=1) @ weight^T + bias.

    x (B, s, K), weight (N, K) (any strides), bias (N,) -> y (B, n*s, N) and the gathered
    input as chunks (n, B, s, K), chunk j being rank j's x (reused for the weight gradient).
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    B, s, K = x.shape
    y = x.new_empty((B, n * s, weight.shape[0]))
    if n == 1 or not overlap:
        chunks = all_gather_chunks(x, group)
        for j in range(n):
            gemm(chunks[j], weight, bias=bias, out=y[:, j * s : (j + 1) * s])
        return y, chunks
    chunks = x.new_empty((n, B, s, K))
    chunks[r].copy_(x)
    prev, nxt = (r - 1) % n, (r + 1) % n
    for step in range(n):
        held = (r - step) % n
        in_flight = []
        if step < n - 1:  # pass on what we hold, receive what the previous rank holds
            in_flight = comm.exchange(chunks[held], nxt, chunks[(held - 1) % n], prev, group)
        gemm(chunks[held], weight, bias=bias, out=y[:, held * s : (held + 1) * s])
        for work in in_flight:
            work.wait()
    return y, chunks


def matmul_reduce_scatter(x, weight, group, *, bias=None, overlap=True):
    """y = reduce_scatter(x @ weight^T, dim=1) + bias.

    x (B, n*s, K), weight (N, K) (any strides), bias (N,) added once -> y (B, s, N).
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    B, S, K = x.shape
    if S % n:
        raise ValueError(f"sequence length {S} is not divisible by the TP size {n}")
    s, N = S // n, weight.shape[0]
    if n == 1:
        return gemm(x, weight, bias=bias)
    if not overlap:
        partials = x.new_empty((n, B, s, N))
        for j in range(n):
            gemm(x[:, j * s : (j + 1) * s], weight, out=partials[j])
        y = x.new_empty((B, s, N))
        comm.reduce_scatter_into(y, partials, group)
        return y if bias is None else y.add_(bias)
    prev, nxt = (r - 1) % n, (r + 1) % n
    received = x.new_empty((B, s, N))

    def block(step):  # the block rank r computes at `step`; the last one is its own
        b = (r - 1 - step) % n
        return x[:, b * s : (b + 1) * s]

    partial = gemm(block(0), weight)
    for step in range(1, n):
        # Pass the running sum on while receiving the previous rank's; compute meanwhile.
        in_flight = comm.exchange(partial, nxt, received, prev, group)
        # The bias joins only the final sum of our own block, so it is added exactly once.
        partial = gemm(block(step), weight, bias=bias if step == n - 1 else None)
        for work in in_flight:
            work.wait()
        partial += received
    return partial


def matmul_all_reduce(x, weight, group, *, bias=None, overlap=True):
    """y = all_reduce(x @ weight^T) + bias, x (..., K) -> y (..., N); bias added once."""
    r = dist.get_rank(group)
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    y = x.new_empty((M, weight.shape[0]))
    # Rank 0 alone adds the bias inside its GEMM: the sum then holds it once, at no extra pass.
    own_bias = bias if r == 0 else None
    nbytes = M * weight.shape[0] * x.element_size()
    chunks = max(1, min(ALL_REDUCE_CHUNKS, nbytes // MIN_ALL_REDUCE_CHUNK_BYTES)) if overlap else 1
    bounds = [M * i // chunks for i in range(chunks + 1)]
    works = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if hi > lo:
            gemm(x2[lo:hi], weight, bias=own_bias, out=y[lo:hi])
            works.append(comm.all_reduce(y[lo:hi], group, async_op=True))
    for work in works:
        work.wait()
    return y.view(*x.shape[:-1], weight.shape[0])
