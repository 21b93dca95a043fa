"""Vision-language models parallelized whole, no plan passed: the vision tower split by heads and
features like the text layers, the projector as a column / row pair, the language model as
always; sequence parallelism cuts the language model's sequence only, after the image features
are merged into it. Compared here, independently of parallelize's own self-check, with images in
the batch: logits, loss and every gradient against the unsharded model, and greedy generate()
from an image prompt. The self-check itself sees images: a wrongly sharded tower fails it."""

import copy
import warnings

import pytest
import torch

import tplayers
from tplayers.hf import families, gather_grads, vision
from tplayers.hf.verify import PROBE_BATCH, PROBE_TOKENS_PER_RANK
from tplayers.testing import assert_close
from tplayers.testing.pool import RemoteError
from tplayers.testing.tiny import tiny_config

pytestmark = pytest.mark.multirank

# vision tower / projector of each: CLIP + linear pair; Pixtral + patch merger + linear pair; SigLIP +
# one linear; SigLIP + average pooling and a projection matrix
VLMS = ("llava", "mistral3", "paligemma", "gemma3")


def tiny_vlm(model_type, tp):
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tiny_config(model_type, heads=2 * tp)
        torch.manual_seed(0)
        model = tf.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(cfg)](cfg)
    for name, p in model.named_parameters():
        # Gemma 3's projection matrix starts at zero: zero image embeddings make the first norms'
        # gradients 1/sqrt(eps) large, where fp32 summation order alone exceeds any tolerance. A
        # checkpoint's is not zero.
        if name.endswith("mm_input_projection_weight"):
            torch.nn.init.normal_(p, std=0.02)
    return model.eval()


def image_batch(model, tp):
    """Token ids with each row's image tokens first, and the images: what the self-check probes with."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (PROBE_BATCH, PROBE_TOKENS_PER_RANK * tp), generator=generator)
    return vision.probe_images(model, ids, tp)


def matches_unsharded(rank, tp, group, model_type, sequence_parallel):
    model = tiny_vlm(model_type, tp)
    reference = copy.deepcopy(model)
    ids, images = image_batch(model, tp)
    assert images and (ids == model.config.image_token_id).sum() > 0  # the batch carries images
    tplayers.parallelize(model, group=group, sequence_parallel=sequence_parallel)  # its self-check on
    for m in (model, reference):
        m.train()
    with torch.no_grad():  # the logits; with labels, the sharded model fuses them into its loss
        assert_close(model(ids, **images).logits, reference(ids, **images).logits)
    got, want = model(ids, labels=ids, **images).loss, reference(ids, labels=ids, **images).loss
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
        prompt = {k: v[:1] for k, v in images.items()}
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids[:1], **prompt, **kwargs), reference.generate(ids[:1], **prompt, **kwargs))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("model_type", VLMS)
def test_vision_language_model_is_exact_with_images(pool, model_type, sequence_parallel):
    pool.run(matches_unsharded, 2, model_type, sequence_parallel)


@pytest.mark.parametrize("model_type", ["llava", "gemma3"])
def test_vision_language_model_is_exact_at_tp4(pool, model_type):
    pool.run(matches_unsharded, 4, model_type, True)


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
    from tplayers.hf import attention

    original = attention.qkvo_attention

    def wrong(sp, name, attn):
        if name.startswith("model.vision_tower"):
            attn.k_proj, attn.v_proj = attn.v_proj, attn.k_proj
        original(sp, name, attn)

    adapters = tuple(
        families.Adapter(a.name, a.matches, wrong) if a.apply is original else a for a in families.ADAPTERS
    )
    families.ADAPTERS, saved = adapters, families.ADAPTERS
    try:
        model = tiny_vlm("llava", tp)
        ids, _ = image_batch(model, tp)
        # text only: the probe the self-check used before it carried images
        verify = {"input_ids": ids[:, ids[0] != model.config.image_token_id]} if text_only else None
        tplayers.parallelize(model, group=group, verify=verify)
    finally:
        families.ADAPTERS = saved


def test_negative_control_the_self_check_catches_a_wrong_shard_in_the_tower(pool):
    for reply in pool.run(tower_with_swapped_kv, 2, False, return_exceptions=True):
        assert isinstance(reply, RemoteError) and reply.type_name == "VerifyError", reply
    pool.run(tower_with_swapped_kv, 2, True)  # a text-only probe does not see it: the images are what catch it


def unknown_image_layout(rank, tp, group):
    model = tiny_vlm("smolvlm", tp)
    with pytest.raises(ValueError, match=r"SmolVLMForConditionalGeneration \(smolvlm\).*verify=\{'input_ids'"):
        tplayers.parallelize(model, group=group)


def test_images_tplayers_cannot_make_are_refused_by_name(pool):
    """SmolVLM takes (batch, images, channels, height, width) with a pixel mask: not a layout the
    probe makes, so the self-check could not see the tower; refused, pointing to verify=<inputs>."""
    pool.run(unknown_image_layout, 2)


def test_verify_takes_the_model_inputs_by_name():
    with pytest.raises(TypeError, match="needs the token ids as 'input_ids'"):
        tplayers.hf.verify.probe_input(None, {"pixel_values": torch.zeros(1)}, 2)
