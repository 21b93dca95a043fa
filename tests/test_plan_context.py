"""The planner's context parallelism (`tplayers.plan.context`): activations per GPU shrink by cp,
the ring's bytes are K / V blocks never expanded, model states as dp x cp replicas, the search
tries cp where asked; the layouts' sizes and refusals."""

import dataclasses

import pytest

from tplayers.plan import ClusterSpec, Layout, ModelSpec, estimate, search
from tplayers.plan.context import ring_bytes_per_layer

MODEL = dataclasses.replace(ModelSpec.preset("llama3-8b"), seq_len=32768)
CLUSTER = dataclasses.replace(ClusterSpec.preset("h100"), num_gpus=8)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_activations_shrink_by_cp_and_states_are_replicas(cp):
    # tplayers' context attention keeps no score matrix: against the whole model that keeps none either
    whole = estimate(MODEL, dataclasses.replace(CLUSTER, num_gpus=1), Layout(recompute="selective"), "mixed-adam")
    split = estimate(MODEL, dataclasses.replace(CLUSTER, num_gpus=cp), Layout(cp=cp), "mixed-adam")
    buffers = 2 * ring_bytes_per_layer(MODEL, 1, cp, 2)[0] / (cp - 1) * MODEL.layers
    assert split.memory.activations <= 1.1 * whole.memory.activations / cp + buffers
    assert split.memory.params == whole.memory.params  # replicas over cp, like data parallelism
    zero = estimate(MODEL, dataclasses.replace(CLUSTER, num_gpus=cp), Layout(cp=cp, zero_stage=1), "mixed-adam")
    assert zero.memory.optimizer == pytest.approx(whole.memory.optimizer / cp, rel=0.01)  # ZeRO over dp x cp
    assert split.model_flops == pytest.approx(whole.model_flops)  # the same job
    assert split.tokens_per_step == whole.tokens_per_step


def test_more_ranks_less_memory_more_ring_bytes():
    ests = [estimate(MODEL, CLUSTER, Layout(dp=8 // cp, cp=cp), "mixed-adam") for cp in (2, 4, 8)]
    acts = [e.memory.activations for e in ests]
    rings = [e.comm_bytes_by_group["cp"] for e in ests]
    assert acts == sorted(acts, reverse=True) and rings == sorted(rings)


def test_ring_bytes_are_kv_blocks_never_expanded():
    cp, d = 4, 2
    est = estimate(MODEL, CLUSTER, Layout(tp=2, cp=cp), "mixed-adam")
    block = 2 * (MODEL.seq_len // cp) * MODEL.kv_heads * MODEL.head_dim  # elements, K and V
    per_layer = (cp - 1) * block * d + (cp - 1) * block * d + cp * block * 4  # fwd; bwd K / V and fp32 grads
    assert est.comm_bytes_by_group["cp"] == MODEL.layers * per_layer
    assert "cp" in est.time_breakdown and est.time_breakdown["cp"] >= 0
    assert est.step_time_s == pytest.approx(sum(est.time_breakdown.values()))


def test_search_tries_context_parallelism_where_asked():
    plain = search(MODEL, CLUSTER, 8, "mixed-adam", micro_batches=(1,), schedules=("1f1b",))
    assert all(layout.cp == 1 for layout, _ in plain)
    both = search(MODEL, CLUSTER, 8, "mixed-adam", micro_batches=(1,), schedules=("1f1b",), cp_sizes=(1, 2, 4))
    assert any(layout.cp > 1 for layout, _ in both)
    assert all(layout.num_gpus == 8 for layout, _ in both)


def test_layout_sizes_and_refusals():
    layout = Layout(tp=2, pp=2, dp=2, cp=2)
    assert layout.num_gpus == 16 and "cp=2" in layout.describe()
    with pytest.raises(ValueError, match="cp"):
        Layout(tp=(2, 2), cp=2)
    with pytest.raises(ValueError, match="cp"):
        Layout(cp=0)
