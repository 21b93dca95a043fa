"""MoE experts in HF checkpoints: stored one expert at a time (`mlp.experts.{e}.gate_proj.weight`
(F, H), `up_proj` (F, H), `down_proj` (H, F)), while transformers 5 holds them stacked as it loads
them (`mlp.experts.gate_up_proj` (E, 2F, H) = each expert's [gate; up], `down_proj` (E, H, F)).

`stacked_sources` finds the per-expert tensors of a checkpoint and presents each stacked tensor
as one source `load_pretrained` reads slices of: a rank holding experts [a, b) and rows [r, s) of
each (expert parallelism, expert tensor parallelism) reads exactly those rows of those experts'
files, nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class Stacked:
    """A stacked experts tensor made of per-expert tensors: `parts[e]` the (name, file) of expert
    e's halves in order ([gate, up] for gate_up_proj, [down] for down_proj)."""

    parts: tuple

    def names(self) -> list[str]:
        return [name for halves in self.parts for name, _ in halves]

    def shape(self, reader) -> tuple[int, ...]:
        rows, cols = reader.shape(self.parts[0][0][1], self.parts[0][0][0])
        return (len(self.parts), rows * len(self.parts[0]), cols)

    def read(self, reader, offsets, sizes) -> torch.Tensor:
        """Experts [e, e + n) of the stacked tensor, its rows [r, r + m) and columns [c, c + k)."""
        if not sizes:
            offsets, sizes = (0, 0, 0), self.shape(reader)
        (e, r, c), (n, m, k) = offsets, sizes
        half = reader.shape(self.parts[0][0][1], self.parts[0][0][0])[0]
        experts = []
        for halves in self.parts[e : e + n]:
            rows = []
            for i, (name, file) in enumerate(halves):  # the part of [r, r + m) in half i
                lo, hi = max(r, i * half), min(r + m, (i + 1) * half)
                if lo < hi:
                    rows.append(reader.read(file, name, (lo - i * half, c), (hi - lo, k)))
            experts.append(torch.cat(rows))
        return torch.stack(experts)


def stacked_sources(files: dict[str, Path]) -> dict[str, Stacked]:
    """{stacked name: Stacked} for every experts module whose experts the checkpoint stores one by
    one (all of 0 .. E - 1, each with its gate, up and down projections)."""
    found: dict[str, dict[int, dict[str, tuple]]] = {}
    for name, file in files.items():
        match = PER_EXPERT.match(name)
        if match:
            experts = found.setdefault(match["prefix"], {})
            experts.setdefault(int(match["expert"]), {})[match["proj"]] = (name, file)
    out = {}
    for prefix, experts in found.items():
        complete = sorted(experts) == list(range(len(experts))) and all(len(p) == 3 for p in experts.values())
        if not complete:
            continue
        ordered = [experts[e] for e in range(len(experts))]
        out[f"{prefix}.gate_up_proj"] = Stacked(tuple((p["gate_proj"], p["up_proj"]) for p in ordered))
        out[f"{prefix}.down_proj"] = Stacked(tuple((p["down_proj"],) for p in ordered))
    return out
