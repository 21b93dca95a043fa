"""Module behaviour beyond the numerics: placements, copies, loading, construction options."""

import copy
import os

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import tplayers
from tplayers.testing import assert_close, assert_shard_close

pytestmark = pytest.mark.multirank


def placements_survive_copy_and_load(rank, tp, group):
    col = tplayers.ColumnParallelLinear(6, 4 * tp, group=group)
    row = tplayers.RowParallelLinear(4 * tp, 6, group=group)
    expected = {"weight": Shard(0), "bias": Shard(0)}, {"weight": Shard(1), "bias": Replicate()}
    for layer, placements in zip((col, row, copy.deepcopy(col), copy.deepcopy(row)), expected * 2, strict=True):
        for name, placement in placements.items():
            found = tplayers.get_placement(getattr(layer, name))
            assert found.placement == placement and found.group is group, (name, found)
    # load_state_dict(assign=True) replaces the Parameter objects; the placement must follow
    fresh = {k: v.clone() + 1 for k, v in col.state_dict().items()}
    col.load_state_dict(fresh, assign=True)
    assert col.weight is not None and tplayers.get_placement(col.weight).placement == Shard(0)
    assert_close(col.weight.detach(), fresh["weight"], exact=True)
    # the copy is independent of the original
    twin = copy.deepcopy(row)
    with torch.no_grad():
        twin.weight.add_(1)
    assert not torch.equal(twin.weight, row.weight)


def from_linear_casts_and_keeps_source(rank, tp, group):
    torch.manual_seed(0)
    linear = nn.Linear(5, 2 * tp)
    before = {k: v.clone() for k, v in linear.state_dict().items()}
    col = tplayers.ColumnParallelLinear.from_linear(linear, group=group, dtype=torch.float16, device="cpu")
    assert col.weight.dtype == torch.float16
    assert_shard_close(col.weight.detach(), linear.weight.detach().half(), dim=0, rank=rank, num_shards=tp, exact=True)
    for k, v in linear.state_dict().items():  # nothing the user gave us is changed
        assert torch.equal(v, before[k]) and v.dtype == torch.float32
    # built under a seed, a layer holds the shards of the nn.Linear built under the same seed
    torch.manual_seed(1)
    row = tplayers.RowParallelLinear(4 * tp, 3, group=group)
    torch.manual_seed(1)
    full = nn.Linear(4 * tp, 3)
    assert_shard_close(row.weight.detach(), full.weight.detach(), dim=1, rank=rank, num_shards=tp, exact=True)
    assert_close(row.bias.detach(), full.bias.detach(), exact=True)


def row_sp_without_input_grad(rank, tp, group):
    torch.manual_seed(0)
    linear = nn.Linear(4 * tp, 5)
    row = tplayers.RowParallelLinear.from_linear(linear, group=group, sequence_parallel=True)
    x = torch.randn(2, 3 * tp, 4 * tp)  # no requires_grad: only weight / bias grads
    dy = torch.randn(2, 3 * tp, 5)
    linear(x).backward(dy)
    row(x.chunk(tp, -1)[rank].contiguous()).backward(dy.chunk(tp, 1)[rank])
    assert_shard_close(row.weight.grad, linear.weight.grad, dim=1, rank=rank, num_shards=tp)
    assert_close(row.bias.grad, linear.bias.grad)


def sp_lm_head_gathers_full_output(rank, tp, group):
    torch.manual_seed(0)
    linear = nn.Linear(6, 4 * tp)
    head = tplayers.ColumnParallelLinear.from_linear(linear, group=group, sequence_parallel=True, gather_output=True)
    x = torch.randn(2, 3 * tp, 6, requires_grad=True)
    x_local = x.detach().chunk(tp, 1)[rank].clone().requires_grad_(True)
    y, y_ref = head(x_local), linear(x)
    assert_close(y, y_ref)  # every rank: the full sequence, the full output features
    dy = torch.randn_like(y_ref)
    y.backward(dy)
    y_ref.backward(dy)
    assert_shard_close(x_local.grad, x.grad, dim=1, rank=rank, num_shards=tp)
    assert_shard_close(head.weight.grad, linear.weight.grad, dim=0, rank=rank, num_shards=tp)


@pytest.mark.parametrize("tp", [1, 3])
@pytest.mark.parametrize(
    "check",
    [
        placements_survive_copy_and_load,
        from_linear_casts_and_keeps_source,
        row_sp_without_input_grad,
        sp_lm_head_gathers_full_output,
    ],
)
def test_module_behaviour(pool, tp, check):
    pool.run(check, tp)


def unpicklable_result(rank, tp, group):
    return lambda: None


def test_unpicklable_result_is_an_error_not_a_hang(pool):
    with pytest.raises(tplayers.RankError, match="(?s)raised .*(Pickl|pickle)"):
        pool.run(unpicklable_result, 2)


def launched_unpicklable(rank, world_size):
    return lambda: None


def test_launch_unpicklable_result_is_an_error():
    with pytest.raises(tplayers.RankError, match="(?s)rank [01] of 2 failed.*(Pickl|pickle)"):
        tplayers.launch(launched_unpicklable, 2, timeout=60)


def launched_environment(rank, world_size):
    import multiprocessing

    return multiprocessing.get_start_method(), os.environ.get("TPLAYERS_LAUNCH_PROBE")


def test_launch_forks_its_ranks_and_spawns_them_where_the_environment_changed(monkeypatch):
    """Ranks fork from a server that imported tplayers once; a variable set since it started (one that
    imports may read, as TRITON_INTERPRET is) makes launch spawn them, so they see it."""
    monkeypatch.delenv("TPLAYERS_LAUNCH_PROBE", raising=False)
    assert tplayers.launch(launched_environment, 2, timeout=60) == [("forkserver", None)] * 2
    monkeypatch.setenv("TPLAYERS_LAUNCH_PROBE", "set")
    assert tplayers.launch(launched_environment, 2, timeout=60) == [("spawn", "set")] * 2
    monkeypatch.delenv("TPLAYERS_LAUNCH_PROBE")
    assert tplayers.launch(launched_environment, 2, timeout=60) == [("forkserver", None)] * 2
