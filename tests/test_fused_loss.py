"""The loss without logits: the fused LM-head GEMM + cross-entropy against its unsharded torch
counterpart (F.cross_entropy of F.linear), forward and every gradient, on 1-4 ranks with uneven
vocabularies and both backends; its gradient kernel against the reference; a parallelized HF
model's training loss and gradients against the unsharded model's (padding labels,
num_items_in_batch, SP, ZeRO-3), with no logits held or gathered; which forwards are fused."""

import copy
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tplayers
from tplayers.functional.linear_cross_entropy import linear_cross_entropy
from tplayers.hf import fused_loss, gather_grads
from tplayers.hf.fused_loss import unfused_because
from tplayers.testing import assert_close, assert_shard_close, examples, kernel_generator, layout_mesh, memory, shard_of

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# --- the gradient kernel ----------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.kernel
@settings(max_examples=examples(30))
@given(
    rows=st.integers(1, 30), vocab=st.integers(1, 200), dtype=st.sampled_from(DTYPES), sliced=st.booleans(),
    vocab_start=st.sampled_from([0, 5, 200]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_grad_kernel_matches_reference(rows, vocab, dtype, sliced, vocab_start, seed):
    from tplayers.kernels.vocab_ce import vocab_ce_grad, vocab_ce_grad_ref

    gen = kernel_generator(seed)
    wide = (3 * torch.randn(rows + 2, vocab + 7, generator=gen)).to(dtype)
    logits = wide[1 : 1 + rows, 3 : 3 + vocab] if sliced else wide[:rows, :vocab].contiguous()
    target = torch.randint(-2, vocab_start + vocab + 3, (rows,), generator=gen)
    lse = torch.logsumexp(logits.float(), 1) + torch.rand(rows, generator=gen)  # a shard of a wider vocabulary
    scale = torch.rand(rows, generator=gen) * (torch.rand(rows, generator=gen) > 0.2)
    expected = vocab_ce_grad_ref(logits.clone(), target, lse, scale, vocab_start)
    before = wide.clone()
    got = vocab_ce_grad(logits, target, lse, scale, vocab_start)
    assert got.data_ptr() == logits.data_ptr()  # in place, and nothing outside the view touched
    outside = torch.ones_like(wide, dtype=torch.bool)
    outside[(slice(1, 1 + rows), slice(3, 3 + vocab)) if sliced else (slice(0, rows), slice(0, vocab))] = False
    assert torch.equal(wide[outside], before[outside])
    assert_close(got, expected)


@pytest.mark.interpreter
@pytest.mark.kernel
def test_grad_kernel_negative_control():
    from tplayers.kernels.vocab_ce import vocab_ce_grad, vocab_ce_grad_ref

    logits, target = torch.randn(4, 70), torch.tensor([0, 3, 69, 70])
    lse, scale = torch.logsumexp(logits, 1), torch.ones(4)
    expected = vocab_ce_grad_ref(logits.clone(), target, lse, scale, 0)
    with pytest.raises(AssertionError):  # the wrong vocab_start subtracts the one-hot elsewhere
        assert_close(vocab_ce_grad(logits.clone(), target, lse, scale, 1), expected)
    assert_close(vocab_ce_grad(logits.clone(), target, lse, scale, 0), expected)


# --- linear_cross_entropy against F.cross_entropy(F.linear(...)) --------------------------------


@dataclass(frozen=True)
class Case:
    rows: int
    hidden: int
    vocab: int
    dtype: torch.dtype = torch.float32
    bias: bool = False
    ignored: float = 0.25
    divisor: float | None = None  # HF's num_items_in_batch
    chunk_rows: int = 3  # forces several chunks
    backend: str = "torch"
    wrong_shard: bool = False  # negative control: each rank holds its neighbour's rows of the weight
    seed: int = 0


def run_linear_loss(rank, tp, group, case: Case):
    tplayers.set_backend(case.backend)
    gen = torch.Generator().manual_seed(case.seed)
    hidden = torch.randn(case.rows, case.hidden, generator=gen).to(case.dtype).requires_grad_(True)
    weight = torch.randn(case.vocab, case.hidden, generator=gen).to(case.dtype).requires_grad_(True)
    bias = torch.randn(case.vocab, generator=gen).to(case.dtype).requires_grad_(True) if case.bias else None
    target = torch.randint(0, case.vocab, (case.rows,), generator=gen)
    target[torch.rand(case.rows, generator=gen) < case.ignored] = -100
    logits = F.linear(hidden, weight, bias).float()
    expected = F.cross_entropy(logits, target, reduction="sum" if case.divisor else "mean")
    expected = expected / case.divisor if case.divisor else expected
    expected.backward()

    shift = -(-case.vocab // tp) if case.wrong_shard else 0
    mine = lambda t: shard_of(t.detach().roll(-shift, 0), 0, rank, tp).clone().requires_grad_(True)
    h, w, b = hidden.detach().clone().requires_grad_(True), mine(weight), mine(bias) if case.bias else None
    step = case.chunk_rows * max(1, w.shape[0]) * h.element_size()
    loss = linear_cross_entropy(h, w, b, target, group=group, vocab_size=case.vocab, divisor=case.divisor,
                                chunk_bytes=step)  # fmt: skip
    loss.backward()
    assert loss.dtype == torch.float32
    if expected.isnan():  # every row ignored: the mean over none
        assert loss.isnan()
        return loss.detach()
    assert_close(loss, expected.detach(), msg=lambda m: f"loss: {m}")
    assert_close(h.grad, hidden.grad, msg=lambda m: f"hidden grad: {m}")
    assert_shard_close(w.grad, weight.grad, dim=0, rank=rank, num_shards=tp, msg=lambda m: f"weight grad: {m}")
    if case.bias:
        assert_shard_close(b.grad, bias.grad, dim=0, rank=rank, num_shards=tp, msg=lambda m: f"bias grad: {m}")
    return loss.detach()


def check_linear_loss(pool, tp, case):
    losses = pool.run(run_linear_loss, tp, case)
    for loss in losses[1:]:  # every rank combines the same statistics in the same order
        torch.testing.assert_close(loss, losses[0], rtol=0, atol=0, equal_nan=True)


def linear_cases(draw, backend):
    tp = draw(st.integers(1, 4))
    return tp, Case(
        rows=draw(st.integers(1, 12)), hidden=draw(st.integers(1, 16)), vocab=draw(st.integers(1, 13 * tp)),
        dtype=draw(st.sampled_from(DTYPES if backend == "torch" else [torch.float32, torch.float16])),
        bias=draw(st.booleans()), ignored=draw(st.sampled_from([0.0, 0.3, 1.0])),
        divisor=draw(st.sampled_from([None, 7.0])), chunk_rows=draw(st.integers(1, 13)), backend=backend,
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


@pytest.mark.multirank
@settings(max_examples=examples(25))
@given(st.data())
def test_linear_loss_matches_cross_entropy_torch_backend(pool, data):
    check_linear_loss(pool, *data.draw(st.composite(lambda draw: linear_cases(draw, "torch"))()))


@pytest.mark.multirank
@pytest.mark.interpreter
@settings(max_examples=examples(6))
@given(st.data())
def test_linear_loss_matches_cross_entropy_triton_backend(pool, data):
    check_linear_loss(pool, *data.draw(st.composite(lambda draw: linear_cases(draw, "triton"))()))


def loss_without_grad(rank, tp, group):
    from tplayers.testing.ops import count_ops

    hidden, weight = torch.randn(6, 4, requires_grad=True), torch.randn(11, 4, requires_grad=True)
    target = torch.randint(0, 11, (6,))
    with count_ops() as ops, torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, None, target, group=group, vocab_size=11)
    assert ops.by_name["mm"] == 1 and ops.by_name["addmm_"] == 0 and ops.by_name["zeros_like"] == 0  # logits only
    assert_close(loss, F.cross_entropy(hidden @ weight.t(), target).detach())


@pytest.mark.multirank
def test_linear_loss_under_no_grad_computes_no_gradient(pool):
    """Under torch.no_grad (an evaluation in train mode) the loss alone: the logits' GEMM, no
    gradient GEMMs and no (V, H) weight-gradient buffer."""
    pool.run(loss_without_grad, 1)


def backward_twice(rank, tp, group):
    hidden, weight = torch.randn(6, 4, requires_grad=True), torch.randn(11, 4, requires_grad=True)
    ref_hidden, ref_weight = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    target = torch.randint(0, 11, (6,))
    loss = linear_cross_entropy(hidden, weight, None, target, group=group, vocab_size=11)
    ref = F.cross_entropy(ref_hidden @ ref_weight.t(), target)
    for scale in (2.0, 0.5):  # as a zero-bubble schedule's input pass, then its weight pass
        (loss * scale).backward(retain_graph=True)
        (ref * scale).backward(retain_graph=True)
    for mine, theirs in ((hidden, ref_hidden), (weight, ref_weight)):
        assert_close(mine.grad, theirs.grad)
    loss.backward()  # the last: the graph's gradients given up ...
    with pytest.raises(RuntimeError, match="backpropagated twice"):
        loss.backward()  # ... so another is refused, never silently zero or doubled


@pytest.mark.multirank
def test_linear_loss_backward_again_with_retain_graph(pool):
    """retain_graph=True keeps the gradients the forward computed: a second backward (a zero-bubble
    schedule's weight pass) gives what the unfused loss gives; after the last one, a further one raises."""
    pool.run(backward_twice, 1)


@pytest.mark.multirank
def test_linear_loss_negative_control_wrong_shard_fails(pool):
    case = Case(rows=6, hidden=5, vocab=14, ignored=0.0, wrong_shard=True)
    with pytest.raises(tplayers.RankError, match="are not close"):
        check_linear_loss(pool, 2, case)
    check_linear_loss(pool, 2, replace(case, wrong_shard=False))


# --- a parallelized HF model ------------------------------------------------------------------

VOCAB = 101  # uneven over 2, 3 and 4 ranks


def tiny_llama(dtype=torch.float32, tied=False, vocab=VOCAB):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    return tf.LlamaForCausalLM(config).to(dtype).train()


def batch(seed, length=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, length), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100  # padding / a prompt not scored
    labels[1, -2:] = -100
    return ids, labels


def fused_matches(rank, tp, group, sequence_parallel, tied, num_items, zero3):
    model = tiny_llama(tied=tied)
    reference = copy.deepcopy(model)
    if zero3:  # dp 2 x tp 2: each replica its own batch, gradients the mean over both
        mesh = layout_mesh(2, 1, 2)
        group = mesh["tp"]
    tplayers.parallelize(model, group=group, sequence_parallel=sequence_parallel)
    assert fused_loss.installed(model)
    if zero3:
        tplayers.data_parallel(model, group=mesh["dp"], zero_stage=3)
    replica = mesh["dp"].get_local_rank() if zero3 else 0
    ids, labels = batch(replica)
    kwargs = {"num_items_in_batch": torch.tensor(num_items)} if num_items else {}
    out = model(input_ids=ids, labels=labels, **kwargs)
    assert out.logits is None  # no logits in a training forward given labels
    out.loss.backward()
    expected = []
    for r in range(2 if zero3 else 1):  # the unsharded model on every replica's batch
        ref_ids, ref_labels = batch(r)
        ref = reference(input_ids=ref_ids, labels=ref_labels, **kwargs)
        (ref.loss / (2 if zero3 else 1)).backward()
        expected.append(ref.loss.detach())
    assert_close(out.loss, expected[replica])
    grads = gather_grads(model)
    for name, p in reference.named_parameters():
        assert_close(grads[name], p.grad, msg=lambda m, k=name: f"grad of {k}: {m}")
    model.eval()  # eval mode: the logits, as before
    with torch.no_grad():
        logits = model(input_ids=ids, labels=labels).logits
    assert_close(logits, reference.eval()(input_ids=ids).logits)


CASES = [  # (tp, sequence_parallel, tied, num_items_in_batch, zero3)
    (1, False, False, None, False),
    (2, False, False, 13, False),
    (3, False, True, None, False),
    (4, True, False, None, False),
    (2, True, True, 9, False),
    (4, False, False, None, True),
]


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=[f"tp{c[0]}{'-sp' * c[1]}{'-tied' * c[2]}{'-items' * bool(c[3])}"
                                             f"{'-zero3' * c[4]}" for c in CASES])  # fmt: skip
def test_fused_loss_matches_unsharded_model(pool, case):
    tp, sequence_parallel, tied, num_items, zero3 = case
    mesh = (2, 1, 2) if zero3 else None
    pool.run(fused_matches, tp, sequence_parallel, tied, num_items, zero3, mesh=mesh)


BIG_VOCAB = 3001  # the vocabulary much wider than the hidden size, as in real models


def peak_and_bytes(rank, tp, group, training_logits):
    model = tiny_llama(vocab=BIG_VOCAB)
    tplayers.parallelize(model, group=group, training_logits=training_logits, verify=False)
    ids = torch.randint(0, BIG_VOCAB, (4, 64), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # warm: the same-inputs check, the gradients' first allocation
        model(input_ids=ids, labels=ids).loss.backward()
    with tplayers.count_bytes() as sent, memory.peak_bytes() as peak:
        model(input_ids=ids, labels=ids).loss.backward()
    return peak.bytes, sent["all_gather"]


@pytest.mark.multirank
@pytest.mark.skipif(not memory.available(), reason="the peak is read from glibc's mallinfo2 (Linux)")
def test_peak_memory_falls_by_the_logits_and_none_are_gathered(pool):
    """At TP 2 the fused loss's peak is below the logits path's by at least the (tokens, V / 2)
    fp32 logits it no longer holds, and its all-gathers carry 4 fp32 statistics per row, not logits."""
    tp, tokens = 2, 4 * 64
    (fused, fused_sent), _ = pool.run(peak_and_bytes, tp, False)
    (logits, logits_sent), _ = pool.run(peak_and_bytes, tp, True)
    assert logits - fused >= tokens * -(-BIG_VOCAB // tp) * 4, (logits, fused)
    assert fused_sent == (tp - 1) * tokens * 4 * 4  # the statistics; the logits path gathers all of them
    assert logits_sent >= (tp - 1) / tp * tokens * BIG_VOCAB * 4


def logits_when_asked(rank, tp, group):
    model = tplayers.parallelize(tiny_llama(), group=group, training_logits=True)
    reference = tiny_llama()
    ids, labels = batch(0)
    out, ref = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert_close(out.logits, ref.logits)
    assert_close(out.loss, ref.loss)
    # fused: a tuple output keeps its places, the logits None; a deep copy is fused too
    fused = tplayers.parallelize(tiny_llama(), group=group)
    loss, logits = fused(input_ids=ids, labels=labels, return_dict=False)[:2]
    assert logits is None
    assert_close(loss, ref.loss)
    twin = copy.deepcopy(fused)
    out = twin(input_ids=ids, labels=labels)
    assert out.logits is None
    assert_close(out.loss, ref.loss)


@pytest.mark.multirank
def test_logits_when_asked_and_tuple_outputs(pool):
    pool.run(logits_when_asked, 2)


def test_which_forwards_are_fused():
    """A forward that only scores its logits with HF's loss is fused, also through a softcap or a
    logit scale (read as the steps the loss applies); a softcap configured off is no step; any other
    use of the logits, or a custom loss function, keeps the logits path."""
    import transformers as tf

    from tplayers.hf.fused_loss import read_forward
    from tplayers.nn.lm_head import ParallelLMHead

    def head_of(model):  # read_forward reads the head's type: a stand-in of the same shape
        head = object.__new__(ParallelLMHead)
        torch.nn.Module.__init__(head)
        model.lm_head = head
        return model

    small = dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=4)  # fmt: skip
    llama = head_of(tf.LlamaForCausalLM(tf.LlamaConfig(**small)))
    assert read_forward(llama, llama.lm_head).resolve(llama) == ()
    gemma2 = head_of(tf.Gemma2ForCausalLM(tf.Gemma2Config(**small, final_logit_softcapping=30.0)))
    assert read_forward(gemma2, gemma2.lm_head).resolve(gemma2) == (("div", 30.0), ("tanh", None), ("mul", 30.0))
    gemma2_off = head_of(tf.Gemma2ForCausalLM(tf.Gemma2Config(**small, final_logit_softcapping=None)))
    reading = read_forward(gemma2_off, gemma2_off.lm_head)
    assert reading.resolve(gemma2_off) == ()
    gemma2_off.config.final_logit_softcapping = 20.0  # the branch read as not taken now is: no longer fused
    assert reading.resolve(gemma2_off) is None
    cohere = head_of(tf.CohereForCausalLM(tf.CohereConfig(**small, logit_scale=0.25)))
    assert read_forward(cohere, cohere.lm_head).resolve(cohere) == (("mul", 0.25),)
    custom = head_of(tf.LlamaForCausalLM(tf.LlamaConfig(**small)))
    custom.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    assert "own loss_function" in unfused_because(custom, custom.lm_head)
    plain = tf.LlamaForCausalLM(tf.LlamaConfig(**small))  # an nn.Linear head: nothing to defer
    assert "not a vocabulary-parallel head" in unfused_because(plain, plain.lm_head)

    class Biased(tf.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            logits = self.lm_head(hidden)
            logits = logits + 1.0
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
            return tf.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)

    biased = head_of(Biased(tf.LlamaConfig(**small)))
    assert "does more with 'logits'" in unfused_because(biased, biased.lm_head)


def test_only_the_class_forward_defers():
    """accelerate's mixed-precision wrapping runs the class forward (the logits pass through);
    another forward set on the instance (TRL's fused LM head, a user's patch) gets logits."""
    import functools
    import types

    import transformers as tf
    from accelerate.utils import convert_outputs_to_fp32

    from tplayers.hf.fused_loss import _runs_class_forward

    small = dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**small))
    assert _runs_class_forward(model)
    wrapped = convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(type(model).forward))
    model.forward = types.MethodType(wrapped, model)  # as accelerate's prepare_model does
    assert _runs_class_forward(model)

    @functools.wraps(type(model).forward)  # as TRL's fused LM head wraps it
    def reads_logits(self, *args, **kwargs):
        return type(self).forward(self, *args, **kwargs).logits.log_softmax(-1)

    model.forward = types.MethodType(reads_logits, model)
    assert not _runs_class_forward(model)


