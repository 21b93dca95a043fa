"""HF Trainer, TRL's SFTTrainer and an accelerate loop on parallelized models (`tplayers.hf.Trainer`,
`parallel_trainer`, `prepare`), each against the same script run unsharded in one process (same
seed and rows): 5 steps of gradient accumulation 2 with `max_grad_norm`, then an evaluation.

The parallel runs are real distributed runs (`tplayers.launch`, which sets torchrun's variables,
so accelerate sees a multi-process run as under torchrun): one world of 2 ranks runs every TP 2
case in sequence, one of 4 the TP 2 x DP 2 cases; the unsharded references run here. One module
fixture runs them all once (starting ranks that import transformers' Trainer costs seconds each),
and each test reads its part.
"""

import math
import warnings

import pytest
import torch

import tplayers
from tplayers.tolerances import tolerance

pytestmark = pytest.mark.multirank

VOCAB, SEQ, ROWS, EVAL_ROWS = 96, 11, 40, 10  # 11 tokens: split 6, 5 under sequence parallelism
LOSS_ATOL = 1e-5  # the bound on every logged loss and grad_norm


# ---- the script, shared by the unsharded and the parallel runs ----


def model(lora=False):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=VOCAB - 1, eos_token_id=VOCAB - 2)  # fmt: skip
    m = tf.LlamaForCausalLM(cfg)
    if lora:
        import peft

        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0)
        m = peft.get_peft_model(m, cfg)
        for name, p in m.named_parameters():  # peft zeroes B: make the adapters matter from step 1
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    return m


def rows(n, seed):
    ids = torch.randint(0, VOCAB - 2, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": r, "labels": r.clone(), "attention_mask": torch.ones_like(r)} for r in ids]


def arguments(out, batch, config_class=None, **overrides):
    import transformers as tf

    kw = dict(output_dir=out, per_device_train_batch_size=batch, per_device_eval_batch_size=2,
              gradient_accumulation_steps=2, max_steps=5, max_grad_norm=1.0, learning_rate=1e-3, logging_steps=1,
              save_strategy="steps", save_steps=3, report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
              dataloader_num_workers=0, lr_scheduler_type="linear")  # fmt: skip
    kw.update(overrides)
    return (config_class or tf.TrainingArguments)(**kw)


def history(trainer):
    """Each optimizer step's logged loss, grad_norm and learning rate."""
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return [(h["step"], h["loss"], h["grad_norm"], h["learning_rate"]) for h in logged]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<eos>": VOCAB - 2, "<pad>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="t0")


def train(trainer_class, m, out, batch, **overrides):
    """Train, evaluate and predict; what the tests compare."""
    trainer = trainer_class(model=m, args=arguments(out, batch, **overrides), train_dataset=rows(ROWS, 1),
                            eval_dataset=rows(EVAL_ROWS, 2))  # fmt: skip
    trainer.train()
    result = {"history": history(trainer), "eval_loss": trainer.evaluate()["eval_loss"]}
    result["predictions"] = torch.as_tensor(trainer.predict(rows(EVAL_ROWS, 2)).predictions)
    return trainer, result


def predicted_by_unsharded(weights, lora=False):
    """The logits the unsharded model with `weights` gives the evaluation rows."""
    m = model(lora=lora)
    m.load_state_dict(weights)
    with torch.no_grad():
        return m(torch.stack([r["input_ids"] for r in rows(EVAL_ROWS, 2)])).logits


def sft(trainer_class, m, out, batch):
    import datasets
    from trl import SFTConfig

    data = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows(ROWS, 1)]})
    args = arguments(out, batch, SFTConfig, save_strategy="no", max_length=SEQ, bf16=False)
    trainer = trainer_class(model=m, args=args, train_dataset=data, processing_class=tokenizer())
    trainer.train()
    return history(trainer)


def dpo(trainer_class, m, out):
    """TRL's DPOTrainer on a LoRA model (the reference: the same model with its adapters off), 3 steps."""
    import datasets
    from trl import DPOConfig

    g = torch.Generator().manual_seed(3)
    words = lambda n: " ".join(f"t{int(i)}" for i in torch.randint(0, VOCAB - 2, (n,), generator=g))
    data = datasets.Dataset.from_dict({key: [words(4 if key == "prompt" else 3) for _ in range(16)]
                                       for key in ("prompt", "chosen", "rejected")})  # fmt: skip
    args = arguments(out, 2, DPOConfig, save_strategy="no", bf16=False, max_length=16, max_steps=3)
    trainer = trainer_class(model=m, args=args, train_dataset=data, processing_class=tokenizer())
    trainer.train()
    return history(trainer)


