"""ParallelRMSNorm (an RMSNorm over a dimension split across the group) against the unsharded
norm: forward, input gradient and weight gradient, at TP 1-4; a negative control without the
sum over the group."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tplayers.nn import ParallelRMSNorm
from tplayers.testing import RemoteError, assert_shard_close, examples, shard_of

pytestmark = pytest.mark.multirank


def reference_rms_norm(x, weight, eps):
    h = x.float()
    return (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def run_norm(rank, tp, group, width_per_rank, tokens, dtype, seed, local_only):
    g = torch.Generator().manual_seed(seed)
    width = width_per_rank * tp
    weight = (1 + 0.5 * torch.randn(width, generator=g)).to(dtype)
    x, dy = (torch.randn(2, tokens, width, generator=g).to(dtype) for _ in range(2))
    weight_ref, x_ref = weight.clone().requires_grad_(True), x.clone().requires_grad_(True)
    reference_rms_norm(x_ref, weight_ref, 1e-6).backward(dy)

    norm = ParallelRMSNorm.from_weight(weight, 1e-6, group=group)
    if local_only:  # negative control: each rank normalises its slice by its own mean of squares
        norm.hidden_size, norm.group = width_per_rank, None
        import tplayers.nn.norm as module

        saved, module.sum_over_tp_region = module.sum_over_tp_region, lambda t, group: t
    try:
        x_local = x.chunk(tp, -1)[rank].clone().requires_grad_(True)
        y = norm(x_local)
        y.backward(dy.chunk(tp, -1)[rank])
    finally:
        if local_only:
            module.sum_over_tp_region = saved
    kw = dict(rank=rank, num_shards=tp)
    assert_shard_close(y, reference_rms_norm(x, weight, 1e-6), dim=-1, **kw, msg=lambda m: f"output: {m}")
    assert_shard_close(x_local.grad, x_ref.grad, dim=-1, **kw, msg=lambda m: f"input grad: {m}")
    assert_shard_close(norm.weight.grad, weight_ref.grad, dim=0, **kw, msg=lambda m: f"weight grad: {m}")


@settings(max_examples=examples(12), deadline=None)
@given(
    tp=st.integers(1, 4),
    width_per_rank=st.integers(1, 9),
    tokens=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_parallel_rms_norm_matches_unsharded(pool, tp, width_per_rank, tokens, dtype, seed):
    pool.run(run_norm, tp, width_per_rank, tokens, dtype, seed, False)


def test_negative_control_without_the_group_sum(pool):
    with pytest.raises(Exception, match="Tensor-likes are not close"):
        pool.run(run_norm, 2, 4, 3, torch.float32, 0, True)


def wrong_width(rank, tp, group):
    ParallelRMSNorm(8, group=group)(torch.randn(2, 8))  # the whole width, not this rank's 4


def test_rejects_an_input_that_is_not_its_slice(pool):
    for reply in pool.run(wrong_width, 2, return_exceptions=True):
        assert isinstance(reply, RemoteError) and "input last dim 8 is not this rank's 4 of 8 features" in reply.message


def run_layer_norm(rank, tp, group, width, tokens, dtype, seed, local_only):
    """ParallelLayerNorm (weight and bias split like a row layer's input, torch.chunk's uneven
    sizes) against nn.LayerNorm: output, input, weight and bias gradients."""
    from tplayers.nn.norm import ParallelLayerNorm

    g = torch.Generator().manual_seed(seed)
    reference = torch.nn.LayerNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(1 + 0.5 * torch.randn(width, generator=g))
        reference.bias.copy_(torch.randn(width, generator=g))
    x, dy = (torch.randn(2, tokens, width, generator=g).add(3).to(dtype) for _ in range(2))  # a mean far from 0
    x_ref = x.clone().requires_grad_(True)
    reference(x_ref).backward(dy)
    norm = ParallelLayerNorm.from_norm(reference, group=group)
    if local_only:  # negative control: each rank's statistics over its own slice
        import tplayers.nn.norm as module

        saved, module.sum_over_tp_region = module.sum_over_tp_region, lambda t, group: t * tp
    try:
        x_local = shard_of(x, -1, rank, tp).clone().requires_grad_(True)
        y = norm(x_local)
        y.backward(shard_of(dy, -1, rank, tp))
    finally:
        if local_only:
            module.sum_over_tp_region = saved
    kw = dict(rank=rank, num_shards=tp)
    assert_shard_close(y, reference(x), dim=-1, **kw, msg=lambda m: f"output: {m}")
    assert_shard_close(x_local.grad, x_ref.grad, dim=-1, **kw, msg=lambda m: f"input grad: {m}")
    assert_shard_close(norm.weight.grad, reference.weight.grad, dim=0, **kw, msg=lambda m: f"weight grad: {m}")
    assert_shard_close(norm.bias.grad, reference.bias.grad, dim=0, **kw, msg=lambda m: f"bias grad: {m}")


@settings(max_examples=examples(8), deadline=None)
@given(
    tp=st.integers(1, 4),
    width=st.integers(4, 19),
    tokens=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_parallel_layer_norm_matches_unsharded(pool, tp, width, tokens, dtype, seed):
    pool.run(run_layer_norm, tp, width, tokens, dtype, seed, False)


def test_negative_control_layer_norm_without_the_group_sum(pool):
    with pytest.raises(Exception, match="output: Tensor-likes are not close"):
        pool.run(run_layer_norm, 3, 10, 2, torch.float32, 0, True)
