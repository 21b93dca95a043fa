"""Vision-language models parallelized whole, no plan passed: the vision tower split by heads and
features like the text layers, the projector as a column / row pair, the language model as
always; sequence parallelism cuts the language model's sequence only, after the image features
are merged into it. Compared here, independently of parallelize's own self-check, with images in
the batch: logits, loss and every gradient against the unsharded model, and greedy generate()
from an image prompt. The self-check itself sees images: a wrongly sharded tower fails it."""

import copy
import inspect
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

import tplayers
from tplayers.hf import gather_grads, vision
from tplayers.hf.verify import PROBE_BATCH, PROBE_TOKENS_PER_RANK
from tplayers.testing import assert_close
from tplayers.testing.meshes import layout_mesh
from tplayers.testing.pool import RemoteError
from tplayers.testing.shards import grads_as_state_dict
from tplayers.testing.tiny import tiny_config

sys.path.insert(0, str(Path(__file__).parent))
from test_families import kv_swapped  # noqa: E402
from test_newcomers import REFUSALS, computed_once, sharded_verdict  # noqa: E402

pytestmark = pytest.mark.multirank

# vision tower / projector of each: CLIP + linear pair; Pixtral + patch merger + linear pair; SigLIP +
# one linear; SigLIP + average pooling and a projection matrix; Qwen's windowed ViT (fused qkv, gated
# MLP, patch merger) and multimodal rope; Qwen3-VL's ViT with deepstack mergers; InternViT (q / k norms
# over every head) + layer norm and linear pair; SigLIP + pixel shuffle and one linear, images stacked
# per row with a pixel mask; SigLIP + linear pair over any-resolution tiles; Llama 4's ViT (2-D rope,
# pixel shuffle, its own MLP adapter) + one linear, with a mixture-of-experts language model; GLM-4V's
# ViT + a merger holding a projection and a norm before its gated MLP
VLMS = ("llava", "mistral3", "paligemma", "gemma3", "qwen2_5_vl", "qwen3_vl", "internvl", "smolvlm", "llava_onevision",
        "llama4", "glm4v")  # fmt: skip


def mend_llama4_output():
    """transformers 5.24's Llama 4 reads `image_outputs` from its language model's output, which has
    no such field, so every forward fails, unsharded too (5.23 and before did not). Give that output
    class the field, as None, while that release is installed: the same for the reference and the
    sharded model."""
    import inspect

    from transformers import modeling_outputs
    from transformers.models.llama4 import modeling_llama4

    if "outputs.image_outputs" in inspect.getsource(modeling_llama4.Llama4ForConditionalGeneration.forward):
        modeling_outputs.MoeCausalLMOutputWithPast.image_outputs = None


def tiny_vlm(model_type, tp, **overrides):
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tiny_config(model_type, heads=2 * tp, **overrides)
        if model_type == "llama4":
            mend_llama4_output()
        if "output_router_logits" in vars(cfg):  # MoE auxiliary losses on
            cfg.output_router_logits = True
        _no_dropout(cfg)
        torch.manual_seed(0)
        model = tf.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(cfg)](cfg)
    for name, p in model.named_parameters():
        # Gemma 3's projection matrix starts at zero: zero image embeddings make the first norms'
        # gradients 1/sqrt(eps) large, where fp32 summation order alone exceeds any tolerance. A
        # checkpoint's is not zero. BLIP-2's query tokens too.
        if name.endswith(("mm_input_projection_weight", "query_tokens")):
            torch.nn.init.normal_(p, std=0.02)
    return model.eval()


def _no_dropout(config):
    """Every dropout rate (and router jitter) of the config and its sub-configs 0 (BLIP-2's Q-Former and OPT default to
    0.1): a training step compared exactly draws no masks (tests/test_dropout.py covers dropout)."""
    from transformers import PretrainedConfig

    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            _no_dropout(value)
        elif type(value) is float and any(n in key for n in ("dropout", "pdrop", "drop_path", "jitter")):
            setattr(config, key, 0.0)