def grpo(m, out):
    """TRL's GRPOTrainer on a parallelized model: it seeds each process apart, to sample different completions."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    prompts = datasets.Dataset.from_list([{"prompt": "t1 t2 t3"}] * 8)
    args = arguments(out, 2, GRPOConfig, num_generations=2, max_completion_length=4)
    reward = lambda completions, **_: [float(len(c)) for c in completions]  # noqa: E731
    tplayers.hf.parallel_trainer(GRPOTrainer)(model=m, reward_funcs=reward, args=args, train_dataset=prompts,
                                              processing_class=tokenizer())  # fmt: skip


def accelerate_loop(m, prepare, state=None):
    """A plain accelerate loop: 3 steps of batch 4 with clipping and a scheduler; with `state`,
    saved there by `accelerator.save_state` and loaded back into a fresh model, whose weights
    are returned too."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    torch.manual_seed(1)
    loader = torch.utils.data.DataLoader(rows(ROWS, 1), batch_size=4, shuffle=True)
    m, opt, loader, sched = prepare(accelerator, m, opt, loader, sched)
    out = []
    for step, batch in enumerate(loader):
        loss = m(**batch).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append((loss.item(), float(norm), sched.get_last_lr()[0]))
        if step == 2:
            break
    if state is None:
        return out
    whole = accelerator.get_state_dict(m)  # what users hand save_pretrained(state_dict=...)
    assert all(whole[k].equal(v) for k, v in full_weights(m).items()) and len(whole) == len(full_weights(m))
    accelerator.save_state(state)
    again = Accelerator()
    fresh = tplayers.parallelize(model(), group=tplayers.get_placement(next(m.parameters())).group)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda step: 1.0 / (1 + step))
    fresh, fresh_opt, fresh_sched = prepare(again, fresh, fresh_opt, fresh_sched)
    again.load_state(state)
    same = fresh_opt.optimizer.state_dict()["state"][0]["exp_avg"].equal(
        opt.optimizer.state_dict()["state"][0]["exp_avg"]
    )
    return out, full_weights(m), full_weights(fresh), same, fresh_sched.get_last_lr()[0]


def probe():
    return torch.randint(0, VOCAB - 2, (2, SEQ), generator=torch.Generator().manual_seed(7))


def full_weights(m):
    return {k: v.detach().clone() for k, v in tplayers.gather_state_dict(m).items()}


# ---- the parallel runs ----


