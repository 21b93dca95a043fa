"""torch.distributed.checkpoint planners for `ChunkedTensor`s and small objects.

DCP's default planners know whole tensors and DTensors; a tensor-parallel shard is neither (a
fused projection's rank holds several runs of rows), so these planners hand DCP the chunks
themselves: on save one write item per chunk (replicas name the same chunk and DCP's dedup
keeps one writer), on load DCP's own resharding finds the saved chunks overlapping each of ours.
Loads go into staging buffers, copied into the model only once every rank has read everything.
"""

from __future__ import annotations

import io
import math
import pickle

import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import _validate_global_plan, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tplayers.checkpoint.chunks import ChunkedTensor


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model, or cannot be read."""


def _chunk_md(chunk) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes))


class SavePlannerForChunks(SavePlanner):
    """state: {name: ChunkedTensor or a picklable object (bytes, written once)}."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state, self.is_coordinator = state_dict, is_coordinator
        self.chunks = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, value in self.state.items():
            if isinstance(value, ChunkedTensor):
                for chunk in value.chunks:
                    index = MetadataIndex(name, torch.Size(chunk.offsets))
                    self.chunks[index] = chunk
                    data = TensorWriteData(
                        chunk=_chunk_md(chunk),
                        properties=TensorProperties(dtype=value.dtype),
                        size=torch.Size(value.shape),
                    )
                    items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
            else:
                items.append(WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans):
        plans, metadata = create_default_global_save_plan(dedup_save_plans(all_plans), rewrite_index_hints=False)
        errors = _validate_global_plan(plans, metadata)
        if errors:  # ranks describing the same tensor differently: a bug, never written
            raise CheckpointError("checkpoint: the ranks' chunks do not tile their tensors: " + "; ".join(errors[:3]))
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self.state[write_item.index.fqn], buffer)
            buffer.seek(0)
            return buffer
        return self.chunks[MetadataIndex(write_item.index.fqn, write_item.index.offset)].read()


class LoadPlannerForChunks(LoadPlanner):
    """state: {name: ChunkedTensor (read into staging buffers) or None (an object, read into
    `self.objects` with torch.load(weights_only=True): plain data and tensors only)}.

    `staged` (default): every chunk is read into its own buffer and written into the model by
    `commit()`, once everything is read (the peak: this rank's shards once more). Not staged:
    a chunk's buffer is written and freed as soon as its last piece arrives (the peak: about one
    chunk), but a read failing midway leaves the model partly loaded."""

    def __init__(self, staged: bool = True):
        self.staged_load = staged

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.state, self.metadata = state_dict, metadata
        self.staged: dict[tuple, torch.Tensor] = {}  # (name, offsets) -> buffer of the chunk
        self.targets: dict[tuple, object] = {}
        self.missing: dict[tuple, int] = {}  # elements of each chunk still to arrive
        self.dtypes: dict[tuple, torch.dtype] = {}
        self.objects: dict[str, object] = {}

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for name, value in self.state.items():
            md = self.metadata.state_dict_metadata[name]
            if not isinstance(value, ChunkedTensor):
                zero = torch.Size((0,))
                requests.append(
                    ReadItem(
                        type=LoadItemType.BYTE_IO,
                        dest_index=MetadataIndex(name),
                        dest_offsets=zero,
                        storage_index=MetadataIndex(name),
                        storage_offsets=zero,
                        lengths=zero,
                    )  # fmt: skip
                )
                continue
            for chunk in value.chunks:
                items = create_read_items_for_chunk_list(name, md, [_chunk_md(chunk)])
                covered = sum(math.prod(item.lengths) for item in items)
                if covered != chunk.numel:
                    raise CheckpointError(
                        f"checkpoint: {name}: the saved chunks cover {covered} of the {chunk.numel} elements "
                        f"at {chunk.offsets} (size {chunk.sizes}) this rank needs: the checkpoint is incomplete"
                    )
                key = (name, tuple(chunk.offsets))
                self.targets[key], self.missing[key] = chunk, chunk.numel
                self.dtypes[key] = value.dtype
                if self.staged_load:
                    self.staged[key] = self._buffer(key)
                requests += items
        return LoadPlan(requests)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
            raise CheckpointError(f"checkpoint: {read_item.dest_index.fqn} cannot be read safely: {e}") from e

    def _buffer(self, key):
        chunk = self.targets[key]
        return torch.empty(chunk.sizes, dtype=self.dtypes[key], device=chunk.source.device)

    def resolve_tensor(self, read_item: ReadItem):
        key = (read_item.dest_index.fqn, tuple(read_item.dest_index.offset))
        if key not in self.staged:
            self.staged[key] = self._buffer(key)
        buffer = self.staged[key]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            buffer = buffer.narrow(dim, offset, length)
        return buffer

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if self.staged_load:
            return  # `commit` writes the chunks into the model once everything is read
        key = (read_item.dest_index.fqn, tuple(read_item.dest_index.offset))
        self.missing[key] -= math.prod(read_item.lengths)
        if self.missing[key] == 0:
            self.targets[key].write(self.staged.pop(key))

    def commit(self) -> None:
        if self.staged_load:
            for key, chunk in self.targets.items():
                chunk.write(self.staged[key])


def is_tensor_md(md) -> bool:
    return isinstance(md, TensorStorageMetadata)


def is_bytes_md(md) -> bool:
    return isinstance(md, BytesStorageMetadata)