def fused_on_grid_and_context(rank, world, group, where):
    """The loss without logits on a 2 x 2 grid (the head over the flattened grid) and at CP 2 x TP 2
    (each rank scores its own tokens, summed over the CP group): loss and every gradient equal to
    the unsharded model's, no logits in the training output."""
    from tplayers.testing.meshes import context_mesh

    model, reference = tiny_llama(), tiny_llama()
    ids, labels = batch(0)
    if where == "grid":
        tplayers.parallelize(model, group=tplayers.init_mesh(tp=(2, 2))["tp_r", "tp_c"], sequence_parallel=True)
        tp = None
    else:
        groups = context_mesh(1, 1, 2, 2)
        tp = groups["tp"]
        tplayers.parallelize(model, group=tp, context_group=groups["cp"], sequence_parallel=True)
    assert fused_loss.installed(model)
    out, ref = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    ref.loss.backward()
    assert_close(out.loss, ref.loss)
    grads = gather_grads(model, group=tp)
    for name, p in reference.named_parameters():
        assert_close(grads[name], p.grad, msg=lambda m, k=name: f"{where} grad of {k}: {m}")


@pytest.mark.multirank
def test_fused_loss_on_a_grid(pool):
    pool.run(fused_on_grid_and_context, 4, "grid")


