"""The newcomer sweep: every causal-LM type transformers ships that `tests/test_families.py` does
not cover, as a tiny random model at TP 2 and TP 4, with and without sequence parallelism, MoE
auxiliary losses on. Each ends exact (one training step's loss and every gradient, with an attention mask,
equal the unsharded model's: checked here independently of parallelize's own self-check) or
refused with a message naming what stops it. None is wrong; none crashes inside HF or torch.

Each type's tiny config comes from its own config class (`tplayers.testing.tiny_config`), so the
sweep reaches every type; drafter models, whose forward takes their target model's states, are
listed as such."""

import pickle
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tplayers
from tplayers.hf.verify import VerifyError
from tplayers.placement import PlacementError
from tplayers.testing.hooks import hooks_holding_state
from tplayers.testing.meshes import layout_mesh
from tplayers.testing.pool import RemoteError
from tplayers.testing.shards import differing_grads, grads_as_state_dict
from tplayers.testing.tiny import MEANINGFUL_IDS, VOCAB, tiny_config
from tplayers.tolerances import tolerance

pytestmark = pytest.mark.multirank

TINY = 5_000_000  # parameters: a tiny config above this did not shrink the model
REFUSALS = (ValueError, VerifyError, PlacementError)
# Drafter models run only inside their target's generate(): their forward takes the target's hidden
# states and key/value cache, so there is no training step of their own to compare.
DRAFTERS = {"gemma4_assistant", "gemma4_unified_assistant"}


def newcomer_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    sys.path.insert(0, str(Path(__file__).parent))
    from test_families import EXACT, REFUSED, VARIANTS

    covered = {VARIANTS.get(f, (f,))[0] for f in EXACT} | set(REFUSED)
    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in covered)


def tiny_reference(model_type, tp):
    """(model class, config, unsharded loss, `grads_as_state_dict`, sequence length) of one training step
    of the type's tiny config (`tplayers.testing.tiny_config`) as a decoder, every dropout / jitter off:
    7 tokens (parts of 4 and 3 under sequence parallelism at TP 2), or 8 for a model taking only some
    lengths (Reformer: a multiple of its chunks)."""
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tiny_config(model_type, heads=2 * tp, is_decoder=True)  # key/value heads: one per rank
        model_class = tf.MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
        # a composite config whose causal LM is built from one of its parts (MusicGen's decoder)
        cfg = next((v for v in vars(cfg).values() if type(v) is model_class.config_class), cfg)
        if "output_router_logits" in vars(cfg):  # MoE auxiliary losses on
            cfg.output_router_logits = True
        for key, value in list(vars(cfg).items()):
            if type(value) is float and any(n in key for n in ("dropout", "jitter", "pdrop")):
                setattr(cfg, key, 0.0)
        reference = _build(model_class, cfg)
        assert sum(p.numel() for p in reference.parameters()) < TINY, model_type
        try:
            length = 7
            loss = _step(reference, _batch(cfg, length))
        except Exception:  # the unsharded model refuses 7 tokens: the type runs 8
            reference.zero_grad(set_to_none=True)
            length = 8
            loss = _step(reference, _batch(cfg, length))
    return model_class, cfg, loss, grads_as_state_dict(reference), length