def world_of_two(rank, world, root):
    import transformers as tf
    from trl import DPOTrainer, SFTTrainer

    mesh = tplayers.init_mesh(tp=2)
    out = {}

    m = tplayers.parallelize(model(), group=mesh["tp"])
    trainer, out["tp"] = train(tplayers.hf.Trainer, m, f"{root}/tp", 2)
    out["tp"]["weights"] = full_weights(m)
    trainer.save_model(f"{root}/tp-final")
    out["tp"]["probe_logits"] = m(probe()).logits.detach()

    m = tplayers.parallelize(model(), group=mesh["tp"])
    trainer = tplayers.hf.Trainer(model=m, args=arguments(f"{root}/tp", 2), train_dataset=rows(ROWS, 1))
    trainer.train(resume_from_checkpoint=f"{root}/tp/checkpoint-3")
    out["resumed"] = {"history": history(trainer), "weights": full_weights(m)}

    m = tplayers.parallelize(model(), group=mesh["tp"], sequence_parallel=True)
    _, out["sp"] = train(tplayers.hf.Trainer, m, f"{root}/sp", 2)
    out["sp"]["weights"] = full_weights(m)

    m = tplayers.parallelize(model(), group=mesh["tp"])
    _, out["bf16"] = train(tplayers.hf.Trainer, m, f"{root}/bf16", 2, bf16=True)

    m = tplayers.parallelize(model(lora=True), group=mesh["tp"])
    trainer, out["lora"] = train(tplayers.hf.Trainer, m, f"{root}/lora", 2)
    out["lora"]["weights"] = full_weights(m)
    trainer.save_model(f"{root}/lora-final")
    out["lora"]["probe_logits"] = m(probe()).logits.detach()

    m = tplayers.parallelize(model(lora=True), group=mesh["tp"])
    out["sft"] = sft(tplayers.hf.parallel_trainer(SFTTrainer), m, f"{root}/sft", 2)

    m = tplayers.parallelize(model(lora=True), group=mesh["tp"])
    out["dpo"] = dpo(tplayers.hf.parallel_trainer(DPOTrainer), m, f"{root}/dpo")

    cp = tplayers.init_mesh(cp=2, tp=1)  # the sequence split over both ranks: one replica
    m = tplayers.parallelize(model(), group=cp["tp"], context_group=cp["cp"])
    _, out["cp"] = train(tplayers.hf.Trainer, m, f"{root}/cp", 2)
    out["cp"]["weights"] = full_weights(m)
    out["accelerate_cp"] = accelerate_loop(
        tplayers.parallelize(model(), group=cp["tp"], context_group=cp["cp"]), tplayers.hf.prepare
    )

    out["accelerate"], *out["accelerate_state"] = accelerate_loop(
        tplayers.parallelize(model(), group=mesh["tp"]), tplayers.hf.prepare, state=f"{root}/accelerate-state"
    )

    refusals = out["refusals"] = {}
    m = tplayers.parallelize(model(), group=mesh["tp"])
    for case, call in {
        "save_pretrained": lambda: m.save_pretrained(f"{root}/own-save"),
        "plain_accelerator": lambda: __import__("accelerate").Accelerator().prepare(m),
        "peft_config": lambda: tplayers.hf.parallel_trainer(SFTTrainer)(
            model=m, args=arguments(f"{root}/peft", 2), peft_config=__import__("peft").LoraConfig()
        ),
        "grpo": lambda: grpo(m, f"{root}/grpo"),
        "torch_compile": lambda: tplayers.hf.Trainer(
            model=m, args=arguments(f"{root}/compiled", 2, torch_compile=True), train_dataset=rows(ROWS, 1)
        ).train(),
    }.items():
        try:
            call()
            refusals[case] = None
        except ValueError as e:
            refusals[case] = str(e)
    plain = tf.Trainer(model=m, args=arguments(f"{root}/plain", 2), train_dataset=rows(ROWS, 1))
    try:
        plain.train()
        out["plain"] = None
    except ValueError as e:
        out["plain"] = str(e)
    return out if rank == 0 else None


