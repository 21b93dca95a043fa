"""The split of the sequence that sequence parallelism opens, so a length the group does not divide
splits too.

Each rank holds `even_sizes(total, n)` of the residual stream's `total` tokens (9 over 4: 3, 2, 2,
2). A rank holding its part cannot tell the whole from it (lengths 8 and 9 both give rank 1 two
tokens), so whoever opens the split (tplayers.hf.parallelize's hooks, a pipeline stage) records
the whole length here, per thread, and the sequence collectives read it: an all-gather learns every
rank's part from it, a reduce-scatter how the whole it holds divides. Backward passes never read
it: each collective keeps the sizes it used in its autograd context.

Rows flattened from (batch, sequence) to (tokens, ...) (an MoE block's) hold batch x their rank's
tokens, so their parts are the sizes times the batch. Where no split is open, or a gather runs
along the features (the last dim), every rank holds as many as this one.
"""

import contextlib
import threading

import torch
import torch.distributed as dist

from tplayers.functional.rng import enter_sequence_region, leave_sequence_region
from tplayers.placement import even_sizes


class _Open(threading.local):
    def __init__(self):
        self.splits = []  # (total, n, reopened in backward) of each split open on this thread, innermost last


_open = _Open()


def open_split(total: int, n: int, reopened: bool = False) -> None:
    """From here on the residual stream's `total` tokens are split over a group of `n` (until close_split;
    `reopened`: by a backward, for a block's recompute)."""
    _open.splits.append((int(total), n, reopened))


@contextlib.contextmanager
def sequence_split(length: int, group):
    """Run tplayers' sequence-parallel layers (ColumnParallelLinear / RowParallelLinear / ParallelMLP
    with sequence_parallel=True) on a sequence of `length` tokens split over `group` as
    `even_sizes(length, n)` splits it: each rank passes its part, (B, its tokens, H). Needed only
    where the group does not divide `length`; backward may run outside it (each collective keeps
    its sizes), a recompute of the layers (activation checkpointing) must run inside one too.
    Inside it each rank draws random numbers (dropout on its part) from a stream of its own; leaving
    it, the default generators (CPU, and the current CUDA device's) come back alike on every rank
    (`tplayers.functional.rng.enter_sequence_region`)."""
    n = dist.get_world_size(group)
    if length < n:
        raise ValueError(f"sequence_split: {length} tokens over {n} ranks would leave a rank none")
    devices = [torch.device("cpu")]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    open_split(length, n)
    for device in devices:
        enter_sequence_region(device, group)
    try:
        yield even_sizes(length, n)
    finally:
        for _ in devices:
            leave_sequence_region()
        close_split((length, n))


def close_split(expected=None) -> None:
    """Close the innermost split (`expected`: its (total, n), where a backward closes what it opened:
    a split not open is left alone)."""
    if expected is None or (_open.splits and _open.splits[-1][:2] == (int(expected[0]), expected[1])):
        _open.splits.pop()


def forget_reopened() -> None:
    """Close the splits a backward reopened and did not close (stopped early: `torch.autograd.grad` of
    an inner tensor): a model's forward must not read them. Splits its forward runs inside stay."""
    _open.splits[:] = [split for split in _open.splits if not split[2]]


def open_length(n: int) -> int | None:
    """The whole length of the innermost open split over a group of `n`, or None (none open)."""
    return _open.splits[-1][0] if _open.splits and _open.splits[-1][1] == n else None


def whole_length(local: int, n: int) -> int:
    """The whole length of a sequence a rank holds `local` tokens of, split over a group of `n`: the
    open split's, else n even parts."""
    return (n > 1 and open_length(n)) or local * n


def split_sizes(n: int) -> list[int] | None:
    """Every rank's tokens of the innermost open split over a group of `n`, or None (none open)."""
    if not _open.splits or _open.splits[-1][1] != n:
        return None
    return even_sizes(_open.splits[-1][0], n)


def _along_sequence(x, dim) -> bool:
    return dim % x.dim() != x.dim() - 1


def gathered_sizes(x, dim, group) -> list[int]:
    """Every rank's size along `dim` of the parts an all-gather of this rank's `x` joins."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    local, sizes = x.shape[dim], split_sizes(n)
    if sizes is None or not _along_sequence(x, dim) or len(set(sizes)) == 1:
        return [local] * n
    if local % sizes[r]:
        raise ValueError(
            f"sequence parallelism: this rank holds {local} along dim {dim} of {tuple(x.shape)}, not its "
            f"{sizes[r]} tokens of the sequence of {sum(sizes)} split {sizes} (or a multiple, for rows of a batch)"
        )
    per = local // sizes[r]
    return [per * s for s in sizes]


def scattered_sizes(x, dim, group) -> list[int]:
    """Every rank's size along `dim` of the parts a reduce-scatter of the whole `x` leaves them."""
    n, total, sizes = dist.get_world_size(group), x.shape[dim], split_sizes(dist.get_world_size(group))
    if sizes is not None and _along_sequence(x, dim) and total % sum(sizes) == 0:
        per = total // sum(sizes)
        return [per * s for s in sizes]
    if total % n:
        raise ValueError(
            f"sequence parallelism: {total} along dim {dim} of {tuple(x.shape)} does not split over {n} ranks "
            "evenly, and no sequence split is open: run the layers inside "
            f"tplayers.functional.sequence_split({total}, group) (parallelize(sequence_parallel=True) opens one "
            "for a model's blocks)"
        )
    return [total // n] * n
