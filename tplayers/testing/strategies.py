"""Hypothesis strategies for parallel-numerics tests: layouts, shapes, dtypes, exact tensors.

Each draws its choices smallest first, so a failing example shrinks to the smallest layout that
still fails (a bug that shows only at TP 3 shrinks to tp=3, pp=dp=1, no ZeRO, no SP).

    layouts(max_world=8, tp=..., divides=(heads, ffn), seq_len=..., ...)  -> tplayers.plan.Layout
    shapes(ndim, multiples={1: tp}, max_side=8)                          -> tuple of ints
    dtypes(exclude=())                                                   -> torch.dtype
    integer_tensors(shape, dtype)                                        -> exact-sum tensors
"""

import torch
from hypothesis import strategies as st

from tplayers.plan import Layout
from tplayers.testing.numerics import integer_valued

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fits(size, divides):
    return all(d % size == 0 for d in divides)


@st.composite
def layouts(
    draw, *, max_world=8, tp=(1, 2, 3, 4), pp=(1,), dp=(1, 2), zero_stages=(0, 1, 2, 3), sequence_parallel=(False,),
    divides=(), seq_len=None, layers=None, grids=(), cp=(1,),
):  # fmt: skip
    """A `Layout` whose tp * pp * dp <= max_world, tp dividing every number in `divides` (widths a
    test wants even; tplayers itself splits heads, ffn and vocabulary unevenly too) and, with
    sequence parallelism, at most `seq_len` (a token per rank; any length splits, unevenly where tp
    does not divide it); pp at most `layers`. ZeRO stages only with dp > 1; with pp > 1 only stages 2-3 (tplayers
    refuses ZeRO 0-1 on pipeline stages across replicas). `grids`: (tp_r, tp_c) 2-D
    tensor-parallel grids drawn as well (after the 1-D sizes, smallest first; `divides` is not
    applied to them: a grid splits heads over tp_r and the hidden size over tp_c; with sequence
    parallelism `seq_len` is split over tp_r, the axis a grid splits the sequence over). `cp`:
    context-parallel sizes to draw (with 1-D tp only; pass the layout's mesh["cp"] as
    `parallelize(context_group=)`)."""
    tp_sizes = sorted(t for t in tp if _fits(t, divides) and t <= max_world)
    tp_sizes += sorted((tuple(g) for g in grids if g[0] * g[1] <= max_world), key=lambda g: (g[0] * g[1], g))
    if not tp_sizes:
        raise ValueError(f"layouts: no TP size of {tuple(tp)} divides all of {tuple(divides)}")
    t = draw(st.sampled_from(tp_sizes))
    size, split = (t[0] * t[1], t[0]) if isinstance(t, tuple) else (t, t)  # ranks; what the sequence splits over
    p = draw(st.sampled_from(sorted(x for x in pp if x * size <= max_world and (layers is None or x <= layers)) or [1]))
    c = draw(st.sampled_from(sorted(x for x in cp if x * p * size <= max_world and (x == 1 or not isinstance(t, tuple)))
                             or [1]))  # fmt: skip
    d = draw(st.sampled_from(sorted(x for x in dp if x * p * c * size <= max_world) or [1]))
    stages = [z for z in sorted(zero_stages) if d > 1 and (p == 1 or z >= 2)] or [0]
    zero = draw(st.sampled_from(stages)) if d > 1 else 0
    sp_allowed = [s for s in sorted(sequence_parallel) if not s or split > 1 and (seq_len is None or seq_len >= split)]
    sp = draw(st.sampled_from(sp_allowed or [False]))
    return Layout(tp=t, pp=p, dp=d, zero_stage=zero, sequence_parallel=sp, cp=c)


@st.composite
def shapes(draw, ndim, *, multiples=None, min_side=1, max_side=8):
    """A shape of `ndim` sides in [min_side, max_side], side i a multiple of `multiples[i]`
    (e.g. {0: dp} for a (batch, seq, hidden) input split over data-parallel replicas)."""
    multiples = multiples or {}
    sides = []
    for i in range(ndim):
        m = multiples.get(i, 1)
        low, high = -(-min_side // m), max(max_side // m, -(-min_side // m))
        sides.append(m * draw(st.integers(low, high)))
    return tuple(sides)


def dtypes(exclude=()):
    """fp32, fp16, bf16 (minus `exclude`; bf16 where Triton's interpreter multiplies it wrongly)."""
    return st.sampled_from([d for d in FLOAT_DTYPES if d not in exclude])


@st.composite
def integer_tensors(draw, shape, dtype=torch.float32, *, low=-3, high=4):
    """Small integers as `dtype`: sums of their products are exact in any order (in fp32 below
    2**24), so even reduced paths compare bit for bit. Drawn from a seed, shrinking to seed 0."""
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return integer_valued(shape, dtype, low=low, high=high, generator=generator)
