"""Encoder-decoder language models parallelized whole, no plan passed: T5 (its relative position
bias split with the heads; Flan-T5's gated MLP), mT5, UMT5, LongT5, BART and its kin (mBART, Marian,
Pegasus, M2M-100, NLLB-MoE), T5Gemma, a BERT encoder with a BERT decoder, and the speech-to-text
models on their text path. Compared here, independently of parallelize's own self-check: the loss
and every gradient of a training step with decoder inputs against the unsharded model, and greedy
generate(). Sequence parallelism is refused for them by name (their blocks are in two lists).
Fine-tuned the users' way too: `parallel_trainer(Seq2SeqTrainer)` and an accelerate loop."""

import copy
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

import tplayers
from tplayers.hf import gather_grads
from tplayers.testing import assert_close, grads_as_state_dict, tolerance
from tplayers.testing.meshes import layout_mesh
from tplayers.testing.tiny import tiny_config

sys.path.insert(0, str(Path(__file__).parent))
from test_newcomers import TINY, sharded_verdict  # noqa: E402
from test_vision import _no_dropout  # noqa: E402

pytestmark = pytest.mark.multirank


def seq2seq_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)


def tiny_seq2seq(model_type, heads, **overrides):
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tiny_config(model_type, heads=heads, **overrides)
        _no_dropout(cfg)
        torch.manual_seed(0)
        return tf.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING[type(cfg)](cfg)


