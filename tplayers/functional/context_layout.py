"""Which tokens each context-parallel rank holds, and what attention needs to know about them.

Causal attention does more work for late tokens than early ones, so a plain split along the
sequence leaves the last rank with most of it. Each document (the whole row when nothing is
packed) is cut into 2 x cp near-equal chunks and rank r takes chunks r and 2cp - 1 - r (the
head-tail, or zigzag, layout) of every document: each rank gets an early and a late part of each,
whatever the documents' lengths. Ranks are then padded to one length (a multiple of `multiple`,
the tensor-parallel size under sequence parallelism), so nothing has to divide anything.

Attention reads masks from per-token metadata instead of positions in the local tensor (the
kernels' contract, kernels/flash_attention_ref.py), so any permutation is exact:

    pos    the token's index in the row (causality and sliding windows, as HF's masks use it)
    q_doc  its document as a query; -2 on padding slots (they see nothing)
    k_doc  its document as a key; -1 on padding slots and on keys the attention mask hides

Documents are read as HF reads them: with no attention mask, position_ids that restart
(`find_packed_sequence_indices`: a new document wherever a position is not its predecessor + 1)
delimit packed documents; otherwise each row is one document and its attention mask hides keys.
"""

from dataclasses import dataclass

import torch

PAD_QUERY, PAD_KEY = -2, -1


@dataclass
class ContextLayout:
    """One forward's token layout over `cp` ranks; every field (B, cp, L) (int64 index, int32
    metadata), the same on every rank. `index` is each slot's token in the row (-1: padding)."""

    index: torch.Tensor
    pos: torch.Tensor
    q_doc: torch.Tensor
    k_doc: torch.Tensor
    rank: int

    @property
    def cp(self) -> int:
        return self.index.shape[1]

    @property
    def local_len(self) -> int:
        return self.index.shape[2]

    def local(self):
        """This rank's queries: pos, q_doc, k_doc (B, L)."""
        return self.pos[:, self.rank], self.q_doc[:, self.rank], self.k_doc[:, self.rank]

    def keys(self, j):
        """Rank j's keys: pos, k_doc (B, L)."""
        return self.pos[:, j], self.k_doc[:, j]

    def whole(self):
        """Every rank's tokens in rank order: pos, q_doc, k_doc (B, cp * L)."""
        return self.pos.flatten(1), self.q_doc.flatten(1), self.k_doc.flatten(1)

    def take(self, t, fill=0):
        """This rank's slots of a (B, S, ...) tensor of the whole row (`fill` on padding slots)."""
        index = self.index[:, self.rank]
        shape = (*index.shape, *t.shape[2:])
        picked = t.gather(1, index.clamp(min=0).view(*index.shape, *[1] * (t.dim() - 2)).expand(shape))
        pad = (index < 0).view(*index.shape, *[1] * (t.dim() - 2))
        return picked.masked_fill(pad, fill) if bool(pad.any()) else picked

    def inverse(self, seq_len):
        """(B, S): where each token of the row sits among every rank's slots, flattened."""
        flat = self.index.flatten(1)
        inv = torch.empty((flat.shape[0], seq_len), dtype=torch.long, device=flat.device)
        slots = torch.arange(flat.shape[1], device=flat.device).expand_as(flat)
        real = flat >= 0
        inv[torch.nonzero(real)[:, 0], flat[real]] = slots[real]
        return inv


def documents(position_ids, attention_mask, batch, seq_len, device):
    """(B, S) int64 document ids as HF's masks read them (module docstring)."""
    if attention_mask is None and position_ids is not None:
        first = position_ids[:, :1] - 1
        return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    return torch.zeros((batch, seq_len), dtype=torch.long, device=device)


def _row_slots(doc_row, cp):
    """Per rank, the row's token indices it takes: chunks r and 2cp - 1 - r of every document."""
    bounds = torch.nonzero(torch.diff(doc_row, prepend=doc_row[:1] - 1)).flatten().tolist() + [len(doc_row)]
    per_rank = [[] for _ in range(cp)]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        chunks = torch.arange(start, end).tensor_split(2 * cp)
        for r in range(cp):
            per_rank[r] += [chunks[r], chunks[2 * cp - 1 - r]]
    return [torch.cat(slots) for slots in per_rank]


def balanced_layout(batch, seq_len, cp, rank, *, position_ids=None, attention_mask=None, multiple=1, device=None):
    """The head-tail layout of a (batch, seq_len) input over `cp` ranks (module docstring)."""
    device = device if device is not None else torch.device("cpu")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"context parallelism: a 2-D attention mask (batch, seq) is needed, got {tuple(attention_mask.shape)}; "
            "the masks are built from positions and documents"
        )
    doc = documents(position_ids, attention_mask, batch, seq_len, device).cpu()
    rows = [_row_slots(doc[b], cp) for b in range(batch)]
    longest = max(len(s) for row in rows for s in row)
    local = -(-max(longest, 1) // multiple) * multiple
    index = torch.full((batch, cp, local), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        for r, slots in enumerate(row):
            index[b, r, : len(slots)] = slots
    index = index.to(device)
    real = index >= 0
    safe = index.clamp(min=0)
    doc = doc.to(device).gather(1, safe.flatten(1)).view_as(index)
    pos = torch.where(real, safe, 0)
    q_doc = torch.where(real, doc, PAD_QUERY)
    k_doc = q_doc.masked_fill(~real, PAD_KEY)
    if attention_mask is not None:
        hidden = attention_mask.to(device).gather(1, safe.flatten(1)).view_as(index) == 0
        k_doc = k_doc.masked_fill(hidden & real, PAD_KEY)
    i32 = torch.int32
    return ContextLayout(index, pos.to(i32), q_doc.to(i32), k_doc.to(i32), rank)
