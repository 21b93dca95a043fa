"""Where each element a rank holds lives in the unsharded HF tensor: the layout sharded
checkpoints are written and read in, whatever the TP size, the fused layout or the ZeRO stage.

A `Piece` says: along `dim` of `param` (in the layer's own (out, in) order), local index
`local[i]` holds global index `glob[i]` of the HF tensor under `key`, every other dim whole; or,
with dim None, the whole tensor. `transpose`: HF stores the tensor transposed (Conv1D's (in, out)).
A key may have several pieces (a fused [gate; up] held as two halves; a multi-query projection's
split queries and whole keys / values). Each record `parallelize` leaves on the model
(`tplayers.hf.state_dict.EXPORTS`) lists its pieces, from the same row maps its export uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tplayers.placement import shard_range


@dataclass(frozen=True)
class Piece:
    key: str  # under the record's prefix: "weight", "gate_up_proj.weight", ...
    param: torch.Tensor  # the parameter as the module holds it now (a DTensor under ZeRO 2-3)
    dim: int | None = None  # None: the whole tensor
    local: torch.Tensor | None = None  # indices along dim in the TP-local tensor
    glob: torch.Tensor | None = None  # the unsharded indices they hold, same length
    global_size: int | None = None  # the unsharded size along dim
    transpose: bool = False
    # 2-D tensor parallelism: the unsharded shape, and where this rank's tensor starts in it along
    # the other dims (a block: dim None, the whole local tensor at `offset`)
    shape: tuple[int, ...] | None = None
    offset: tuple[int, ...] | None = None
    # rows several ranks hold (shared key / value heads): chunks never span two blocks of `unit`
    # global indices, so the ranks sharing a head name the same chunk, which is written once
    unit: int = 0
    # a second dim held by index (dim, local, glob): a 2-D tensor whose rows and columns are both
    # interleaved (LoRA's B on experts: [gate_r; up_r] rows, this rank's experts' columns)
    cross: tuple | None = None


def block(key, param, shape, offset, dim=None, local=None, glob=None) -> Piece:
    """A tensor of the unsharded `shape` of which this rank holds the block starting at `offset`
    (2-D tensor parallelism: rows over one axis, columns over the other); with `dim`, only the
    `local` indices along it, holding `glob` (interleaved rows inside the block)."""
    size = shape[dim] if dim is not None else None
    return Piece(key, param, dim, local, glob, size, shape=tuple(shape), offset=tuple(offset))


def cross(key, param, shape, first, second) -> Piece:
    """A 2-D tensor of the unsharded `shape` of which this rank holds `first` = (dim, local, glob)
    along one dim and `second` along the other."""
    dim, local, glob = first
    return Piece(key, param, dim, local, glob, shape[dim], shape=tuple(shape), offset=(0,) * len(shape), cross=second)


def own_range(size: int, group) -> torch.Tensor:
    """The indices of this rank's contiguous 1/n of `size`."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return torch.arange(r * size // n, (r + 1) * size // n)


def whole(key, param, transpose=False) -> Piece:
    return Piece(key, param, transpose=transpose)


def split(key, param, dim, group, transpose=False, total=None, unit=1, sizes=None) -> Piece:
    """This rank's contiguous slice of the HF tensor along `dim` (`param.shape` is the TP-local
    shape, also for a ZeRO 2-3 DTensor): of `total` as torch.chunk splits it (or as the explicit
    per-rank `sizes` say), in whole units of `unit` (attention heads: head_dim); None: an even
    1/n, n times the local size."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    total = param.shape[dim] * n if total is None else total
    start, size = (unit * v for v in shard_range(total // unit, n, r, sizes))
    return Piece(key, param, dim, torch.arange(size), torch.arange(start, start + size), total, transpose)


def rows(key, param, own: torch.Tensor, total: int, transpose=False, unit=0) -> Piece:
    """A row map: local row i is row own[i] of the HF tensor's `total` (`unit`: rows other ranks
    hold too, in blocks of that many: see `Piece.unit`)."""
    return Piece(key, param, 0, torch.arange(own.numel()), own, total, transpose, unit=unit)


def halves(key, param, dim, group, total, transpose=False, unit=1, sizes=None) -> list[Piece]:
    """A tensor holding [first_r; second_r] along `dim`: this rank's slice (as torch.chunk splits
    `total`, the size of each half, or as the per-rank `sizes` say, in whole units of `unit`) of
    each half of the HF tensor [first; second]."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    start, size = (unit * v for v in shard_range(total // unit, n, r, sizes))
    own = torch.arange(start, start + size)
    return [
        Piece(key, param, dim, torch.arange(size) + i * size, own + i * total, 2 * total, transpose) for i in range(2)
    ]


def interleaved(keys, param, group, total, *, stacked=False) -> list[Piece]:
    """`ParallelMLP`'s in_proj: local rows alternate (keys[0] row i, keys[1] row i) over this
    rank's rows of each of two HF tensors of `total` rows (split as torch.chunk splits them);
    `stacked`: of each half of one HF tensor [first; second] (both keys the same)."""
    start, half = shard_range(total, dist.get_world_size(group), dist.get_rank(group))
    own, rows = torch.arange(start, start + half), torch.arange(half) * 2  # (a rank may hold none)
    if stacked:
        return [Piece(k, param, 0, rows + i, own + i * total, 2 * total) for i, k in enumerate(keys)]
    return [Piece(k, param, 0, rows + i, own, total) for i, k in enumerate(keys)]


def linear(layer, dim, transpose, group) -> list[Piece]:
    """A column (dim 0), row (dim 1) or replicated (None) linear layer, or an embedding (dim 0),
    split as unevenly as its width (or vocabulary) requires, in its whole units."""
    weight, bias = layer.weight, getattr(layer, "bias", None)
    if dim is None:
        return [whole("weight", weight, transpose)] + ([whole("bias", bias)] if bias is not None else [])
    total, unit, sizes = _full_size(layer, dim), getattr(layer, "split_unit", 1), getattr(layer, "split_sizes", None)
    pieces = [split("weight", weight, dim, group, transpose, total, unit, sizes)]
    if bias is not None:
        pieces.append(
            split("bias", bias, 0, group, total=total, unit=unit, sizes=sizes) if dim == 0 else whole("bias", bias)
        )
    return pieces


def _full_size(layer, dim) -> int | None:
    """The unsharded size of a tplayers layer's split dim (None: not a tplayers layer: even)."""
    if hasattr(layer, "out_features"):
        return getattr(layer, ("out_features", "in_features")[dim])
    if dim == 0:  # an embedding, a norm over a split projection
        return getattr(layer, "num_embeddings", None) or getattr(layer, "hidden_size", None)
    return None