def image_batch(model, tp):
    """Token ids with each row's image tokens first, and the images: what the self-check probes with."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (PROBE_BATCH, PROBE_TOKENS_PER_RANK * tp), generator=generator)
    return vision.probe_images(model, ids, tp)


def first_image(images):
    """The first row's image: Qwen-VL's patches of all images are one flat tensor, cut by the grid."""
    first = {k: v[:1] for k, v in images.items()}
    if "image_grid_thw" in images:
        first["pixel_values"] = images["pixel_values"][: int(images["image_grid_thw"][0].prod())]
    return first


def matches_unsharded(rank, tp, group, model_type, sequence_parallel, overrides=None):
    model = tiny_vlm(model_type, tp, **(overrides or {}))
    reference = copy.deepcopy(model)
    ids, images = image_batch(model, tp)
    assert images  # the batch carries images
    tplayers.parallelize(model, group=group, sequence_parallel=sequence_parallel)  # its self-check on
    for m in (model, reference):
        m.train()

    def run(m, **kwargs):  # the ids as the decoder's where the image is the encoder's input
        return vision.call_with_ids(m, ids, **images, **kwargs)

    with torch.no_grad():  # the logits; with labels, the sharded model fuses them into its loss
        assert_close(run(model).logits, run(reference).logits)
    got, want = run(model, labels=ids).loss, run(reference, labels=ids).loss
    assert_close(got, want)
    got.backward()
    want.backward()
    grads = gather_grads(model)
    named = reference.named_parameters(remove_duplicate=False)  # a tied LM head under its own name too
    expected = {name: p.grad for name, p in named if p.grad is not None}
    assert sorted(grads) == sorted(expected), set(grads) ^ set(expected)
    tower = [name for name in expected if name.startswith(tuple(vision.towers(reference)))]
    assert tower  # the tower and projector trained too
    for name, grad in expected.items():
        assert_close(grads[name], grad, msg=name)
    if not sequence_parallel:  # generate() with sequence parallelism is refused by design
        model.eval()
        reference.eval()
        prompt = first_image(images)
        if "input_ids" in inspect.signature(model.forward).parameters:  # else the image alone (TrOCR, Donut)
            prompt["input_ids"] = ids[:1]
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(**prompt, **kwargs), reference.generate(**prompt, **kwargs))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model_type", VLMS)
def test_vision_language_model_is_exact_with_images(pool, model_type, tp, sequence_parallel):
    pool.run(matches_unsharded, tp, model_type, sequence_parallel)


# encoder-decoders whose encoder reads the image: merged into its text (Florence-2: DaViT tower, BART with
# its embeddings tied under three names), or alone (VisionEncoderDecoderModel: TrOCR, Donut, Nougat; ViT and
# a BERT decoder cross-attending to it, its start and pad ids as published checkpoints set them). Sequence
# parallelism: the image sweep (Florence-2's is refused, its blocks in two lists)
ENCODER_DECODERS = {"florence2": {}, "vision-encoder-decoder": dict(decoder_start_token_id=1, pad_token_id=0)}


@pytest.mark.parametrize("model_type", ENCODER_DECODERS)
def test_image_encoder_decoder_is_exact_and_generates(pool, model_type):
    pool.run(matches_unsharded, 2, model_type, False, ENCODER_DECODERS[model_type])


def test_towers_are_the_modules_beside_the_language_model():
    with torch.device("meta"):
        model = tiny_vlm("llava", 2)
    assert vision.towers(model) == ["model.vision_tower", "model.multi_modal_projector"]


def test_a_text_model_has_no_towers_and_probes_with_text():
    import transformers as tf

    with torch.device("meta"):
        model = tf.LlamaForCausalLM(tiny_config("llama"))
    ids = torch.zeros(2, 8, dtype=torch.long)
    assert vision.towers(model) == []
    assert vision.probe_images(model, ids, 2) == (ids, {})


# -- negative controls: the self-check sees the tower -----------------------------------------
def tower_with_swapped_kv(rank, tp, group, text_only):
    """An attention adapter that puts k's rows where v's go, in the vision tower only."""
    with kv_swapped(under="model.vision_tower"):
        model = tiny_vlm("llava", tp)
        ids, _ = image_batch(model, tp)
        # text only: the probe the self-check used before it carried images
        verify = {"input_ids": ids[:, ids[0] != model.config.image_token_id]} if text_only else None
        tplayers.parallelize(model, group=group, verify=verify)


def test_negative_control_the_self_check_catches_a_wrong_shard_in_the_tower(pool):
    for reply in pool.run(tower_with_swapped_kv, 2, False, return_exceptions=True):
        assert isinstance(reply, RemoteError) and reply.type_name == "VerifyError", reply
    pool.run(tower_with_swapped_kv, 2, True)  # a text-only probe does not see it: the images are what catch it


def unknown_image_layout(rank, tp, group):
    model = tiny_vlm("apertus1p5", tp)
    with pytest.raises(ValueError, match=r"\(apertus1p5\) takes images.*verify=\{'input_ids'"):
        tplayers.parallelize(model, group=group)


def test_images_tplayers_cannot_make_are_refused_by_name(pool):
    """Apertus 1.5's images are codebook indices offset into the vocabulary (its tokenizer's, not a
    layout of pixels): not a probe tplayers makes, so the self-check could not see the tower; refused,
    pointing to verify=<inputs>."""
    pool.run(unknown_image_layout, 2)


def test_verify_takes_the_model_inputs_by_name():
    with pytest.raises(TypeError, match="needs the token ids as 'input_ids'"):
        tplayers.hf.verify.probe_input(None, {"pixel_values": torch.zeros(1)}, 2)


# -- the sweep: every image-text-to-text type transformers ships --------------------------------
def image_text_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _step(model, ids, images):
    loss = vision.call_with_ids(model, ids, labels=ids, use_cache=False, **images).loss
    loss.backward()
    return loss.detach()


def _verdicts(model_type, tp, group):
    """{sequence_parallel: ("exact" | "refused" | "needs a library" | "unbuilt" | "WRONG" | "CRASH", detail)}
    of one type at TP `tp`: one training step with images against the unsharded model (its step taken
    once for both layouts), first without parallelize's self-check, then, where a rank finds it
    anything but exact or refused, with it (its verdict is the one counted)."""
    try:
        pristine = tiny_vlm(model_type, tp)  # copied for each layout: cheaper than building it again
    except ImportError as e:  # a library the model's code needs that the test set-up lacks (timm)
        return dict.fromkeys((False, True), ("needs a library", str(e).strip().split("\n")[0]))
    except Exception as e:  # its tiny config or model does not build: transformers' own validation
        return dict.fromkeys((False, True), ("unbuilt", f"{type(e).__name__}: {str(e)[:200]}"))
    try:
        batch = image_batch(pristine, tp)
    except ValueError as e:  # images tplayers cannot make: parallelize refuses the same way
        return dict.fromkeys((False, True), ("refused", f"{type(e).__name__}: {str(e)[:300]}"))

    def reference_step():
        reference = copy.deepcopy(pristine).train()
        return _step(reference, *batch), grads_as_state_dict(reference)

    try:
        expected, grads = computed_once(group, reference_step)
    except Exception as e:  # the unsharded model fails on the probe images: parallelize must refuse by name
        return {sp: _refused_unsharded(model_type, tp, group, sp, e) for sp in (False, True)}
    out = {}
    for sp in (False, True):
        out[sp] = sharded_verdict(lambda: copy.deepcopy(pristine), lambda m: _step(m.train(), *batch),
                                  expected, grads, group, sp)  # fmt: skip
        if not sp and out[sp][0] == "refused" and "VerifyError" not in out[sp][1]:
            # refused by what the model holds, before any forward: sequence parallelism adds hooks only
            out[True] = out[False]
            break
    return out


def _refused_unsharded(model_type, tp, group, sp, error):
    model = tiny_vlm(model_type, tp)
    try:
        tplayers.parallelize(model, group=group, sequence_parallel=sp)
    except REFUSALS as refusal:
        return "refused", f"{type(refusal).__name__}: {str(refusal)[:300]}"
    return "CRASH", f"the unsharded model fails on the probe images, parallelize does not refuse: {error}"


def sweep(rank, tp, group, types):
    out = {}
    for model_type in types:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for sp, verdict in _verdicts(model_type, tp, group).items():
                out[model_type, sp] = verdict
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_every_image_text_to_text_type_is_exact_or_refused(pool, tp):
    types = image_text_types()
    results = pool.run(sweep, tp, types, timeout_s=1500)
    verdicts = results[0]
    for other in results[1:]:
        assert {k: v[0] for k, v in other.items()} == {k: v[0] for k, v in verdicts.items()}, "ranks disagree"
    counts = Counter(v[0] for v in verdicts.values())
    print(f"\nimage-text-to-text sweep over {len(types)} types x (TP {tp}, TP {tp} + SP): {dict(counts)}")
    for (model_type, sp), (verdict, detail) in sorted(verdicts.items()):
        print(f"  {model_type:28s} {'sp' if sp else '  '} {verdict:15s} {detail[:160]}")
    bad = {k: v for k, v in verdicts.items() if v[0] in ("WRONG", "CRASH")}
    assert not bad, bad
    for verdict, detail in verdicts.values():  # a refusal names what stops it
        if verdict == "refused":
            assert "parallelize" in detail, detail


# -- driven the way users drive models: .to(), dtype round trips, assign loads, deep copies --------
# Mistral Large 4's second layer reuses the first's latents (KV sharing) and top-k (a shared indexer);
# the default config shares neither
SHARED_LATENTS = dict(
    text_config=dict(num_hidden_layers=3, kv_source_layers=[0, 0, 2], indexer_types=["full", "shared", "full"])
)


def shared_latents(rank, tp, group):
    reference = tiny_vlm("mistral_large4", tp, **SHARED_LATENTS).train()
    assert reference.model.language_model.layers[1].self_attn.kv_a_proj_with_mqa is None
    batch = image_batch(reference, tp)
    expected = _step(reference, *batch)
    grads = grads_as_state_dict(reference)
    assert grads["model.language_model.rotary_emb.alpha"].abs().sum() > 0  # the learned rope's gradient is checked

    def build():
        return tiny_vlm("mistral_large4", tp, **SHARED_LATENTS)

    return {sp: sharded_verdict(build, lambda m: _step(m.train(), *batch), expected, grads, group, sp) for sp in (0, 1)}


@pytest.mark.parametrize("tp", [2, 4])
def test_mistral_large4_reusing_latents_and_top_k_is_exact(pool, tp):
    """Multi-head latent attention whose later layers reuse an earlier layer's latents and top-k, with a
    per-head softmax scaling and a learned rotary embedding (its gradient summed over the heads' ranks)."""
    verdicts = pool.run(shared_latents, tp)[0]
    assert verdicts == {0: ("exact", ""), 1: ("exact", "")}, verdicts


def _assign(model):
    model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)


