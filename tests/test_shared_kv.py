"""Key/value heads held only where they are read (`tplayers.hf.fused.SharedKVProjection`).

Where the key/value heads do not split with the query heads (fewer key/value heads than ranks,
or query heads split unevenly), each rank holds the heads its query heads read, and the gradient
of a head several ranks hold is summed over those ranks alone. Checked here: what each rank holds
(against the head split, for every attention layout that shares heads), the per-rank bytes
against the ideal split, the gradient bytes against a formula (and the planner's), the clip norm
counting each shared head once (with a negative control), and the copies staying bit-identical.
Exactness of the models themselves is in test_families (heads that do not divide, TP 3 / 4).
"""

import copy
import re

import pytest
import torch

import tplayers
from tests.test_families import VOCAB, tiny_model
from tplayers.functional import comm
from tplayers.functional.collectives import all_gather_any
from tplayers.hf.fused import SharedKVProjection
from tplayers.placement import even_sizes, get_placement, shard_range
from tplayers.plan import ModelSpec
from tplayers.plan.specs import kv_rows_exchanged
from tplayers.testing import assert_close
from tplayers.testing.meshes import layout_mesh

pytestmark = pytest.mark.multirank

# (family, config overrides, heads, key/value heads, head width, TP sizes): every layout that shares heads
CASES = [
    ("llama", dict(num_attention_heads=9, num_key_value_heads=3, head_dim=8, hidden_size=72), 9, 3, 8, (2, 4)),
    ("qwen2", dict(num_attention_heads=14, num_key_value_heads=2, head_dim=8, hidden_size=112), 14, 2, 8, (3, 4)),
    ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=4, hidden_size=32), 8, 2, 4, (8,)),
    ("opt", dict(num_attention_heads=4, hidden_size=32), 4, 4, 8, (3,)),  # MHA, 4 heads over 3: 2, 1, 1
    ("glm4", {}, 4, 2, 8, (3, 4)),
    ("phi3", {}, 4, 2, 8, (3, 4)),  # fused [q; k; v]
    ("dbrx", {}, 4, 2, 8, (3, 4)),  # fused Wqkv
    ("gpt_oss", {}, 4, 2, 8, (3, 4)),  # attention sinks per head
    ("falcon-new", {}, 4, 2, 8, (4,)),  # key/value groups fewer than ranks
    ("gpt_bigcode", {}, 4, 1, 8, (3,)),  # multi-query: the one head on every rank
]
IDS = [f"{f}-{h}x{kv}" for f, _, h, kv, _, _ in CASES]
HELD = [(c, tp) for c in CASES for tp in c[5]]