@pytest.mark.multirank
def test_fused_loss_under_context_parallelism(pool):
    pool.run(fused_on_grid_and_context, 4, "context", mesh=("cp", 1, 1, 2, 2))


def scaled_logits_match(rank, tp, group, family):
    """Gemma 2's softcap (small, so tanh bends), Cohere's logit scale and Granite's logit division,
    fused: the loss and every gradient equal to the unsharded model's, no logits."""
    import transformers as tf

    small = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=4, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    if family == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**small, final_logit_softcapping=0.5, attn_logit_softcapping=None))
        steps = (("div", 0.5), ("tanh", None), ("mul", 0.5))
    elif family == "cohere":
        model, steps = tf.CohereForCausalLM(tf.CohereConfig(**small, logit_scale=0.25)), (("mul", 0.25),)
    else:
        model, steps = tf.GraniteForCausalLM(tf.GraniteConfig(**small, logits_scaling=3.0)), (("div", 3.0),)
    model.train()
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=group)
    assert fused_loss.installed(model)
    ids, labels = batch(0)
    out, ref = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert out.logits is None and model.lm_head.logit_transforms == ()  # disarmed after the forward
    out.loss.backward()
    ref.loss.backward()
    assert_close(out.loss, ref.loss)
    grads = gather_grads(model)
    for name, p in reference.named_parameters():
        assert_close(grads[name], p.grad, msg=lambda m, k=name: f"{family} grad of {k}: {m}")
    assert model.lm_head.forward_reading.resolve(model) == steps


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_softcapped_and_scaled_logits_are_fused(pool, family):
    pool.run(scaled_logits_match, 2, family)