OPERATIONS = {
    "to": lambda model: model.to("cpu"),  # HF Trainer's constructor
    "dtype-round-trip": lambda model: model.double().float(),
    "assign-load": lambda model: _assign(model) or model,
    "deepcopy": copy.deepcopy,
}


def after_operations(rank, tp, group, model_type, sequence_parallel):
    """After each operation, one training step with images: the loss and every gradient, the
    tower's included, equal the unsharded model's after the same operation (an assign load unties
    Gemma 3's LM head from its embedding in HF's own model too)."""
    reference = tiny_vlm(model_type, tp)
    ids, images = image_batch(reference, tp)
    parallel = tiny_vlm(model_type, tp)
    tplayers.parallelize(parallel, group=group, sequence_parallel=sequence_parallel)
    for operation, apply in OPERATIONS.items():  # each on the model the last one left, as on the sharded one
        reference = apply(reference).train()
        reference.zero_grad(set_to_none=True)
        want = reference(ids, labels=ids, **images).loss
        want.backward()
        named = reference.named_parameters(remove_duplicate=False)
        expected = {n: p.grad for n, p in named if p.grad is not None}
        model = apply(parallel).train()
        parallel.zero_grad(set_to_none=True)  # a copy's records must read the copy's gradients, not these
        model.zero_grad(set_to_none=True)
        got = model(ids, labels=ids, **images).loss
        got.backward()
        assert_close(got, want, msg=lambda m, o=operation: f"{o}: loss: {m}")
        grads = gather_grads(model)
        assert sorted(grads) == sorted(expected), operation
        for name, grad in expected.items():
            assert_close(grads[name], grad, msg=lambda m, o=operation, n=name: f"{o}: {n}: {m}")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("model_type", ["llava", "qwen2_5_vl", "gemma3"])
