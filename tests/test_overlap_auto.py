"""overlap="auto": the cost model, the costs file, the choice every rank agrees on, results equal
to both forced paths, and a clear error on every rank when ranks would take different paths."""

import dataclasses
import json

import pytest
import torch
from torch import nn

import tplayers
from tplayers.functional import OverlapDisagreement, auto_overlap, comm, cost_model, overlap_choices
from tplayers.functional.cost_model import GLOO_CPU, NCCL_A100, NCCL_H100, predict
from tplayers.testing import integer_valued

# Constants under which the ring always wins (free transfers that hide completely) or never
# does (every ring step costs a second): the same shapes then take both paths.
RING_WINS = dataclasses.replace(
    GLOO_CPU, p2p_latency_s=0.0, p2p_bytes_per_s=1e30, hidden=dict.fromkeys(cost_model.OPS, 1.0), source="test: ring"
)
PLAIN_WINS = dataclasses.replace(GLOO_CPU, p2p_latency_s=1.0, source="test: plain")


# ---- the cost model ------------------------------------------------------------------------


@pytest.mark.parametrize("costs", [GLOO_CPU, NCCL_A100, NCCL_H100], ids=["gloo", "a100", "h100"])
@pytest.mark.parametrize("op", cost_model.OPS)
def test_decode_takes_the_plain_path(costs, op):
    """One token per sequence (M = batch): n - 1 ring-step latencies cost more than one collective."""
    backend = "gloo" if costs is GLOO_CPU else "nccl"
    ring, plain = predict(op, 8, 8, 4096, 4096 // 8, "bfloat16", costs, backend=backend)
    assert not cost_model.ring_pays(ring, plain), (ring, plain)


@pytest.mark.parametrize("op", cost_model.OPS)
def test_large_gemms_on_nvlink_take_the_ring(op):
    """Llama-70B-sized GEMMs at TP 8 on H100: the transfers hide behind the GEMM chunks."""
    ring, plain = predict(op, 8, 16384, 8192, 28672 // 8, "bfloat16", NCCL_H100, backend="nccl", side=1)
    assert cost_model.ring_pays(ring, plain), (ring, plain)


def test_gloo_ring_pays_where_its_collectives_are_slow():
    """On gloo the plain reduce-scatter moves bytes slower than point-to-point transfers do
    (calibrated): at the comm-heavy shape the ring wins for matmul_reduce_scatter."""
    ring, plain = predict("matmul_reduce_scatter", 2, 4096, 1024, 2048, "float32", GLOO_CPU, backend="gloo")
    assert cost_model.ring_pays(ring, plain), (ring, plain)


def test_costs_file_round_trip_and_errors(tmp_path, monkeypatch):
    path = tmp_path / "costs.json"
    assert cost_model.read_costs("gloo", "cpu", path) is None  # no file: the defaults
    cost_model.write_costs(RING_WINS, "gloo", "cpu", path)
    cost_model.write_costs(NCCL_H100, "nccl", "NVIDIA H100", path)  # a second entry keeps the first
    assert cost_model.read_costs("gloo", "cpu", path) == RING_WINS
    assert cost_model.read_costs("nccl", "NVIDIA H100", path) == NCCL_H100
    assert cost_model.read_costs("nccl", "NVIDIA A100", path) is None
    monkeypatch.setenv(cost_model.COSTS_ENV, str(path))
    assert cost_model.read_costs("gloo", "cpu") == RING_WINS  # the env names the file
    path.write_text(json.dumps({"gloo/cpu": {"p2p_latency_s": 1.0}}))
    with pytest.raises(ValueError, match="entry 'gloo/cpu' is malformed"):
        cost_model.read_costs("gloo", "cpu", path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        cost_model.read_costs("gloo", "cpu", path)


@pytest.mark.parametrize("bad", ["on", 1, None, "Auto"])
def test_overlap_mode_is_checked(bad):
    with pytest.raises(ValueError, match="overlap must be 'auto', True or False"):
        auto_overlap.check_overlap(bad, "ColumnParallelLinear")


# ---- on local ranks ------------------------------------------------------------------------


def _block(rank, tp, group, overlap, sp, seq_per_rank=3):
    """Column -> ReLU -> Row on integer values (exact in any summation order): output, input
    gradient and every parameter gradient, and the choices auto made."""
    torch.manual_seed(0)
    hidden, ffn = 8, 4 * tp
    fc1, fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
    with torch.no_grad():
        for p in (*fc1.parameters(), *fc2.parameters()):
            p.copy_(integer_valued(p.shape))
    x, dy = integer_valued((2, seq_per_rank * tp, hidden)), integer_valued((2, seq_per_rank * tp, hidden))
    if sp:
        x, dy = x.chunk(tp, 1)[rank], dy.chunk(tp, 1)[rank]
    col = tplayers.ColumnParallelLinear.from_linear(fc1, group=group, sequence_parallel=sp, overlap=overlap)
    row = tplayers.RowParallelLinear.from_linear(fc2, group=group, sequence_parallel=sp, overlap=overlap)
    x = x.clone().requires_grad_()
    with overlap_choices() as choices:
        y = row(torch.relu(col(x)))
        y.backward(dy.contiguous())
    grads = [x.grad] + [p.grad for p in (*col.parameters(), *row.parameters())]
    return y.detach(), grads, [(c.op, c.shape, c.overlap) for c in choices]


def _with_costs(costs, fn, *args):
    """fn(*args) with the constants every rank's auto reads replaced by `costs` (None: the defaults)."""
    auto_overlap.forget_choices()
    if costs is not None:
        auto_overlap._costs[("gloo", "cpu")] = costs
    try:
        return fn(*args)
    finally:
        auto_overlap.forget_choices()


def auto_equals_forced(rank, tp, group, costs, sp):
    auto = _with_costs(costs, _block, rank, tp, group, "auto", sp)
    on, off = (_with_costs(None, _block, rank, tp, group, forced, sp) for forced in (True, False))
    for forced in (on, off):  # integer values: every path gives the same bits
        assert torch.equal(auto[0], forced[0])
        for a, b in zip(auto[1], forced[1], strict=True):
            assert torch.equal(a, b)
    assert [c[2] for c in on[2]] == [True] * len(on[2]) and not any(c[2] for c in off[2])
    return auto[2]


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("costs", [RING_WINS, PLAIN_WINS, None], ids=["ring-wins", "plain-wins", "default"])
def test_auto_same_choice_on_every_rank_and_equal_to_forced(pool, tp, sp, costs):
    choices = pool.run(auto_equals_forced, tp, costs, sp)
    assert all(c == choices[0] for c in choices[1:]), choices  # every rank took the same paths
    ops = {op for op, _, _ in choices[0]}
    # Forward and backward both go through the engine: SP gathers / scatters in both
    # directions, plain TP all-reduces the row output and the column input gradient.
    assert ops == ({"all_gather_matmul", "matmul_reduce_scatter"} if sp else {"matmul_all_reduce"})
    if costs is not None:
        assert {took for _, _, took in choices[0]} == {costs is RING_WINS}


def agreement_messages(rank, tp, group):
    """The number of agreement all-gathers per call: one for a new shape, none after (the model's
    choice alone: measuring off)."""
    sent = []
    original = comm.all_gather_into

    def counting(out, t, group, **kw):
        sent.append(kw.get("record", True))
        return original(out, t, group, **kw)

    auto_overlap.forget_choices()
    auto_overlap.set_overlap_measuring(False)
    try:
        comm.all_gather_into = counting
        counts = []
        for seq in (3, 3, 5, 3):
            sent.clear()
            _block(rank, tp, group, "auto", False, seq_per_rank=seq)
            counts.append(sent.count(False))
        return counts
    finally:
        comm.all_gather_into = original
        auto_overlap.set_overlap_measuring(None)
        auto_overlap.forget_choices()


@pytest.mark.multirank
def test_choice_agreed_once_per_new_shape(pool):
    # forward (row output) and backward (column input gradient with its weight gradient): two keys
    assert pool.run(agreement_messages, 2) == [[2, 0, 2, 0]] * 2


def disagreeing_flags(rank, tp, group):
    auto_overlap.forget_choices()
    try:
        _block(rank, tp, group, True if rank == 0 else False, True)
    finally:
        auto_overlap.forget_choices()


def disagreeing_costs(rank, tp, group, measuring=False):
    """Rank 0 read a costs file under which the ring wins, the others one under which it loses."""
    auto_overlap.set_overlap_measuring(measuring)
    try:
        return _with_costs(RING_WINS if rank == 0 else PLAIN_WINS, _block, rank, tp, group, "auto", False)[2]
    finally:
        auto_overlap.set_overlap_measuring(None)


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("fn", "said"),
    [
        (disagreeing_flags, r"rank 0: overlap=True -> ring .*; rank 1: overlap=False -> plain"),
        (disagreeing_costs, r"rank 0: overlap='auto' -> ring .*; rank 1: overlap='auto' -> plain"),
    ],
    ids=["flags", "costs-files"],
)
def test_ranks_that_would_take_different_paths_fail_on_every_rank(pool, fn, said):
    """Negative control: the ring on one rank and the plain collective on another would hang;
    the first call of the shape raises instead, on every rank, naming what each rank asked for
    (with measuring off: with it on, costs files that disagree are settled by measuring)."""
    replies = pool.run(fn, 3, return_exceptions=True)
    for reply in replies:
        assert reply.type_name == "OverlapDisagreement", reply
        assert "disagree on the overlap path" in reply.message
    import re

    assert re.search(said, replies[0].message), replies[0].message
    assert OverlapDisagreement.__name__ == replies[0].type_name


@pytest.mark.multirank
def test_parallelize_passes_overlap_to_every_layer(pool):
    assert pool.run(_parallelize_overlap, 2) == [True, True]


def _parallelize_overlap(rank, tp, group):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = tplayers.parallelize(LlamaForCausalLM(cfg), group=group, overlap=False)
    layers = [m for m in model.modules() if isinstance(m, (tplayers.ColumnParallelLinear, tplayers.RowParallelLinear))]
    with pytest.raises(ValueError, match="overlap must be"):
        tplayers.parallelize(LlamaForCausalLM(cfg), group=group, overlap="yes")
    return len(layers) >= 4 and all(layer.overlap is False for layer in layers)