def heads_read(heads, kv_heads, tp, rank) -> list[int]:
    """The key/value heads rank `rank`'s whole query heads read (query heads as evenly as they go)."""
    start, count = shard_range(heads, tp, rank, even_sizes(heads, tp))
    return sorted({h // (heads // kv_heads) for h in range(start, start + count)})


def held_where_read(rank, tp, group, family, config, heads, kv_heads, head_dim):
    model = tiny_model(family, **config)
    full = {n: p.numel() for n, p in model.named_parameters()}
    tplayers.parallelize(model, group=group)
    shared = [m for m in model.modules() if isinstance(m, SharedKVProjection)]
    assert shared, f"{family} at TP {tp}: no shared key/value projection"
    read = heads_read(heads, kv_heads, tp, rank)
    for m in shared:
        # the rows of the key / value block: [k; v] (k and v alone: [k]), or Falcon's [k0, v0, k1, v1, ...]
        per_head = 2 * head_dim if family.startswith("falcon") else head_dim
        heads_held = sorted({int(r) // per_head % kv_heads for r in m.held})
        assert heads_held == read, (family, tp, rank, heads_held, read)
        parts = m.out_features // (kv_heads * head_dim)  # 1 (k or v), 2 ([k; v] of a fused projection)
        assert m.weight.shape[0] == parts * len(read) * head_dim
    # nothing of two or more dims is whole on a rank but what the math keeps whole: routers (one output
    # per expert), a learned position table (added to the whole residual stream), gpt-oss's expert
    # down-projection biases (added once after the sum over ranks)
    for name, p in model.named_parameters():
        if p.dim() >= 2 and not get_placement(p).is_sharded and p.numel() == full[name]:
            assert re.search(r"router|position|wpe|\.gate\.weight|_bias$", name), f"{family}: {name} is whole"
    return sum(p.numel() for p in model.parameters()), sum(full.values())


@pytest.mark.parametrize("case, tp", HELD, ids=[f"{IDS[CASES.index(c)]}-tp{tp}" for c, tp in HELD])
def test_each_rank_holds_the_key_value_heads_its_queries_read(tplayers_pool, case, tp):
    family, config, heads, kv_heads, head_dim, _ = case
    tplayers_pool.run(held_where_read, tp, family, config, heads, kv_heads, head_dim)


def ideal_bytes(model, tp, rank, heads, kv_heads):
    """The ideal split of a q/k/v/o model's parameters on `rank`: its whole heads' query and output
    rows, the key/value heads they read, its torch.chunk share of every other matrix and of the
    column layers' biases (along the split dim: the larger), norms and row layers' biases whole."""
    start, count = shard_range(heads, tp, rank, even_sizes(heads, tp))
    read = len(heads_read(heads, kv_heads, tp, rank))
    total = 0.0
    for name, p in model.named_parameters():
        row_bias = p.dim() == 1 and any(k in name for k in ("o_proj", "out_proj", "down_proj", "fc2"))
        if "q_proj" in name or (("o_proj" in name or "out_proj" in name) and not row_bias):
            total += p.numel() * count / heads
        elif "k_proj" in name or "v_proj" in name:
            total += p.numel() * read / kv_heads
        elif row_bias or (p.dim() == 1 and not any(k in name for k in ("fc1", "gate", "up_proj"))):
            total += p.numel()
        else:
            width = max(p.shape)
            total += p.numel() * max(0, min(-(-width // tp), width - rank * -(-width // tp))) / width
    return total


def bytes_against_ideal(rank, tp, group, family, config, heads, kv_heads):
    model = tiny_model(family, **config)
    ideal = ideal_bytes(model, tp, rank, heads, kv_heads)
    full = sum(p.numel() for p in model.parameters())
    tplayers.parallelize(model, group=group)
    return sum(p.numel() for p in model.parameters()) / ideal, sum(p.numel() for p in model.parameters()) / full


# The cases (OPT at TP 3: rank 1 held 0.52 of the model, GLM-4 at TP 3 / 4: 0.59 / 0.44) and
# published head counts at TP 3, 4 and 8
MEMORY = [
    ("opt", dict(num_attention_heads=4, hidden_size=32), 4, 4, 3),
    ("glm4", {}, 4, 2, 3),
    ("glm4", {}, 4, 2, 4),
    ("qwen2", dict(num_attention_heads=28, num_key_value_heads=4, head_dim=8, hidden_size=224), 28, 4, 3),
    ("qwen2", dict(num_attention_heads=14, num_key_value_heads=2, head_dim=8, hidden_size=112), 14, 2, 4),
    ("llama", dict(num_attention_heads=32, num_key_value_heads=8, head_dim=4, hidden_size=128), 32, 8, 3),
    ("llama", dict(num_attention_heads=24, num_key_value_heads=2, head_dim=4, hidden_size=96), 24, 2, 8),
]


@pytest.mark.parametrize(
    "family, config, heads, kv_heads, tp", MEMORY, ids=[f"{m[0]}-{m[2]}x{m[3]}-tp{m[4]}" for m in MEMORY]
)
def test_per_rank_bytes_within_five_percent_of_the_ideal_split(tplayers_pool, family, config, heads, kv_heads, tp):
    replies = tplayers_pool.run(bytes_against_ideal, tp, family, config, heads, kv_heads)
    for rank, (ratio, _) in enumerate(replies):
        assert ratio <= 1.05, f"rank {rank} holds {ratio:.3f} of its ideal split"


def gradient_bytes(rank, tp, group, config):
    model = tiny_model("qwen2", **config)
    tplayers.parallelize(model, group=group)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids).loss
    with comm.count_bytes() as counted:
        loss.backward()
    return counted["all_to_all"]


def test_key_value_gradient_bytes_equal_the_formula(tplayers_pool):
    """28 heads over 3 ranks (10, 9, 9) reading 4 key/value heads of 7: rank 0 reads 0-1, rank 1
    1-2, rank 2 2-3, so it exchanges one head's rows with each neighbour, k and v, per layer: the
    bytes the planner prices too."""
    heads, kv_heads, head_dim, hidden, layers, tp = 28, 4, 8, 224, 2, 3
    config = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=hidden)
    sent = tplayers_pool.run(gradient_bytes, tp, config)
    bias = 1  # Qwen2's q / k / v have biases: weight and bias rows travel together
    for rank in range(tp):
        read = [set(heads_read(heads, kv_heads, tp, r)) for r in range(tp)]
        shared = sum(len(read[rank] & read[s]) for s in range(tp) if s != rank)
        expected = layers * 2 * shared * head_dim * (hidden + bias) * 4
        assert sent[rank] == expected, (rank, sent[rank], expected)
        spec = ModelSpec(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         ffn_hidden=64, vocab=VOCAB, seq_len=8, linear_bias=True)  # fmt: skip
        rows, same = kv_rows_exchanged(spec, tp, rank)
        assert not same and layers * 2 * rows * (hidden + bias) * 4 == expected


def clip_and_step(rank, tp, group, count_once):
    config = dict(num_attention_heads=14, num_key_value_heads=2, head_dim=8, hidden_size=112)
    model = tiny_model("qwen2", **config)
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=group)
    if not count_once:  # the negative control: every rank counts the heads it shares too
        for m in model.modules():
            if isinstance(m, SharedKVProjection):
                m.plan.counted = (0, m.held.numel())
                m._tag_parameters()
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    reference(ids, labels=ids).loss.backward()
    norm = tplayers.clip_grad_norm_(model.parameters(), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.step()
    # every copy of a shared head holds the same bits after the step (each holder summed in rank order)
    for m in model.modules():
        if isinstance(m, SharedKVProjection):
            rows = m.held.numel()
            sizes = [torch.unique(r).numel() for r in m.rows_of_ranks]
            gathered = all_gather_any(m.weight.detach().contiguous(), 0, group)
            held = torch.cat(m.plan.held)
            for row in torch.unique(held):
                copies = gathered[held == row]
                assert (copies == copies[0]).all(), f"row {int(row)} differs between its holders"
            assert rows == sizes[rank]
    return norm.item(), expected.item()


def test_clip_counts_each_shared_head_once_and_the_copies_stay_identical(tplayers_pool):
    for norm, expected in tplayers_pool.run(clip_and_step, 4, True):
        assert_close(torch.tensor(norm), torch.tensor(expected))
    for norm, expected in tplayers_pool.run(clip_and_step, 4, False):  # negative control
        with pytest.raises(AssertionError):
            assert_close(torch.tensor(norm), torch.tensor(expected))


def clip_under_zero(rank, world, group, zero_stage):
    """TP 4 x DP 2 with ZeRO: each replica holds half of each TP rank's rows of a shared head."""
    mesh = layout_mesh(2, 1, 4)
    config = dict(num_attention_heads=14, num_key_value_heads=2, head_dim=8, hidden_size=112)
    model = tiny_model("qwen2", **config)
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=mesh["tp"])
    tplayers.data_parallel(model, group=mesh["dp"], zero_stage=zero_stage)
    ids = torch.randint(3, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    model(ids.chunk(2)[mesh["dp"].get_local_rank()], labels=ids.chunk(2)[mesh["dp"].get_local_rank()]).loss.backward()
    reference(ids, labels=ids).loss.backward()
    norm = tplayers.clip_grad_norm_(model.parameters(), 0.5)
    return norm.item(), torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5).item()


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_clip_under_zero_counts_each_shared_head_once(tplayers_pool, zero_stage):
    for norm, expected in tplayers_pool.run(clip_under_zero, 8, zero_stage, mesh=(2, 1, 4)):
        assert_close(torch.tensor(norm), torch.tensor(expected))
