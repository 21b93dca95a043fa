"""Dropout under tensor parallelism (tplayers.functional.rng): the ranks' replicated hidden states
stay alike when a split is uneven (before, 3 heads over 2 ranks drew unequal numbers in the
attention and parted the ranks' generators: each rank trained a different model, silently), each
rank's slice (and its part of the sequence) draws masks of its own, and activation checkpointing
recomputes the same masks."""

import pytest
import torch
import torch.distributed as dist

import tplayers
from tplayers.functional.rng import enter_sharded_region, inside_sharded_region, leave_sharded_region, shared_draws
from tplayers.state import set_state
from tplayers.testing import assert_close

pytestmark = pytest.mark.multirank

VOCAB = 96


def gpt2(heads, **config):
    """GPT-2 with its default dropout (0.1 on embeddings, attention probabilities and residuals)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=8 * heads, n_layer=2, n_head=heads, n_positions=64, **config)
    return tf.GPT2LMHeadModel(cfg)


def _gathered(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def hidden_states_in_training(rank, tp, group, heads, sequence_parallel, seed_per_rank):
    """Every rank's hidden states after each block of one training forward, gathered."""
    model = tplayers.parallelize(gpt2(heads), group=group, sequence_parallel=sequence_parallel, verify=False).train()
    torch.manual_seed(7 + (rank if seed_per_rank else 0))  # torchrun scripts seed every rank alike
    if seed_per_rank:  # the first training forward would refuse it (below): disarmed, to show what that prevents
        set_state(model, check_generators=False)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    out = model(ids, output_hidden_states=True)
    assert not inside_sharded_region()  # the forward ends on the shared generator
    return [_gathered(h.detach(), group) for h in out.hidden_states]


@pytest.mark.parametrize(
    "tp, heads, sequence_parallel", [(2, 3, False), (2, 3, True), (4, 5, False), (2, 4, False)],
    ids=["3-heads-tp2", "3-heads-tp2-sp", "5-heads-tp4", "4-heads-tp2"],
)  # fmt: skip
def test_ranks_keep_one_model_under_dropout(pool, tp, heads, sequence_parallel):
    for states in pool.run(hidden_states_in_training, tp, heads, sequence_parallel, False)[0]:
        for other in states[1:]:
            assert torch.equal(other, states[0])


def test_negative_control_ranks_seeded_apart_are_seen_apart(pool):
    """The comparison above sees ranks whose shared generators differ (each seeded by its rank)."""
    states = pool.run(hidden_states_in_training, 2, 4, False, True)[0]
    assert any(not torch.equal(s[1], s[0]) for s in states)


def seeded_apart(rank, tp, group, rates):
    """The error of the first training forward (after an eval one) of GPT-2 with `rates` on ranks
    seeded apart, or None."""
    model = tplayers.parallelize(gpt2(4, **rates), group=group, verify=False)
    torch.manual_seed(7 + rank)  # a data-parallel script's seed + rank
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    model.eval()(ids)  # an evaluation draws nothing: the check waits for training
    try:
        model.train()(ids, labels=ids).loss.backward()
    except ValueError as e:
        return str(e)
    return None


def test_ranks_seeded_apart_are_refused_where_the_model_draws(pool):
    for message in pool.run(seeded_apart, 2, {}):
        assert message is not None and "hold different random generators" in message, message
        assert "torch.manual_seed(seed)" in message
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # nothing drawn: nothing to refuse
    assert pool.run(seeded_apart, 2, no_dropout) == [None, None]


def region_draws(rank, tp, group):
    """(draws inside the region, shared draws inside it, draws after it) of every rank, and whether
    the shared generator ends as it began but for the shared draws and one draw for the region's
    own (whatever the region drew for itself), and untouched by a region that drew nothing."""
    torch.manual_seed(3)
    enter_sharded_region(torch.device("cpu"), group)
    inside = torch.rand(4 + rank)[:4]  # unequal draws, as an uneven split makes
    with shared_draws(torch.device("cpu")):  # peft's dropout on a column layer's whole input
        shared = torch.rand(4)
    inside = torch.cat([inside, torch.rand(2)])  # the region's own stream resumes
    leave_sharded_region()
    after = torch.rand(4)
    torch.manual_seed(3)
    in_step = torch.equal(shared, torch.rand(4))
    torch.randint(2, ())  # the region's one draw
    in_step = in_step and torch.equal(after, torch.rand(4))
    enter_sharded_region(torch.device("cpu"), group)  # a region without dropout: the stream as unsharded
    leave_sharded_region()
    untouched = torch.rand(4)
    torch.manual_seed(3)
    torch.rand(4), torch.randint(2, ()), torch.rand(4)
    in_step = in_step and torch.equal(untouched, torch.rand(4))
    return _gathered(inside, group), _gathered(shared, group), _gathered(after, group), in_step


def test_each_rank_draws_its_own_inside_a_region_and_alike_after(pool):
    inside, shared, after, in_step = pool.run(region_draws, 3)[0]
    assert len({tuple(t.tolist()) for t in inside}) == 3
    assert all(torch.equal(t, shared[0]) for t in shared)
    assert all(torch.equal(t, after[0]) for t in after)
    assert in_step


def checkpointed_grads(rank, tp, group, checkpointing):
    from tplayers.hf import gather_grads

    model = tplayers.parallelize(gpt2(3), group=group, verify=False).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(11)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    return gather_grads(model, group=group)


