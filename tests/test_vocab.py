"""Vocab-parallel cross-entropy and embedding against their unsharded torch counterparts
(F.cross_entropy on the full logits, nn.Embedding): forward and every gradient, on 1-4 local
ranks, both backends; the fused statistics kernel against its reference in the interpreter;
bad input raising on every rank before any collective."""

import re
import time
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tplayers
from tplayers.functional.cross_entropy import vocab_parallel_cross_entropy
from tplayers.nn.embedding import VocabParallelEmbedding
from tplayers.testing import (
    RemoteError,
    assert_close,
    assert_shard_close,
    examples,
    kernel_device,
    kernel_generator,
    shard_of,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# --- cross-entropy ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LossCase:
    rows: int
    vocab_per_rank: int
    dtype: torch.dtype = torch.float32
    ignore_index: int = -100
    ignored: float = 0.25  # fraction of rows whose target is ignore_index
    label_smoothing: float = 0.0
    reduction: str = "mean"
    leading_dims: int = 1  # (R, V) or (B, R/B, V) logits
    backend: str = "torch"
    wrong_shard: bool = False  # negative control: each rank gets its neighbour's columns
    seed: int = 0
    vocab: int | None = None  # a vocabulary that does not divide (vocab_per_rank is then its ceil-share)


def run_loss(rank, tp, group, case: LossCase):
    """One rank's check against F.cross_entropy on the full logits; returns the loss (must agree on every rank)."""
    tplayers.set_backend(case.backend)
    if case.backend == "triton":  # the kernel itself runs, in the interpreter, not the reference
        from tplayers.kernels import vocab_ce

        assert vocab_ce.INTERPRET
    gen = torch.Generator().manual_seed(case.seed)
    vocab = case.vocab if case.vocab is not None else case.vocab_per_rank * tp
    full = (3 * torch.randn(case.rows, vocab, generator=gen)).to(case.dtype).requires_grad_(True)
    target = torch.randint(0, vocab, (case.rows,), generator=gen)
    target[torch.rand(case.rows, generator=gen) < case.ignored] = case.ignore_index
    kwargs = dict(ignore_index=case.ignore_index, label_smoothing=case.label_smoothing, reduction=case.reduction)
    expected = nn.functional.cross_entropy(full, target, **kwargs)
    dy = torch.randn(expected.shape, generator=gen).to(case.dtype)
    expected.backward(dy)

    shift = -(-vocab // tp) if case.wrong_shard else 0
    local = shard_of(full.detach().roll(-shift, 1), 1, rank, tp).clone().requires_grad_(True)
    lead = (2, case.rows // 2) if case.leading_dims == 2 else (case.rows,)
    loss = vocab_parallel_cross_entropy(
        local.view(*lead, local.shape[-1]), target.view(lead), group=group, vocab_size=case.vocab, **kwargs
    )  # fmt: skip
    loss.backward(dy.view(lead) if case.reduction == "none" else dy)
    loss = loss.reshape(expected.shape)
    assert loss.dtype == expected.dtype
    if expected.isnan().all():  # mean over no rows
        assert loss.isnan().all()
    else:
        assert_close(loss, expected.detach(), msg=lambda m: f"loss: {m}")
    assert_shard_close(local.grad, full.grad, dim=1, rank=rank, num_shards=tp, msg=lambda m: f"logits grad: {m}")
    return loss.detach()


def check_loss(pool, tp, case):
    losses = pool.run(run_loss, tp, case)
    for loss in losses[1:]:  # every rank combines the same statistics in the same order
        torch.testing.assert_close(loss, losses[0], rtol=0, atol=0, equal_nan=True)


def loss_cases(draw, max_rows, max_vocab_per_rank, backend):
    tp = draw(st.integers(1, 4))
    leading_dims = draw(st.sampled_from([1, 2]))
    rows = draw(st.integers(1, max_rows // 2)) * 2 if leading_dims == 2 else draw(st.integers(1, max_rows))
    per_rank = draw(st.integers(1, max_vocab_per_rank))
    case = LossCase(
        rows=rows,
        vocab_per_rank=per_rank,
        vocab=draw(st.one_of(st.none(), st.integers(1, per_rank * tp))),  # any vocabulary: uneven, even under tp
        dtype=draw(st.sampled_from(DTYPES)),
        ignore_index=draw(st.sampled_from([-100, 0])),  # an ignore_index may also be a real class
        ignored=draw(st.sampled_from([0.0, 0.3])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1])),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        leading_dims=leading_dims,
        backend=backend,
        seed=draw(st.integers(0, 2**16)),
    )
    return tp, case


@pytest.mark.multirank
@settings(max_examples=examples(40))
@given(st.data())
def test_loss_matches_cross_entropy_torch_backend(pool, data):
    tp, case = data.draw(st.composite(lambda draw: loss_cases(draw, 24, 40, "torch"))())
    check_loss(pool, tp, case)


@pytest.mark.multirank
@pytest.mark.interpreter
@settings(max_examples=examples(10))
@given(st.data())
def test_loss_matches_cross_entropy_triton_backend(pool, data):
    tp, case = data.draw(st.composite(lambda draw: loss_cases(draw, 12, 80, "triton"))())
    check_loss(pool, tp, case)


@pytest.mark.multirank
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_every_row_ignored(pool, reduction):
    """mean over no rows is nan, like F.cross_entropy; the gradient is zero."""
    check_loss(pool, 2, LossCase(rows=4, vocab_per_rank=5, ignored=1.0, reduction=reduction, label_smoothing=0.1))


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_loss_negative_control_wrong_shard_fails(pool, backend):
    case = LossCase(rows=6, vocab_per_rank=7, ignored=0.0, backend=backend, wrong_shard=True)
    with pytest.raises(tplayers.RankError, match="are not close"):
        check_loss(pool, 2, case)
    check_loss(pool, 2, replace(case, wrong_shard=False))  # and the pool still works


def count_loss_bytes(rank, tp, group, rows, vocab_per_rank):
    local = torch.randn(rows, vocab_per_rank, requires_grad=True)
    with tplayers.count_bytes() as counted:
        vocab_parallel_cross_entropy(local, torch.zeros(rows, dtype=torch.long), group=group).backward()
    return dict(counted)


@pytest.mark.multirank
def test_loss_communicates_only_row_statistics(pool):
    """One all-gather of 4 fp32 statistics and the target id per row (and one row of the split
    each rank was told), whatever the vocab size; none in backward."""
    for counted in pool.run(count_loss_bytes, 4, 10, 1000):
        assert counted == {"all_gather": 3 * (10 + 1) * 5 * 4}


# --- the fused statistics kernel ------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.kernel
@settings(max_examples=examples(40))
@given(
    rows=st.integers(1, 40), vocab=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(["contiguous", "sliced", "transposed"]), vocab_start=st.sampled_from([0, 7, 300]),
    target_dtype=st.sampled_from([torch.int64, torch.int32]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_stats_kernel_matches_reference(rows, vocab, dtype, layout, vocab_start, target_dtype, seed):
    from tplayers.kernels.vocab_ce import INTERPRET, vocab_ce_stats, vocab_ce_stats_ref

    assert INTERPRET == (kernel_device() == "cpu"), "conftest sets TRITON_INTERPRET=1 on CPU before triton is imported"
    gen = kernel_generator(seed)
    if layout == "sliced":  # strided rows, a window of a wider buffer
        logits = (4 * torch.randn(rows + 3, vocab + 9, generator=gen)).to(dtype)[2 : 2 + rows, 5 : 5 + vocab]
    elif layout == "transposed":  # strided columns
        logits = (4 * torch.randn(vocab, rows, generator=gen)).to(dtype).t()
    else:
        logits = (4 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    # Targets in this shard, in other shards, and ignore_index-like negatives.
    target = torch.randint(-3, vocab_start + vocab + 5, (rows,), generator=gen).to(target_dtype)
    stats, expected = vocab_ce_stats(logits, target, vocab_start), vocab_ce_stats_ref(logits, target, vocab_start)
    assert stats.shape == (rows, 4) and stats.dtype == torch.float32
    # max and the picked target logit are exact; the sums differ only in summation order.
    assert_close(stats[:, [0, 2]], expected[:, [0, 2]], exact=True)
    assert_close(stats[:, [1, 3]], expected[:, [1, 3]])


@pytest.mark.interpreter
@pytest.mark.kernel
def test_stats_kernel_negative_control():
    from tplayers.kernels.vocab_ce import vocab_ce_stats, vocab_ce_stats_ref

    logits, target = torch.randn(5, 70), torch.tensor([0, 3, 69, 70, -100])
    expected = vocab_ce_stats_ref(logits, target, 0)
    with pytest.raises(AssertionError):  # the neighbouring shard's statistics
        assert_close(vocab_ce_stats(logits.roll(1, 1), target, 0), expected)
    with pytest.raises(AssertionError):  # the wrong vocab_start picks other target logits
        assert_close(vocab_ce_stats(logits, target, 1), expected)


# --- embedding ------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmbeddingCase:
    vocab_per_rank: int
    dim: int
    shape: tuple = (2, 5)
    dtype: torch.dtype = torch.float32
    padding_idx: int | None = None
    wrong_shard: bool = False
    seed: int = 0
    vocab: int | None = None  # a vocabulary that does not divide (vocab_per_rank is then its ceil-share)


def run_embedding(rank, tp, group, case: EmbeddingCase):
    torch.manual_seed(case.seed)
    vocab = case.vocab if case.vocab is not None else case.vocab_per_rank * tp
    emb = nn.Embedding(vocab, case.dim, case.padding_idx, dtype=case.dtype)
    ids = torch.randint(0, vocab, case.shape)
    if case.padding_idx is not None:
        ids.view(-1)[::3] = case.padding_idx % vocab
    dy = torch.randn(*case.shape, case.dim).to(case.dtype)
    expected = emb(ids)
    expected.backward(dy)

    if case.wrong_shard:
        with torch.no_grad():
            emb.weight.copy_(emb.weight.roll(case.vocab_per_rank, 0))
    layer = VocabParallelEmbedding.from_embedding(emb, group=group)
    placement = tplayers.get_placement(layer.weight)
    assert placement.group is group and placement.placement == torch.distributed.tensor.Shard(0)
    out = layer(ids)
    out.backward(dy)
    # One rank contributes each output row and the others zeros: exact, forward and backward.
    kw = dict(rank=rank, num_shards=tp, exact=True)
    assert_shard_close(out, expected.detach(), dim=None, **kw, msg=lambda m: f"output: {m}")
    assert_shard_close(layer.weight.grad, emb.weight.grad, dim=0, **kw, msg=lambda m: f"weight grad: {m}")

    # Built under the same seed, the layer holds the shard of nn.Embedding's initialisation.
    torch.manual_seed(case.seed + 1)
    fresh = nn.Embedding(vocab, case.dim, case.padding_idx, dtype=case.dtype)
    torch.manual_seed(case.seed + 1)
    layer = VocabParallelEmbedding(vocab, case.dim, case.padding_idx, group=group, dtype=case.dtype)
    assert_shard_close(layer.weight.detach(), fresh.weight.detach(), dim=0, **kw, msg=lambda m: f"init: {m}")


@pytest.mark.multirank
@settings(max_examples=examples(15))
@given(
    tp=st.integers(1, 4), vocab_per_rank=st.integers(1, 12), dim=st.integers(1, 16),
    shape=st.sampled_from([(7,), (2, 5), (2, 1, 3)]), dtype=st.sampled_from(DTYPES),
    padding=st.sampled_from([None, 0, 3, -1]), seed=st.integers(0, 2**16), data=st.data(),
)  # fmt: skip
def test_embedding_matches_nn_embedding(pool, tp, vocab_per_rank, dim, shape, dtype, padding, seed, data):
    vocab = data.draw(st.integers(1, vocab_per_rank * tp), label="vocab")  # any vocabulary, uneven or under tp
    padding_idx = None if padding is None else padding % vocab if padding >= 0 else padding
    case = EmbeddingCase(vocab_per_rank, dim, shape, dtype, padding_idx, seed=seed, vocab=vocab)
    pool.run(run_embedding, tp, case)


@pytest.mark.multirank
def test_embedding_negative_control_wrong_shard_fails(pool):
    case = EmbeddingCase(vocab_per_rank=4, dim=3, wrong_shard=True)
    with pytest.raises(tplayers.RankError, match="Tensor-likes are not equal"):
        pool.run(run_embedding, 2, case)
    pool.run(run_embedding, 2, replace(case, wrong_shard=False))


# --- bad input ------------------------------------------------------------------------------


def bad_call(rank, tp, group, case):
    ragged = torch.randn(6, [4, 4, 2][rank])  # a vocabulary of 10 over 3 ranks
    if case == "uneven_without_vocab_size":
        vocab_parallel_cross_entropy(ragged, torch.zeros(6, dtype=torch.long), group=group)
    if case == "told_another_split":  # negative control: rank 2 believes in another vocabulary
        vocab_parallel_cross_entropy(ragged, torch.zeros(6, dtype=torch.long), group=group, vocab_size=10 + (rank == 2))
    layer = VocabParallelEmbedding(4 * tp, 4, group=group)
    logits = torch.randn(6, 5)
    calls = {
        "ids_out_of_range": lambda: layer(torch.tensor([0, 4 * tp])),
        "ids_negative": lambda: layer(torch.tensor([-1, 2])),
        "ids_float": lambda: layer(torch.zeros(3)),
        "target_shape": lambda: vocab_parallel_cross_entropy(logits, torch.zeros(5, dtype=torch.long), group=group),
        "target_float": lambda: vocab_parallel_cross_entropy(logits, torch.zeros(6), group=group),
        "target_out_of_range": lambda: vocab_parallel_cross_entropy(logits, torch.full((6,), 5 * tp), group=group),
        "reduction": lambda: vocab_parallel_cross_entropy(
            logits, torch.zeros(6, dtype=torch.long), group=group, reduction="avg"
        ),  # fmt: skip
        "smoothing": lambda: vocab_parallel_cross_entropy(
            logits, torch.zeros(6, dtype=torch.long), group=group, label_smoothing=1.5
        ),  # fmt: skip
    }
    calls[case]()


BAD_CASES = {
    "uneven_without_vocab_size": (
        ValueError,
        r"not one split of a vocabulary \(rank 0: 4 from 0 of 12, rank 1: 4 from 4 of 12, rank 2: 2 from 4 of 6\).*"
        r"pass vocab_size=",
    ),
    "told_another_split": (ValueError, r"rank 2: 2 from 8 of 11\)"),
    "ids_out_of_range": (ValueError, r"token ids must be in \[0, 12\), got ids from 0 to 12"),
    "ids_negative": (ValueError, r"token ids must be in \[0, 12\), got ids from -1 to 2"),
    "ids_float": (TypeError, "must be an integer tensor of token ids, got torch.float32"),
    "target_shape": (ValueError, r"target shape \(5,\) does not match local_logits \(6, 5\)"),
    "target_float": (TypeError, "target must be an integer tensor"),
    "target_out_of_range": (ValueError, r"target id 15 is outside the vocabulary \[0, 15\) and is not ignore_index"),
    "reduction": (ValueError, "reduction must be one of"),
    "smoothing": (ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_raises_on_every_rank(pool, case):
    error, pattern = BAD_CASES[case]
    start = time.monotonic()
    replies = pool.run(bad_call, 3, case, return_exceptions=True)
    assert time.monotonic() - start < 30  # nobody waited for a collective timeout
    for reply in replies:
        assert isinstance(reply, RemoteError) and reply.type_name == error.__name__, reply
        assert re.search(pattern, reply.message), reply.message


def run_with_mesh(rank, tp, group):
    """`group=` also takes a 1-D DeviceMesh, for the loss and the embedding."""
    mesh = torch.distributed.device_mesh.DeviceMesh.from_group(group, "cpu")
    logits, target = torch.randn(4, 3), torch.tensor([0, 5, -100, 3 * tp - 1])
    loss = vocab_parallel_cross_entropy(logits, target, group=mesh, reduction="sum")
    layer = VocabParallelEmbedding(2 * tp, 3, group=mesh)
    assert layer.group is group and tplayers.get_placement(layer.weight).group is group
    return loss, layer(torch.tensor([0, 2 * tp - 1]))


@pytest.mark.multirank
def test_device_mesh_group(pool):
    results = pool.run(run_with_mesh, 2)
    assert torch.isfinite(results[0][0]) and torch.equal(results[0][1], results[1][1])


def masked_shard_loss(rank, tp, group, backend):
    """One rank's whole vocabulary shard masked to -inf (padded / banned tokens): finite loss."""
    tplayers.set_backend(backend)
    torch.manual_seed(0)
    logits = torch.randn(5, 8 * tp)
    logits[:, 8:] = float("-inf")  # everything but rank 0's shard
    target = torch.randint(0, 8, (5,))
    local = logits.chunk(tp, -1)[rank].clone().requires_grad_(True)
    full = logits.clone().requires_grad_(True)
    loss = tplayers.vocab_parallel_cross_entropy(local, target, group=group)
    expected = torch.nn.functional.cross_entropy(full, target)
    loss.backward()
    expected.backward()
    assert torch.isfinite(loss)
    assert_close(loss, expected)
    assert_close(local.grad, full.grad.chunk(tp, -1)[rank])


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_masked_vocab_shard_gives_finite_loss(pool, backend):
    pool.run(masked_shard_loss, 2, backend)


def replicas_in_the_group(rank, world, group):
    """TP 2 x DP 2, each replica its own tokens: the loss over the world (the default group)
    would mix the replicas' vocab shards and targets into one wrong number."""
    mesh = tplayers.init_mesh(dp=2, tp=2)
    local = torch.randn(6, 8, generator=torch.Generator().manual_seed(mesh["tp"].get_local_rank()))
    target = torch.randint(0, 16, (6,), generator=torch.Generator().manual_seed(10 + mesh["dp"].get_local_rank()))
    vocab_parallel_cross_entropy(local, target, group=mesh["tp"])  # the right group
    try:
        vocab_parallel_cross_entropy(local, target)
    except ValueError as e:
        return str(e)


@pytest.mark.multirank
def test_a_group_holding_replicas_is_refused_on_every_rank(pool):
    for said in pool.run(replicas_in_the_group, 4):
        assert said is not None and "hold different targets" in said and "mesh['tp']" in said, said