def test_vision_language_model_stays_exact_through_to_assign_and_deepcopy(pool, model_type, sequence_parallel):
    pool.run(after_operations, 2, model_type, sequence_parallel)


# -- checkpoints under HF's names -------------------------------------------------------------
def from_hf_directory(rank, tp, group, model_type, source, target):
    """Build on meta, shard, read this rank's slices of the HF directory; logits with images; the
    gathered state dict; save back as an HF directory."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(source)
    with tplayers.parameters_on_meta():
        model = tf.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]._from_config(config)
    tplayers.parallelize(model, group=group, verify=False)
    tplayers.load_pretrained(model, source, group=group)
    ids, images = image_batch(tiny_vlm(model_type, tp), tp)
    with torch.no_grad():
        logits = model.eval()(ids, **images).logits
    full = tplayers.gather_state_dict(model, group=group)
    tplayers.save_pretrained(model, target, group=group)
    return logits, full


@pytest.mark.parametrize("model_type", ["llava", "qwen2_5_vl", "gemma3"])
def test_hf_directory_loads_sliced_on_meta_and_exports_back(pool, tmp_path, model_type):
    import transformers as tf

    reference = tiny_vlm(model_type, 2)
    reference.save_pretrained(tmp_path / "source")
    ids, images = image_batch(reference, 2)
    with torch.no_grad():
        want = reference(ids, **images).logits
    for logits, full in pool.run(from_hf_directory, 2, model_type, tmp_path / "source", tmp_path / "trained"):
        assert_close(logits, want)
        assert list(full) == list(reference.state_dict())
        assert all(torch.equal(full[k], v) for k, v in reference.state_dict().items())
    back = tf.AutoModelForImageTextToText.from_pretrained(tmp_path / "trained").eval()
    with torch.no_grad():
        assert_close(back(ids, **images).logits, want)


# -- fine-tuning through the Trainer: LoRA on the language model, the tower frozen --------------
def lora_vlm():
    import peft

    model = tiny_vlm("llava", 2).train()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                             target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)")  # fmt: skip
    model = peft.get_peft_model(model, config)
    for name, p in model.named_parameters():  # peft zeroes B: make the adapters matter from step 1
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    assert not any(p.requires_grad for n, p in model.named_parameters() if "vision_tower" in n)
    return model


def image_rows(n, seed):
    """Rows of a captioning set: the image's tokens, then text; labels on the text only."""
    reference = tiny_vlm("llava", 2)
    ids = torch.randint(0, 100, (n, 6), generator=torch.Generator().manual_seed(seed))
    ids, images = vision.probe_images(reference, ids, 2)
    labels = ids.masked_fill(ids == reference.config.image_token_id, -100)
    pixels = images["pixel_values"]
    return [{"input_ids": i, "labels": y, "pixel_values": p} for i, y, p in zip(ids, labels, pixels, strict=True)]