def test_activation_checkpointing_recomputes_the_same_masks(pool):
    """The recomputed blocks draw the masks the forward drew (the region's stream derives from the
    shared state, which checkpointing restores): every gradient as without checkpointing."""
    plain = pool.run(checkpointed_grads, 2, False)[0]
    recomputed = pool.run(checkpointed_grads, 2, True)[0]
    for name, grad in plain.items():
        assert_close(recomputed[name], grad, msg=lambda m, name=name: f"{name}: {m}")


def layers_with_dropout(rank, tp, group):
    """The layers on their own, in a model of the user's: a column layer (5 features over the ranks,
    unevenly), dropout on its slice, the slices gathered, dropout on the whole: alike on every rank."""
    from tplayers.functional import gather_from_tp_region
    from tplayers.nn import ColumnParallelLinear

    torch.manual_seed(0)
    layer = ColumnParallelLinear(4, 5, group=group).train()
    torch.manual_seed(9)
    y = torch.nn.functional.dropout(layer(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))), 0.5)
    whole = torch.nn.functional.dropout(gather_from_tp_region(y, group, total=5), 0.5)
    return _gathered(whole.detach(), group)


def test_a_users_model_of_layers_keeps_one_model_under_dropout(pool):
    wholes = pool.run(layers_with_dropout, 3)[0]
    assert all(torch.equal(w, wholes[0]) for w in wholes)


_unguarded = (lambda device, group: None, lambda: None)  # a block's part draws on the shared generator


def replicated_over_steps(rank, tp, group, length, checkpointing, unguarded=False):
    """Per training step under sequence parallelism: whether every rank holds the same gradient of
    the replicated position embeddings, and the same shared generator after the step."""
    from tplayers.hf import sequence_split

    kept = sequence_split.enter_sequence_region, sequence_split.leave_sequence_region
    if unguarded:  # the negative control: the blocks' parts draw on the shared generator unchecked
        sequence_split.enter_sequence_region, sequence_split.leave_sequence_region = _unguarded
    try:
        model = tplayers.parallelize(gpt2(4), group=group, sequence_parallel=True, verify=False).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(7)
        ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
        alike = []
        for _ in range(2):
            model.zero_grad()
            model(ids, labels=ids).loss.backward()
            grads = _gathered(model.transformer.wpe.weight.grad, group)
            states = _gathered(torch.default_generator.get_state(), group)
            alike.append(
                all(torch.equal(g, grads[0]) for g in grads) and all(torch.equal(s, states[0]) for s in states)
            )
    finally:
        sequence_split.enter_sequence_region, sequence_split.leave_sequence_region = kept
    return alike


@pytest.mark.parametrize("tp, length, checkpointing", [(2, 7, False), (2, 7, True), (3, 7, False), (2, 8, False)],
                         ids=["tp2-7-tokens", "tp2-7-tokens-checkpointed", "tp3-7-tokens", "tp2-8-tokens"])  # fmt: skip
def test_parts_of_different_lengths_keep_the_ranks_generators_in_step(pool, tp, length, checkpointing):
    """7 tokens over 2 ranks are parts of 4 and 3, whose dropout draws different counts: the blocks
    give the shared generator back alike, so the next step's embedding dropout (whose backward masks
    every token's gradient on every rank) is every rank's alike."""
    assert pool.run(replicated_over_steps, tp, length, checkpointing) == [[True, True]] * tp


def test_negative_control_parts_drawing_unchecked_part_the_generators(pool):
    assert pool.run(replicated_over_steps, 2, 7, False, True)[0] == [False, False]  # parted from the first step


def sequence_part_masks(rank, tp, group, length, unguarded):
    """Every rank's residual-dropout mask of the first block, on its part of the sequence."""
    from tplayers.hf import sequence_split

    kept = sequence_split.enter_sequence_region, sequence_split.leave_sequence_region
    if unguarded:
        sequence_split.enter_sequence_region, sequence_split.leave_sequence_region = _unguarded
    try:
        model = tplayers.parallelize(gpt2(4, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.5), group=group,
                                     sequence_parallel=True, verify=False).train()  # fmt: skip
        masks = []
        model.transformer.h[0].attn.resid_dropout.register_forward_hook(lambda m, a, out: masks.append(out == 0))
        torch.manual_seed(5)
        model(torch.arange(1, length + 1).view(1, -1))
    finally:
        sequence_split.enter_sequence_region, sequence_split.leave_sequence_region = kept
    return masks[0][0]


def _repeats(parts):
    """Whether some rank's part repeats the first rank's mask over its own tokens."""
    return any(torch.equal(p, parts[0][: len(p)]) for p in parts[1:])


@pytest.mark.parametrize("tp, length", [(2, 8), (3, 7)])
def test_each_ranks_part_of_the_sequence_draws_masks_of_its_own(pool, tp, length):
    """Unsharded dropout draws every token's mask independently; drawn from the shared generator,
    each rank's part got the first rank's masks again (tokens 0-3 and 4-7 dropped alike)."""
    assert not _repeats(pool.run(sequence_part_masks, tp, length, False))


def test_negative_control_parts_drawn_from_the_shared_generator_repeat(pool):
    assert _repeats(pool.run(sequence_part_masks, 2, 8, True))
