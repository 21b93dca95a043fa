"""What each rank holds of every tensor a checkpoint stores, as rectangular chunks of the
unsharded tensor under its HF name: the form torch.distributed.checkpoint writes, merges and
reshards.

A model parallelized by `tplayers.parallelize` describes its swapped modules itself
(`tplayers.hf.pieces`: row maps, fused halves, interleaves); any other parameter follows its
placement record (Shard(dim) over the TP group: this rank's contiguous 1/n; Replicate or none:
whole). On top, a ZeRO 2-3 DTensor holds rows [a, b) of that along dim 0 (torch.chunk's split),
and under pipeline parallelism a rank holds only its stages' parameters. Replicas describe the
same chunks, which the checkpoint writes once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Shard

from tplayers.hf.pieces import Piece, split, whole
from tplayers.hf.state_dict import export_records, record_name, reshard, under_records
from tplayers.placement import get_placement, local_tensor, replica_rows


@dataclass
class Chunk:
    """offsets / sizes in the unsharded tensor; the data is `source` (what this rank holds)
    selected at `index` along `dim` (None: all of it), transposed when HF stores it so."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    source: torch.Tensor
    dim: int | None
    index: torch.Tensor | None
    transpose: bool
    dim2: int | None = None  # a 2-D source selected along its other dim too (`Piece.cross`)
    index2: torch.Tensor | None = None

    def read(self) -> torch.Tensor:
        data = self.source if self.index is None else self.source.index_select(self.dim, self.index)
        if self.index2 is not None:
            data = data.index_select(self.dim2, self.index2)
        return (data.t() if self.transpose else data).detach().contiguous()

    def write(self, value: torch.Tensor) -> None:
        value = value.t() if self.transpose else value
        with torch.no_grad():
            if self.index is None:
                self.source.copy_(value)
            elif self.index2 is not None:
                rows, cols = (self.index, self.index2) if self.dim == 0 else (self.index2, self.index)
                self.source[rows[:, None], cols[None, :]] = value.to(self.source.dtype)
            else:
                self.source.index_copy_(self.dim, self.index, value.to(self.source.dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class ChunkedTensor:
    """This rank's chunks of one unsharded tensor (none: it holds nothing of it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[Chunk]


def _dp_rows(t) -> tuple[int, int]:
    """The rows [a, b) along dim 0 that a ZeRO 2-3 DTensor's local shard holds (`replica_rows`);
    (0, rows) for anything else."""
    if isinstance(t, DTensor) and (len(t.placements) != 1 or t.placements[0] != Shard(0)):
        raise ValueError(f"checkpoint: a DTensor placed {t.placements}, not ZeRO's Shard(0), is not supported")
    return replica_rows(t)


def _runs(glob: torch.Tensor, unit=0):
    """Positions of `glob` grouped into runs of consecutive values, in increasing order (with
    `unit`, a run also ends at each multiple of it: one run per shared head)."""
    order = torch.argsort(glob)
    values = glob[order]
    ends = values[1:] - values[:-1] != 1
    if unit:
        ends |= values[1:] % unit == 0
    breaks = (torch.nonzero(ends).flatten() + 1).tolist()
    bounds = [0, *breaks, values.numel()]
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def piece_chunks(piece: Piece, tensor) -> tuple[tuple[int, ...], list[Chunk]]:
    """The unsharded shape and this rank's chunks of `piece`, for `tensor` (the piece's parameter,
    or an optimizer state like it)."""
    source = local_tensor(tensor)
    full = list(tensor.shape)  # TP-local, whole over ZeRO's replicas
    if piece.dim is not None:
        full[piece.dim] = piece.global_size
    if piece.shape is not None:  # a 2-D layout's block of the unsharded tensor
        full = list(piece.shape)
    base = list(piece.offset) if piece.offset is not None else [0] * source.dim()
    a, b = _dp_rows(tensor)
    chunks = []
    if piece.dim is None:
        offsets = [base[0] + a, *base[1:]] if source.dim() else []
        chunks.append(Chunk(tuple(offsets), tuple(source.shape), source, None, None, piece.transpose))
    else:
        local, glob = piece.local, piece.glob
        if piece.dim == 0:  # the replica's rows of the local tensor
            keep = (local >= a) & (local < b)
            local, glob = local[keep] - a, glob[keep]
        for run in _runs(glob, piece.unit):
            offsets = [base[0] + a if piece.dim != 0 else 0, *base[1:]]
            offsets[piece.dim] = int(glob[run[0]])
            sizes = list(source.shape)
            sizes[piece.dim] = run.numel()
            index = local[run]
            chunks.append(Chunk(tuple(offsets), tuple(sizes), source, piece.dim, index, piece.transpose))
    if piece.cross is not None:  # each chunk cut again by the runs along the other dim
        dim2, local2, glob2 = piece.cross
        crossed = []
        for c in chunks:
            for run in _runs(glob2):
                offsets, sizes = list(c.offsets), list(c.sizes)
                offsets[dim2], sizes[dim2] = int(glob2[run[0]]), run.numel()
                crossed.append(Chunk(tuple(offsets), tuple(sizes), c.source, c.dim, c.index, c.transpose, dim2,
                                     local2[run]))  # fmt: skip
        chunks = crossed
    if piece.transpose:
        full = full[::-1]
        for c in chunks:
            c.offsets, c.sizes = c.offsets[::-1], c.sizes[::-1]
    return tuple(full), chunks


def _held_here(model) -> set[int] | None:
    """Under pipeline parallelism, the ids of this rank's stages' parameters; None otherwise."""
    staged = {id(p) for p in model.parameters() if getattr(get_placement(p), "pp_group", None) is not None}
    return staged or None


def model_pieces(model) -> dict[str, list[Piece]]:
    """{unsharded name: this rank's pieces} for every tensor of the state dict it holds. `model`:
    the model (all of it, or under pipeline parallelism its stages' parameters), or this rank's
    `tplayers.PipelineStage`s of a model split by `pipeline_split` (the model itself may be gone)."""
    stages = _stages(model)
    if stages is None:
        return _pieces(model, export_records(model), lambda name: name, _held_here(model))
    out = {}
    for module in stages:
        out.update(_pieces(module, module.hf_records, module.hf_name, None))
    return out


def parameters(model):
    """The parameters of `model` or of its stages (see `model_pieces`)."""
    stages = _stages(model)
    return list(model.parameters()) if stages is None else [p for m in stages for p in m.parameters()]


def _stages(model):
    """The stage modules when `model` is a PipelineStage or a list of them, else None."""
    from tplayers.pipeline import PipelineStage

    items = model if isinstance(model, list | tuple) else [model]
    if not all(isinstance(s, PipelineStage) for s in items):
        return None
    modules = [s.module for s in items]
    if not all(hasattr(m, "hf_name") for m in modules):
        raise ValueError(
            "checkpoint: stages not made by tplayers.pipeline_split do not know the model's names; pass the model"
        )
    return modules


def _pieces(model, records, rename, held) -> dict[str, list[Piece]]:
    reshard(model)  # the pieces hold the parameters: their shards, not gathered tensors FSDP2 will free
    out: dict[str, list[Piece]] = {}
    covered = []
    for record in records:
        covered.append(record.prefix)
        for piece in record.pieces():
            if held is None or id(piece.param) in held:
                out.setdefault(record_name(record.prefix, piece.key), []).append(piece)
    params = {id(p) for p in model.parameters()}
    owners = {name.rpartition(".")[0] for name, p in model.named_parameters() if held is None or id(p) in held}
    covered = frozenset(covered)
    for local, t in model.state_dict(keep_vars=True).items():
        name = rename(local)
        if under_records(name, covered):
            continue
        if held is not None and (id(t) not in held if id(t) in params else local.rpartition(".")[0] not in owners):
            continue  # another stage's
        placement = get_placement(t)
        if placement is not None and placement.is_sharded:
            out[name] = [split(name, t, placement.placement.dim, placement.group)]
        else:
            out[name] = [whole(name, t)]
    return out


def chunked(pieces: list[Piece], tensors=None) -> ChunkedTensor:
    """The ChunkedTensor of `pieces` (of one unsharded tensor), each for its parameter or for
    `tensors[i]` in its place."""
    shape, chunks, dtype = None, [], None
    for i, piece in enumerate(pieces):
        t = piece.param if tensors is None else tensors[i]
        piece_shape, piece_chunks_ = piece_chunks(piece, t)
        if shape is not None and piece_shape != shape:
            raise AssertionError(f"pieces of one tensor disagree on its shape: {shape} vs {piece_shape}")
        shape, dtype = piece_shape, t.dtype
        chunks += piece_chunks_
    return ChunkedTensor(shape, dtype, chunks)
