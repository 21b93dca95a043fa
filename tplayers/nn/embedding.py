"""Vocab-parallel embedding: the embedding table split along the vocabulary over a TP group.

Rank r of n holds rows [r V/n, (r+1) V/n) of the (V, D) table (weight (V/n, D), placement
Shard(0)). Forward: ids (...) replicated over the group -> (..., D) replicated; each rank
looks up the ids in its shard, writes zeros for the others, and the partial results are
all-reduced (one rank contributes each row, so the sum is exact). Backward: the all-reduce's
adjoint is the identity, so each rank's weight grad is its slice of the unsharded one.

On a 2-D tensor-parallel mesh (`init_mesh(tp=(r, c))["tp_r", "tp_c"]`) the vocabulary splits
over all r x c ranks of the grid (its flattened group), the output whole on each: the grid
model's edges (`tplayers.hf.grid`), split along the features over tp_c by the blocks' entry.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from tplayers.distributed import resolve_group
from tplayers.functional.collectives import own_slice, reduce_from_tp_region
from tplayers.nn.linear import refuse_own_forward
from tplayers.placement import PlacedModule, shard_range


class VocabParallelEmbedding(PlacedModule):
    """nn.Embedding(num_embeddings, embedding_dim, padding_idx) with the vocabulary split over `group`.

    Input: integer ids (...) in [0, num_embeddings), the same on every rank. Output: (..., embedding_dim),
    the same on every rank. The padding row's gradient stays zero, as in nn.Embedding.
    """

    _placements = {"weight": Shard(0)}  # rank r holds its rows as torch.chunk splits V (shard_range)

    def __init__(
        self, num_embeddings, embedding_dim, padding_idx=None, *, group=None, device=None, dtype=None
    ):  # fmt: skip
        super().__init__()
        self.group = resolve_group(group)
        self.tp_size = dist.get_world_size(self.group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # uneven vocabularies (50257) split as torch.chunk splits them; a rank may hold no rows
        self.vocab_start, self.num_embeddings_per_rank = shard_range(
            num_embeddings, self.tp_size, dist.get_rank(self.group)
        )
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} must be within num_embeddings ({num_embeddings})")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        # Drawn exactly as nn.Embedding would on the CPU, so a layer built under a seed holds the
        # shard of the nn.Embedding built under the same seed; device="meta" skips it.
        init_device = "meta" if device is not None and torch.device(device).type == "meta" else "cpu"
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=init_device, dtype=dtype)
        self._set_shard(full.weight.detach(), device)
        self.register_load_state_dict_post_hook(self._tag_parameters)

    @property
    def local_padding_idx(self):
        """The padding row's index in this rank's shard, or None if another rank holds it."""
        if self.padding_idx is None:
            return None
        local = self.padding_idx - self.vocab_start
        return local if 0 <= local < self.num_embeddings_per_rank else None

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, group=None, device=None, dtype=None):
        """The layer holding this rank's rows of `embedding` (which is left unchanged)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"{cls.__name__}.from_embedding needs an nn.Embedding, got {type(embedding).__name__}")
        refuse_own_forward(embedding, nn.Embedding, cls.__name__)
        # max_norm and scale_grad_by_freq would also act on row 0, where out-of-shard ids are sent;
        # sparse gradients are not reduced by anything in tplayers.
        options = {"max_norm": embedding.max_norm is not None, "scale_grad_by_freq": embedding.scale_grad_by_freq,
                   "sparse": embedding.sparse}  # fmt: skip
        unsupported = [name for name, used in options.items() if used]
        if unsupported:
            raise ValueError(f"{cls.__name__}: unsupported nn.Embedding options {unsupported}")
        dtype = dtype or embedding.weight.dtype
        layer = cls(
            embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, group=group,
            device="meta", dtype=dtype,
        )  # fmt: skip
        layer._set_shard(embedding.weight.detach().to(dtype), device or embedding.weight.device)
        return layer

    def _set_shard(self, weight, device):
        self.weight = nn.Parameter(own_slice(weight, 0, self.group).to(device=device, copy=True))
        self._tag_parameters()

    def check_input(self, ids):
        """The checks every rank makes before the all-reduce (all ranks see the same ids)."""
        name = type(self).__name__
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name}: input must be a Tensor of token ids, got {type(ids).__name__}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{name}: input must be an integer tensor of token ids, got {ids.dtype}")
        if ids.device != self.weight.device:
            raise ValueError(f"{name}: input is on {ids.device} but the weight is on {self.weight.device}")
        if self.tp_size == 1:  # the whole table here: F.embedding itself refuses an id outside it
            return
        if ids.is_cuda:  # checked on the device, no host sync: an id outside fails the step loudly
            torch._assert_async(((ids >= 0) & (ids < self.num_embeddings)).all(),
                                f"{name}: token ids must be in [0, {self.num_embeddings})")  # fmt: skip
        elif ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_embeddings:
                raise ValueError(
                    f"{name}: token ids must be in [0, {self.num_embeddings}), got ids from {low} to {high}"
                )

    def forward(self, ids):
        self.check_input(ids)
        if self.tp_size == 1:  # nothing is another rank's: nn.Embedding's own lookup
            return nn.functional.embedding(ids, self.weight, self.local_padding_idx)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings_per_rank)
        # Out-of-shard ids look up row 0 and are zeroed: their gradient to row 0 is exactly zero.
        local = local.masked_fill(outside, 0)
        if self.num_embeddings_per_rank:
            out = nn.functional.embedding(local, self.weight, self.local_padding_idx)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        else:  # no rows here: every id is another rank's (the weight still joins backward)
            out = ids.new_zeros((*ids.shape, self.embedding_dim), dtype=self.weight.dtype) + self.weight.sum()
        return reduce_from_tp_region(out, self.group)

    def extra_repr(self):
        return (
            f"{self.num_embeddings}, {self.embedding_dim} ({self.num_embeddings_per_rank} rows per rank of "
            f"{self.tp_size}), padding_idx={self.padding_idx}"
        )