def world_of_four(rank, world, root):
    mesh = tplayers.init_mesh(dp=2, tp=2)
    out = {}

    m = tplayers.parallelize(model(), group=mesh["tp"])
    tplayers.data_parallel(m, group=mesh["dp"], zero_stage=3)
    _, out["zero3"] = train(tplayers.hf.Trainer, m, f"{root}/zero3", 1)
    out["zero3"]["weights"] = full_weights(m)

    m = tplayers.parallelize(model(), group=mesh["tp"])
    tplayers.data_parallel(m, group=mesh["dp"], zero_stage=1)
    trainer = tplayers.hf.Trainer(model=m, args=arguments(f"{root}/zero1", 1), train_dataset=rows(ROWS, 1))
    trainer.train()
    out["zero1"] = {
        "history": history(trainer),
        "weights": full_weights(m),
        "optimizer": type(trainer.optimizer.optimizer).__name__,
    }

    cp = tplayers.init_mesh(dp=2, cp=2, tp=1)  # two replicas, each sequence split over two ranks
    m = tplayers.parallelize(model(), group=cp["tp"], context_group=cp["cp"])
    tplayers.data_parallel(m, group=cp["dp"], zero_stage=2)
    _, out["cp_dp"] = train(tplayers.hf.Trainer, m, f"{root}/cp_dp", 1)
    out["cp_dp"]["weights"] = full_weights(m)

    grid = tplayers.init_mesh(tp=(2, 2))  # a 2-D tensor-parallel grid over the 4 ranks: one replica
    m = tplayers.parallelize(model(), group=grid["tp_r", "tp_c"])
    _, out["grid"] = train(tplayers.hf.Trainer, m, f"{root}/grid", 2)
    out["grid"]["weights"] = full_weights(m)

    sent = out["dp_bytes"] = {}  # one optimizer step at each accumulation count: the replicas reduce once
    for accumulation in (1, 2):
        m = tplayers.parallelize(model(), group=mesh["tp"])
        tplayers.data_parallel(m, group=mesh["dp"], zero_stage=0)
        args = arguments(f"{root}/bytes", 1, gradient_accumulation_steps=accumulation, max_steps=1, save_strategy="no")
        with tplayers.count_bytes() as counted:
            tplayers.hf.Trainer(model=m, args=args, train_dataset=rows(ROWS, 1)).train()
        sent[accumulation] = counted.by_axis()["dp"]

    m = tplayers.parallelize(model(), group=mesh["tp"])  # TP 2's checkpoint-3, resumed at TP 2 x DP 2
    tplayers.data_parallel(m, group=mesh["dp"], zero_stage=0)
    try:  # TP 2 at a world of 4 without tplayers.data_parallel: two replicas nothing averages
        tplayers.hf.Trainer(model=tplayers.parallelize(model(), group=mesh["tp"]), args=arguments(f"{root}/x", 1))
        out["no_data_parallel"] = None
    except ValueError as e:
        out["no_data_parallel"] = str(e)
    trainer = tplayers.hf.Trainer(model=m, args=arguments(f"{root}/tp", 1), train_dataset=rows(ROWS, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no RNG file for ranks 2-3: the Trainer warns
        trainer.train(resume_from_checkpoint=f"{root}/tp/checkpoint-3")
    out["resumed"] = {"history": history(trainer), "weights": full_weights(m)}
    return out if rank == 0 else None


# ---- the runs, once ----


def unsharded(root):
    import transformers as tf
    from trl import DPOTrainer, SFTTrainer

    out = {}
    m = model()
    _, out["full"] = train(tf.Trainer, m, f"{root}/ref", 2)
    out["full"]["weights"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    _, out["bf16"] = train(tf.Trainer, model(), f"{root}/ref-bf16", 2, bf16=True)
    m = model(lora=True)
    _, out["lora"] = train(tf.Trainer, m, f"{root}/ref-lora", 2)
    out["lora"]["weights"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    out["sft"] = sft(SFTTrainer, model(lora=True), f"{root}/ref-sft", 2)
    out["dpo"] = dpo(DPOTrainer, model(lora=True), f"{root}/ref-dpo")
    out["accelerate"] = accelerate_loop(model(), lambda acc, *objects: acc.prepare(*objects))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trainer"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = unsharded(root)
    two = tplayers.launch(world_of_two, 2, root, timeout=600)[0]
    four = tplayers.launch(world_of_four, 4, root, timeout=600)[0]
    return {"root": root, "reference": reference, "two": two, "four": four}


# ---- comparisons ----


def same_history(got, want, atol=LOSS_ATOL):
    """Every step's loss and grad_norm within `atol`, the same steps and learning rates."""
    assert [h[0] for h in got] == [h[0] for h in want], f"steps {[h[0] for h in got]} != {[h[0] for h in want]}"
    for (step, loss, norm, lr), (_, loss_r, norm_r, lr_r) in zip(got, want, strict=True):
        assert abs(loss - loss_r) <= atol, f"step {step}: loss {loss} != {loss_r}"
        assert abs(norm - norm_r) <= atol, f"step {step}: grad_norm {norm} != {norm_r}"
        assert math.isclose(lr, lr_r, rel_tol=1e-9), f"step {step}: learning rate {lr} != {lr_r}"


def same_weights(got, want, exact=False):
    assert sorted(got) == sorted(want)
    bound = tolerance(torch.float32, exact=exact)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **bound, msg=lambda m, name=name: f"{name}: {m}")


def test_negative_control_the_comparisons_catch_a_difference(runs):
    want = runs["reference"]["full"]["history"]
    off = [(s, loss + (3e-5 if s == 4 else 0), n, lr) for s, loss, n, lr in want]
    with pytest.raises(AssertionError, match="step 4: loss"):
        same_history(off, want)
    with pytest.raises(AssertionError, match="grad_norm"):
        same_history([(s, loss, n * 1.001, lr) for s, loss, n, lr in want], want)
    weights = dict(runs["reference"]["full"]["weights"])
    name = next(iter(weights))
    with pytest.raises(AssertionError):
        same_weights({**weights, name: weights[name] + 1e-3}, weights)


@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_tensor_parallel_trains_as_unsharded(runs, layout):
    got, want = runs["two"][layout], runs["reference"]["full"]
    same_history(got["history"], want["history"])
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=LOSS_ATOL)
    same_weights(got["weights"], want["weights"])
    # predict: the logits of the model it trained (5 steps of Adam move the two runs' weights apart within
    # the table, and their logits by a little more)
    torch.testing.assert_close(got["predictions"], predicted_by_unsharded(got["weights"]), **tolerance(torch.float32))


def test_bf16_autocast_follows_the_unsharded_run_within_bf16s_tolerance(runs):
    """`bf16=True`: the Trainer's autocast reaches the tensor-parallel GEMMs as it reaches nn.Linear."""
    got, want = runs["two"]["bf16"], runs["reference"]["bf16"]
    bound = tolerance(torch.bfloat16)
    for (step, loss, norm, _), (_, loss_r, norm_r, _) in zip(got["history"], want["history"], strict=True):
        assert loss == pytest.approx(loss_r, rel=bound["rtol"], abs=bound["atol"]), step
        assert norm == pytest.approx(norm_r, rel=bound["rtol"], abs=bound["atol"]), step
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=bound["rtol"], abs=bound["atol"])


def test_tensor_and_data_parallel_zero3_trains_as_unsharded(runs):
    got, want = runs["four"]["zero3"], runs["reference"]["full"]
    same_history(got["history"], want["history"])
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=LOSS_ATOL)  # 10 rows over 2 replicas: a tail
    same_weights(got["weights"], want["weights"])
    torch.testing.assert_close(got["predictions"], predicted_by_unsharded(got["weights"]), **tolerance(torch.float32))