def fine_tune(trainer_class, model, out):
    import transformers as tf

    args = tf.TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                max_steps=3, max_grad_norm=1.0, learning_rate=1e-2, logging_steps=1, report_to=[],
                                save_strategy="no", seed=0, use_cpu=True, disable_tqdm=True,
                                dataloader_num_workers=0)  # fmt: skip
    trainer = trainer_class(model=model, args=args, train_dataset=image_rows(16, 1))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return [(h["step"], h["loss"], h["grad_norm"]) for h in logged]


def fine_tuned_at_tp2(rank, world, root):
    mesh = tplayers.init_mesh(tp=2)
    model = tplayers.parallelize(lora_vlm(), group=mesh["tp"])
    history = fine_tune(tplayers.hf.Trainer, model, f"{root}/tp2")
    return history, {k: v.detach().clone() for k, v in tplayers.gather_state_dict(model).items()}


def test_trainer_fine_tunes_lora_on_the_language_model_as_unsharded(tmp_path):
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = lora_vlm()
        want = fine_tune(tf.Trainer, reference, str(tmp_path / "ref"))
    got, weights = tplayers.launch(fine_tuned_at_tp2, 2, str(tmp_path), timeout=600)[0]
    assert [s for s, _, _ in got] == [s for s, _, _ in want] == [1, 2, 3]
    for (step, loss, norm), (_, loss_r, norm_r) in zip(got, want, strict=True):
        assert loss == pytest.approx(loss_r, abs=1e-5), step
        assert norm == pytest.approx(norm_r, abs=1e-5), step
    expected = reference.state_dict()
    assert sorted(weights) == sorted(expected)
    for name, value in expected.items():
        assert_close(weights[name], value, msg=name)
    assert any("lora" in n and not torch.equal(v, lora_vlm().state_dict()[n]) for n, v in weights.items())  # trained