def computed_once(group, fn):
    """fn()'s result on every rank of `group` (a process group or a 1-D DeviceMesh), computed on its
    first rank only and broadcast, or the exception it raised there, raised on every rank: the
    unsharded reference of a sweep, which the ranks would otherwise each compute on the suite's two
    cores."""
    pg = getattr(group, "get_group", lambda: group)()
    box = [None, None]
    if dist.get_rank(pg) == 0:
        try:
            box[0] = fn()
        except Exception as e:
            try:
                pickle.dumps(e)
                box[1] = e
            except Exception:  # an exception that does not pickle goes as its type's name and message
                box[1] = RuntimeError(f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    if box[1] is not None:
        raise box[1]
    return box[0]


def _build(model_class, cfg):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class._from_config(cfg)
    if hasattr(model, "set_default_language"):  # X-MOD: one adapter per language, picked before a forward
        model.set_default_language(cfg.languages[0])
    if cfg.model_type == "rwkv":  # its embeddings' 1e-4 init under a LayerNorm scales the fp32 rounding of every
        with torch.no_grad():  # gradient before it by 1e4: the unsharded model's own is past the table from fp64
            model.get_input_embeddings().weight.normal_()
    return model


def _batch(cfg, length):
    """The training batch: token ids with their mask and labels, plus what a type's loss needs
    besides (GIT scores text after its image's tokens; MusicGen's ids hold one row per codebook)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB - MEANINGFUL_IDS, (2, length), generator=generator)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    if cfg.model_type == "git":
        size = cfg.vision_config.image_size
        batch["pixel_values"] = torch.randn(2, cfg.vision_config.num_channels, size, size, generator=generator)
    if getattr(cfg, "num_codebooks", None) and "musicgen" in cfg.model_type:
        batch["labels"] = ids.reshape(-1, cfg.num_codebooks, ids.shape[-1]).transpose(1, 2)
    return batch


def _step(model, batch):
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach()


def sharded_verdict(build, step, expected, reference_grads, group, sp):
    """("exact" | "refused" | "WRONG" | "CRASH", detail) of the model `build()` makes, parallelized at
    one layout, after `step(model)` (one training step, returning its loss) against the unsharded
    model's loss and gradients. First without parallelize's own self-check (this comparison is
    stricter: the loss and every gradient); where a rank finds it anything but exact or refused,
    again with the self-check insisting on a training step (verify=True), so parallelize's verdict
    (a refusal naming the module, or nothing) is the one counted: where it passes a model whose loss
    or gradients this comparison finds past the table, its fp64 arbiter found the difference fp32
    rounding (the unsharded model's own fp32 gradient as far from fp64), said in the detail.
    `group`: a process group or a 1-D DeviceMesh."""
    verdict = _checked(build, step, expected, reference_grads, group, sp, verify=False)
    fine = torch.tensor([float(verdict[0] in ("exact", "refused"))])
    dist.all_reduce(fine, op=dist.ReduceOp.MIN, group=getattr(group, "get_group", lambda: group)())
    if fine.item():
        return verdict
    return _checked(build, step, expected, reference_grads, group, sp, verify=True)  # a training step's, or raises


def _checked(build, step, expected, reference_grads, group, sp, verify):
    tol = tolerance(torch.float32)
    model = build()
    try:
        tplayers.parallelize(model, group=group, sequence_parallel=sp, verify=verify)
    except Exception as e:
        ours = isinstance(e, REFUSALS) or str(e).startswith("parallelize")  # tplayers' own refusal
        return ("refused" if ours else "CRASH", f"{type(e).__name__}: {str(e)[:300]}")  # else from inside HF / torch
    if hooks_holding_state(model):  # a deep copy of the model would read the original's state
        return "WRONG", f"hooks holding state: {hooks_holding_state(model)[:2]}"
    try:
        loss = step(model)
    except Exception as e:
        return "CRASH", f"training step: {type(e).__name__}: {str(e)[:300]}"
    try:  # each rank's gradients against its slices of the reference's (no collective: see tplayers.testing.shards)
        wrong_grads = differing_grads(model, reference_grads, **tol)
    except Exception as e:
        return "WRONG", f"load_full_state_dict cannot slice the reference: {type(e).__name__}: {str(e)[:300]}"
    wrong = [] if torch.allclose(loss, expected, **tol) else [f"loss {loss.item()} vs {expected.item()}"]
    wrong += wrong_grads
    if wrong and verify is True:  # the self-check passed its gradients: past the table by fp32 rounding only
        return "exact", f"fp32 rounding by the self-check's fp64 arbiter: {', '.join(wrong[:5])}"
    return ("WRONG", ", ".join(wrong[:5])) if wrong else ("exact", "")


def _verdict(model_class, cfg, expected, reference_grads, length, group, sp):
    def build():
        return _build(model_class, cfg)

    def step(model):
        return _step(model, _batch(cfg, length))

    return sharded_verdict(build, step, expected, reference_grads, group, sp)


def sweep(rank, world, group, types):
    """{(type, sequence_parallel): ("exact" | "refused" | "drafter" | "WRONG" | "CRASH", detail)}."""
    tp = layout_mesh(1, 1, world)["tp"]
    out = {}
    for model_type in types:
        if model_type in DRAFTERS:
            out[model_type, False] = out[model_type, True] = ("drafter", "runs inside its target's generate()")
            continue
        try:
            reference = computed_once(tp, lambda: tiny_reference(model_type, world))  # noqa: B023 (called at once)
        except ImportError as e:  # a library the model's code needs that the test set-up lacks (timm)
            out[model_type, False] = out[model_type, True] = ("needs a library", str(e).split(".")[0].strip())
            continue
        out[model_type, False] = _verdict(*reference, tp, False)
        if out[model_type, False][0] == "refused" and "VerifyError" not in out[model_type, False][1]:
            # refused by what the model holds, before any forward: sequence parallelism adds hooks only
            out[model_type, True] = ("refused", "as without sequence parallelism")
        else:
            out[model_type, True] = _verdict(*reference, tp, True)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_every_newcomer_is_exact_or_refused(pool, tp):
    types = newcomer_types()
    results = pool.run(sweep, tp, types, mesh=(1, 1, tp), timeout_s=1500)
    verdicts = results[0]
    for other in results[1:]:
        assert {k: v[0] for k, v in other.items()} == {k: v[0] for k, v in verdicts.items()}, "ranks disagree"
    counts = Counter(v[0] for v in verdicts.values())
    print(f"\nnewcomer sweep over {len(types)} types x (TP {tp}, TP {tp} + SP): {dict(counts)}")
    for (model_type, sp), (verdict, detail) in sorted(verdicts.items()):
        print(f"  {model_type:28s} {'sp' if sp else '  '} {verdict:15s} {detail[:160]}")
    bad = {k: v for k, v in verdicts.items() if v[0] in ("WRONG", "CRASH")}
    assert not bad, bad
    for verdict, detail in verdicts.values():  # a refusal names what stops it
        if verdict == "refused":
            assert "parallelize" in detail or detail == "as without sequence parallelism", detail
    assert counts["exact"] >= 20, counts  # the sweep reached models, not only configs it could not shrink


# The types this sweep reached first with their own adapters: DeepSeek Sparse Attention, DeepSeek-V4,
# Qwen4-Exp (hyper-connections, query-sparse attention), Kimi Delta Attention, OLMo hybrid's Gated
# DeltaNet, fused gate_up MLPs with their own elementwise math, MLA variants, zero-computation experts,
# attention with convolved keys and values, RecurrentGemma's RG-LRU, xLSTM's mLSTM, RWKV's cached WKV states,
# CTRL's, XLM's and ModernBERT-decoder's layers (renamed projections, a chunked [input; gate] MLP),
# BigBird's pooler, Moshi's wrapped projections and [gate; up] viewed in two, XLNet's feed-forward (its
# relative attention whole), GIT's towers inside its model, Zamba's multi-head Mamba mixer.
ADAPTED = ["deepseek_v32", "glm_moe_dsa", "hy_v4", "dots3_note_text", "deepseek_v4", "qwen4_exp_text",
           "kimi_linear", "bailing_hybrid", "olmo_hybrid", "zamba2", "minimax_m3_vl_text", "axk1", "axk2", "youtu",
           "lfm3", "longcat_flash", "inkling_text", "recurrent_gemma", "xlstm", "rwkv", "ctrl", "xlm",
           "modernbert-decoder", "big_bird", "moshi", "xlnet", "git", "zamba"]  # fmt: skip


# transformers 5.24's generate() fails for these unsharded (RecurrentGemma: its cache holds no attention
# layer get_seq_length can read; xLSTM: its cached state has the wrong shape for its own step): their
# state dicts are compared, their decoding not
NO_GENERATE = {"recurrent_gemma", "xlstm"}


def generate_and_state_dict(rank, world, group, types):
    """{type: failures} of greedy generate() and the gathered state dict against the unsharded model."""
    tp = layout_mesh(1, 1, world)["tp"]
    out = {}
    for model_type in types:
        model_class, cfg, *_ = tiny_reference(model_type, world)
        reference = _build(model_class, cfg).eval()
        model = tplayers.parallelize(_build(model_class, cfg).eval(), group=tp)
        wrong = []
        full = tplayers.gather_state_dict(model, group=tp)
        if list(full) != list(reference.state_dict()):
            wrong.append(f"state dict keys {sorted(set(full) ^ set(reference.state_dict()))[:4]}")
        wrong += [k for k, v in reference.state_dict().items() if k in full and not torch.equal(full[k], v)]
        ids = torch.randint(3, VOCAB - MEANINGFUL_IDS, (1, 6), generator=torch.Generator().manual_seed(2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                expected = reference.generate(ids, max_new_tokens=5, do_sample=False)
            except ValueError as e:  # transformers' own generate() fails for the unsharded model
                assert model_type in NO_GENERATE, f"{model_type}: {e}"
                expected = None
            if expected is not None and not torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False),
                                                        expected):  # fmt: skip
                wrong.append("generate()")
        out[model_type] = wrong
    return out


def test_adapted_types_generate_and_round_trip_their_state_dict(pool):
    wrong = {t: w for t, w in pool.run(generate_and_state_dict, 2, ADAPTED, mesh=(1, 1, 2))[0].items() if w}
    assert not wrong, wrong


def inkling_under_sp(rank, world, group):
    model_class, cfg, *_ = tiny_reference("inkling_text", world)
    tplayers.parallelize(_build(model_class, cfg), group=group, sequence_parallel=True)


def test_a_convolution_left_whole_in_a_block_is_refused_under_sp(pool):
    """Inkling convolves its residual stream along the sequence in each block: under sequence parallelism
    each token would read its predecessors across the split, which at random init (weights near 0) the
    self-check cannot see. Refused by name on every rank, before any collective; exact without SP (the
    sweep)."""
    for reply in pool.run(inkling_under_sp, 2, return_exceptions=True):
        assert isinstance(reply, RemoteError) and "attn_sconv.conv1d (Conv1d) convolves along the sequence" in (
            reply.message
        ), reply