@pytest.mark.parametrize("world, run", [("two", "cp"), ("four", "cp_dp")], ids=["cp2", "dp2-cp2-zero2"])
def test_context_parallel_trains_as_unsharded(runs, world, run):
    """The Trainer gives every rank of a context-parallel group the same rows (each splits their
    sequence), the replicas their own; the loss, its token count and the clipped norm as unsharded."""
    got, want = runs[world][run], runs["reference"]["full"]
    same_history(got["history"], want["history"])
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=LOSS_ATOL)
    same_weights(got["weights"], want["weights"])
    torch.testing.assert_close(got["predictions"], predicted_by_unsharded(got["weights"]), **tolerance(torch.float32))


def test_a_two_dimensional_grid_trains_as_unsharded(runs):
    got, want = runs["four"]["grid"], runs["reference"]["full"]
    same_history(got["history"], want["history"])
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=LOSS_ATOL)
    same_weights(got["weights"], want["weights"])


def test_tensor_and_data_parallel_zero1_shards_the_trainers_optimizer(runs):
    got, want = runs["four"]["zero1"], runs["reference"]["full"]
    assert got["optimizer"] == "ZeroRedundancyOptimizer"
    same_history(got["history"], want["history"])
    same_weights(got["weights"], want["weights"])


def test_gradient_accumulation_reduces_over_the_replicas_once_per_step(runs):
    sent = runs["four"]["dp_bytes"]
    assert sent[1] > 0 and sent[2] == sent[1]


def test_lora_trains_as_unsharded_and_saves_a_peft_adapter(runs):
    got, want = runs["two"]["lora"], runs["reference"]["lora"]
    same_history(got["history"], want["history"])
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=LOSS_ATOL)
    same_weights(got["weights"], want["weights"])
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = model()
        loaded = peft.PeftModel.from_pretrained(base, f"{runs['root']}/lora-final")
    torch.testing.assert_close(loaded(probe()).logits, got["probe_logits"], **tolerance(torch.float32))


def test_save_model_writes_a_checkpoint_from_pretrained_loads(runs):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(f"{runs['root']}/tp-final")
    got = runs["two"]["tp"]
    torch.testing.assert_close(loaded(probe()).logits, got["probe_logits"], **tolerance(torch.float32))