def context_parallel_vlm(rank, world, group):
    from tplayers.testing.meshes import context_mesh

    groups = context_mesh(1, 1, 2, 1)
    model = tiny_vlm("llava", 1)
    with pytest.raises(ValueError, match="context parallelism splits the token ids before LlavaForConditional"):
        tplayers.parallelize(model, group=groups["tp"], context_group=groups["cp"])


def test_context_parallelism_is_refused_by_name(pool):
    """The sequence is split before the image features are merged into it: refused, on every rank."""
    pool.run(context_parallel_vlm, 2, mesh=("cp", 1, 1, 2, 1))


# -- sharded checkpoints (DCP) across tensor-parallel sizes --------------------------------------
def train_step(model, opt, tp):
    ids, images = image_batch(tiny_vlm("qwen2_5_vl", 2), 2)  # one batch for every layout
    model.train()
    model(ids, labels=ids, **images).loss.backward()
    opt.step()
    opt.zero_grad()


def saved_at_tp2(rank, tp, group, path):
    model = tplayers.parallelize(tiny_vlm("qwen2_5_vl", 2), group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, opt, tp)
    tplayers.save_checkpoint(path, model=model, optimizer=opt, group=group)
    train_step(model, opt, tp)
    return tplayers.gather_state_dict(model, group=group)


def loaded_at(rank, tp, group, path):
    torch.manual_seed(7)
    model = tplayers.parallelize(tiny_vlm("qwen2_5_vl", 2), group=group, verify=False)
    for p in model.parameters():  # other weights: everything must come from the checkpoint
        torch.nn.init.normal_(p, std=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tplayers.load_checkpoint(path, model=model, optimizer=opt, group=group)
    train_step(model, opt, tp)  # the momentum came back too: the second step matches
    return tplayers.gather_state_dict(model, group=group)


def test_a_checkpoint_saved_at_tp2_loads_at_tp4_and_tp1_and_trains_on(pool, tmp_path):
    """Qwen2.5-VL (tower, merger, multimodal rope) with SGD and momentum (a key bias's gradient is
    rounding noise, which Adam would scale up to the learning rate): saved after one step at TP 2, loaded
    at TP 4 (its 4 heads one per rank) and TP 1, the next step equals the TP 2 run's."""
    path = str(tmp_path / "ckpt")
    want = pool.run(saved_at_tp2, 2, path)[0]
    for tp in (4, 1):
        got = pool.run(loaded_at, tp, path)[0]
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert_close(got[name], value, msg=f"TP {tp}: {name}")


def on_a_grid(rank, world, group):
    mesh = layout_mesh(1, 1, 2, 2)
    tplayers.parallelize(tiny_vlm("llava", 2), group=mesh["tp_r", "tp_c"])


def pipeline_split_of_a_vlm(rank, world, group):
    mesh = layout_mesh(1, 2, 2)
    tplayers.pipeline_split(tplayers.parallelize(tiny_vlm("llava", 2), group=mesh["tp"]), group=mesh["pp"])


def test_a_2d_grid_and_pipeline_split_refuse_the_towers_by_name(pool):
    """Neither the 2-D grid nor pipeline_split places a vision tower (the grid had kept it whole unasked,
    after a raw AttributeError): both refuse on every rank, naming the towers and the way out."""
    for fn, mesh, what in ((on_a_grid, (1, 1, 2, 2), "1-D tensor-parallel group"),
                           (pipeline_split_of_a_vlm, (1, 2, 2), "PipelineStage directly")):  # fmt: skip
        for reply in pool.run(fn, 4, mesh=mesh, return_exceptions=True):
            assert isinstance(reply, RemoteError), reply
            assert "model.vision_tower, model.multi_modal_projector" in reply.message and what in reply.message
