"""A user's test file: a home-made Column -> GELU -> Row block, proved equal to its unsharded self
at TP 1-4 and TP x DP with ZeRO by one call (README's "Testing your own parallel model")."""

import torch

import tplayers
from tplayers.plan import Layout
from tplayers.testing import check_parallel


def build():  # the unsharded model; built under the same seed on every rank
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 16))


def shard(model, mesh, layout):  # your parallelism, given the layout's ("dp", "pp", "tp") mesh
    model[0] = tplayers.ColumnParallelLinear.from_linear(model[0], group=mesh["tp"])
    model[2] = tplayers.RowParallelLinear.from_linear(model[2], group=mesh["tp"])
    return tplayers.data_parallel(model, group=mesh["dp"], zero_stage=layout.zero_stage)


def test_my_block_equals_unsharded():
    layouts = [Layout(tp=t) for t in (1, 2, 3, 4)] + [Layout(tp=2, dp=2, zero_stage=z) for z in (1, 3)]
    check_parallel(build, shard, torch.randn(4, 6, 16), layouts=layouts, steps=2)