def test_the_placeholder_refuses_what_it_was_not_told():
    """Deferred logits let through the steps the loss applies, in order, and refuse anything else
    by name: a forward that used them otherwise fails loudly, never computes from nothing."""
    from tplayers.nn.lm_head import _PENDING, DeferredLogitsError, ParallelLMHead, is_deferred

    head = object.__new__(ParallelLMHead)
    torch.nn.Module.__init__(head)
    head.in_features, head.out_features, head.sequence_parallel = 4, 7, False
    head.weight, head.bias = torch.nn.Parameter(torch.ones(7, 4)), None
    head.defer_logits, head.logit_transforms = True, (("div", 2.0), ("tanh", None))
    placeholder = head(torch.ones(2, 3, 4))
    assert is_deferred(placeholder) and placeholder.shape == (2, 3, 7)
    assert torch.tanh(placeholder / 2.0).float() is placeholder  # the expected steps: the placeholder itself
    with pytest.raises(DeferredLogitsError, match=r"add.*training_logits=True"):
        placeholder + 1
    other = head(torch.ones(2, 3, 4))
    with pytest.raises(DeferredLogitsError, match="training_logits=True"):
        other * 2.0  # not the step expected first
    with pytest.raises(ValueError, match="applied 0 of the 2 logit transforms"):
        ParallelLMHead.loss(head(torch.ones(2, 3, 4)), torch.zeros(2, 3, dtype=torch.long))
    del placeholder, other
    assert not _PENDING  # freed with the placeholders