def test_resume_at_the_same_layout_is_bit_identical(runs):
    first, resumed = runs["two"]["tp"], runs["two"]["resumed"]
    assert resumed["history"] == first["history"]  # steps 1-3 from the checkpoint's state, 4-5 trained again
    same_weights(resumed["weights"], first["weights"], exact=True)


def test_resume_at_another_layout_within_tolerance(runs):
    first, resumed = runs["two"]["tp"], runs["four"]["resumed"]
    same_history(resumed["history"], first["history"])
    same_weights(resumed["weights"], first["weights"])


def test_trl_sft_trainer_with_lora_trains_as_unsharded(runs):
    same_history(runs["two"]["sft"], runs["reference"]["sft"])


def test_trl_dpo_trainer_with_lora_trains_as_unsharded(runs):
    """DPO's log-probabilities under the policy and the reference (adapters off) both come from the
    whole logits: the preference loss and its gradient norm equal the unsharded run's."""
    same_history(runs["two"]["dpo"], runs["reference"]["dpo"])


@pytest.mark.parametrize("run", ["accelerate", "accelerate_cp"], ids=["tp2", "cp2"])
def test_accelerate_loop_trains_as_unsharded(runs, run):
    got, want = runs["two"][run], runs["reference"]["accelerate"]
    assert len(got) == len(want) == 3
    for (loss, norm, lr), (loss_r, norm_r, lr_r) in zip(got, want, strict=True):
        assert loss == pytest.approx(loss_r, abs=LOSS_ATOL) and norm == pytest.approx(norm_r, abs=LOSS_ATOL)
        assert lr == lr_r  # stepped once per optimizer step, not once per rank


def test_accelerate_save_state_load_state_round_trip(runs):
    weights, loaded, same_optimizer_state, lr = runs["two"]["accelerate_state"]
    same_weights(loaded, weights, exact=True)
    assert same_optimizer_state
    assert lr == runs["two"]["accelerate"][-1][2]


def test_plain_trainer_on_a_parallelized_model_raises(runs):
    message = runs["two"]["plain"]
    assert message is not None, "a plain transformers.Trainer trained a parallelized model"
    assert "tplayers.hf.Trainer" in message and "parallel_trainer" in message


def test_misuse_is_refused_by_name(runs):
    refusals = runs["two"]["refusals"]
    assert refusals["plain_accelerator"] is not None and "tplayers.hf.prepare" in refusals["plain_accelerator"]
    assert refusals["peft_config"] is not None and "tplayers.get_peft_model" in refusals["peft_config"]
    # the ranks of a tensor-parallel group would sample different completions from the logits they share
    assert refusals["grpo"] is not None and "ParallelGRPOTrainer seeds each process apart" in refusals["grpo"]
    assert refusals["torch_compile"] is not None and "torch.compile" in refusals["torch_compile"]
    assert (
        refusals["save_pretrained"] is not None
        and "tplayers.save_pretrained(model, path)" in refusals["save_pretrained"]
    )
    message = runs["four"]["no_data_parallel"]
    assert message is not None and "tplayers.data_parallel(model, group=mesh['dp']" in message


def test_fp16_grad_scaler_becomes_a_loss_scaler_every_rank_agrees_with():
    from tplayers.loops.accelerate import _scaler

    torch_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25,
                                        growth_interval=7)  # fmt: skip
    scaler = _scaler(torch_scaler)
    assert isinstance(scaler, tplayers.DynamicLossScaler)
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor()) == (1024.0, 3.0, 0.25)
    assert scaler.get_growth_interval() == 7
    assert _scaler(None) is None and _scaler(scaler) is scaler


def test_the_save_pretrained_guard_keeps_no_model_alive():
    """The guard lives in the model's own __dict__: held weakly, a dropped model is freed at once (a
    reference cycle would keep every parallelized model of a process alive until the collector runs)."""
    import copy
    import gc
    import weakref

    from tplayers.hf import model_methods

    m = model()
    model_methods.install(m)
    assert copy.deepcopy(m).save_pretrained._model() is not m  # a copy's guard is the copy's
    with pytest.raises(ValueError, match="tplayers.save_pretrained"):
        m.save_pretrained("unused")
    alive = weakref.ref(m)
    gc.disable()
    try:
        del m
        assert alive() is None
    finally:
        gc.enable()