def batch():
    """Source ids with their mask, and target ids as the decoder's inputs and the labels."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (2, 8), generator=generator)
    target = torch.randint(3, 100, (2, 8), generator=generator)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=target, labels=target)


def _step(model):
    loss = model.train()(**batch(), use_cache=False).loss
    loss.backward()
    return loss.detach()


def _verdict(model_type, tp, group):
    try:
        reference = tiny_seq2seq(model_type, 2 * tp)
        if sum(p.numel() for p in reference.parameters()) > TINY:
            return "not tiny", "its tiny config does not shrink the model"
        expected = _step(reference)
    except Exception as e:  # its tiny config or model does not build, or takes no text alone
        return "unbuilt", f"{type(e).__name__}: {str(e)[:200]}"
    return sharded_verdict(lambda: tiny_seq2seq(model_type, 2 * tp), _step, expected, grads_as_state_dict(reference),
                           group, False)  # fmt: skip


def sweep(rank, world, group, types):
    tp = layout_mesh(1, 1, world)["tp"]
    return {model_type: _verdict(model_type, world, tp) for model_type in types}


def test_every_seq2seq_type_is_exact_or_refused(pool):
    """At TP 2 (T5 at TP 3, its vocabulary and heads split unevenly: below; the image sweep runs
    Florence-2's BART, Pix2Struct's T5 and a BERT decoder at TP 4)."""
    tp, types = 2, seq2seq_types()
    results = pool.run(sweep, tp, types, mesh=(1, 1, tp), timeout_s=1200)
    verdicts = results[0]
    for other in results[1:]:
        assert {k: v[0] for k, v in other.items()} == {k: v[0] for k, v in verdicts.items()}, "ranks disagree"
    print(f"\nseq2seq sweep over {len(types)} types at TP {tp}: {dict(Counter(v[0] for v in verdicts.values()))}")
    for model_type, (verdict, detail) in sorted(verdicts.items()):
        print(f"  {model_type:28s} {verdict:10s} {detail[:160]}")
    assert not {k: v for k, v in verdicts.items() if v[0] in ("WRONG", "CRASH")}
    assert all("parallelize" in detail for verdict, detail in verdicts.values() if verdict == "refused")
    assert Counter(v[0] for v in verdicts.values())["exact"] >= 25  # T5, BART and their kin at least


# T5 as published: ReLU MLP, the LM head tied to the embeddings (its output scaled before it); Flan-T5 / T5
# v1.1: gated-GeLU MLP, untied; mT5; UMT5 (a relative position bias in every layer)
T5S = {
    "t5": ("t5", {}),
    "flan-t5": ("t5", dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "mt5": ("mt5", {}),
    "umt5": ("umt5", {}),
}


def matches_unsharded(rank, tp, group, name, heads):
    model_type, overrides = T5S[name]
    model = tiny_seq2seq(model_type, heads, **overrides)
    reference = copy.deepcopy(model)
    tplayers.parallelize(model, group=group)  # its self-check on
    got, want = model.train()(**batch()), reference.train()(**batch())
    assert_close(got.loss, want.loss)
    got.loss.backward()
    want.loss.backward()
    grads = gather_grads(model)
    expected = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False) if p.grad is not None}
    assert sorted(grads) == sorted(expected)
    assert any("relative_attention_bias" in n for n in expected)  # the bias trained too
    for n, grad in expected.items():
        assert_close(grads[n], grad, msg=n)
    prompt = {k: batch()[k] for k in ("input_ids", "attention_mask")}
    kwargs = dict(max_new_tokens=5, do_sample=False, decoder_start_token_id=0)  # T5 starts from its pad id
    assert torch.equal(model.eval().generate(**prompt, **kwargs), reference.eval().generate(**prompt, **kwargs))


@pytest.mark.parametrize("tp, heads", [(2, 4), (3, 4)], ids=["tp2", "tp3-uneven-heads"])
@pytest.mark.parametrize("name", T5S)
def test_t5_is_exact_and_generates(pool, name, tp, heads):
    """Logits' loss, every gradient (the relative position bias split with its heads: 4 heads at TP 3
    are 2, 1 and 1) and greedy generate() against the unsharded model."""
    pool.run(matches_unsharded, tp, name, heads)


def bias_heads_swapped(rank, tp, group):
    """Each rank's two heads of the relative position bias in the other order: the loss no longer
    matches (what the comparison above would catch of a bias split out of step with its heads)."""
    model, reference = tiny_seq2seq("t5", 4), tiny_seq2seq("t5", 4)
    tplayers.parallelize(model, group=group, verify=False)
    bias = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    with torch.no_grad():
        bias.copy_(bias.flip(1))
    got, want = model.train()(**batch()).loss, reference.train()(**batch()).loss
    return torch.allclose(got, want, **tolerance(want.dtype))  # the table assert_close uses


def test_negative_control_a_bias_out_of_step_with_its_heads_differs(pool):
    assert pool.run(bias_heads_swapped, 2) == [False, False]


def sequence_parallel_refused(rank, tp, group):
    with pytest.raises(ValueError, match="T5ForConditionalGeneration's blocks are in 2 lists"):
        tplayers.parallelize(tiny_seq2seq("t5", 4), group=group, sequence_parallel=True)


def test_sequence_parallelism_is_refused_by_name(pool):
    pool.run(sequence_parallel_refused, 2)


# -- fine-tuned the users' way: Seq2SeqTrainer generating in its evaluation, and an accelerate loop --------
# Rows of different lengths padded by DataCollatorForSeq2Seq (labels with -100), the decoder's inputs
# made by the model from the labels, as a summarization or translation script does.
def seq2seq_model():
    model = tiny_seq2seq("t5", 4)
    # T5 starts from its pad id (a checkpoint's config says so; the default config class does not)
    model.config.decoder_start_token_id = model.generation_config.decoder_start_token_id = model.config.pad_token_id
    return model


def summaries(n, seed):
    """Sources and targets of 3-9 tokens each, ending with the end-of-sequence id, as a tokenizer makes them."""
    g = torch.Generator().manual_seed(seed)
    eos = seq2seq_model().config.eos_token_id
    lengths = torch.randint(3, 10, (n, 2), generator=g).tolist()
    return [{"input_ids": torch.randint(3, 100, (s,), generator=g).tolist() + [eos],
             "labels": torch.randint(3, 100, (t,), generator=g).tolist() + [eos]} for s, t in lengths]  # fmt: skip


def collator(model):
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerFast

    cfg = model.config
    special = {"<pad>": cfg.pad_token_id, "</s>": cfg.eos_token_id}
    vocab = {f"t{i}": i for i in range(cfg.vocab_size) if i not in special.values()} | special
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t3")),
                                        pad_token="<pad>", eos_token="</s>", unk_token="t3")  # fmt: skip
    return DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)


def seq2seq_trainer(trainer_class, model, out):
    """SGD: the weights after compare within the table (Adam divides by each gradient's own size, so a
    gradient near zero moves its weight by up to the learning rate whatever its rounding)."""
    import transformers as tf

    args = tf.Seq2SeqTrainingArguments(output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=3,
                                       gradient_accumulation_steps=2, max_steps=3, max_grad_norm=1.0, optim="sgd",
                                       learning_rate=0.1, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                                       use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                                       predict_with_generate=True, generation_max_length=8)  # fmt: skip
    trainer = trainer_class(model=model, args=args, train_dataset=summaries(16, 1), data_collator=collator(model))
    trainer.train()
    logged = [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    evaluated = trainer.evaluate(summaries(5, 2))
    predicted = torch.as_tensor(trainer.predict(summaries(5, 2)).predictions)
    return logged, evaluated["eval_loss"], predicted


def accelerate_steps(model, prepare):
    from accelerate import Accelerator

    accelerator = Accelerator()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    loader = torch.utils.data.DataLoader(summaries(12, 3), batch_size=4, shuffle=True, collate_fn=collator(model))
    model, opt, loader = prepare(accelerator, model, opt, loader)
    out = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out.append((loss.item(), float(norm)))
    return out


def fine_tuned_at_tp2(rank, world, root):
    tp = tplayers.init_mesh(tp=2)["tp"]
    model = tplayers.parallelize(seq2seq_model(), group=tp)
    trained = seq2seq_trainer(tplayers.hf.parallel_trainer(__import__("transformers").Seq2SeqTrainer), model, root)
    weights = {k: v.detach().clone() for k, v in tplayers.gather_state_dict(model).items()}
    return trained, weights, accelerate_steps(tplayers.parallelize(seq2seq_model(), group=tp), tplayers.hf.prepare)


def test_seq2seq_trainer_and_accelerate_fine_tune_as_unsharded(tmp_path):
    """T5 at TP 2 through `parallel_trainer(Seq2SeqTrainer)` (every logged loss and gradient norm, the
    evaluation loss, the generated predictions, the weights after) and a plain accelerate loop with
    clipping, against the same scripts run unsharded here."""
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = seq2seq_model()
        want, want_eval, want_predicted = seq2seq_trainer(tf.Seq2SeqTrainer, reference, str(tmp_path / "ref"))
        want_steps = accelerate_steps(seq2seq_model(), lambda accelerator, *objects: accelerator.prepare(*objects))
    (got, got_eval, got_predicted), weights, steps = tplayers.launch(fine_tuned_at_tp2, 2, str(tmp_path / "tp2"),
                                                                      timeout=600)[0]  # fmt: skip
    assert [s for s, _, _ in got] == [s for s, _, _ in want] == [1, 2, 3]
    for (step, loss, norm), (_, loss_r, norm_r) in zip(got, want, strict=True):
        assert loss == pytest.approx(loss_r, abs=1e-5) and norm == pytest.approx(norm_r, abs=1e-5), step
    assert got_eval == pytest.approx(want_eval, abs=1e-5)
    assert torch.equal(got_predicted, want_predicted), (
        got_predicted.shape,
        want_predicted.shape,
        (got_predicted != want_predicted).nonzero().tolist(),
        got_predicted.tolist(),
        want_predicted.tolist(),
    )
    assert sorted(weights) == sorted(reference.state_dict())
    for name, value in reference.state_dict().items():
        assert_close(weights[name], value, msg=name)
    assert len(steps) == len(want_steps) == 3
    for (loss, norm), (loss_r, norm_r) in zip(steps, want_steps, strict=True):
        assert loss == pytest.approx(loss_r, abs=1e-5) and norm == pytest.approx(norm_r, abs=1e-5)
