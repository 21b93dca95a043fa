"""The newcomer sweep: every causal-LM type transformers ships that `tests/test_families.py` does
not cover, as a tiny random model at TP 2, with and without sequence parallelism, MoE auxiliary
losses on. Each ends exact (one training step's loss and every gradient, with an attention mask,
equal the unsharded model's: checked here independently of parallelize's own self-check) or
refused with a message naming what stops it. None is wrong; none crashes inside HF or torch.

Types whose default config this sweep cannot shrink to a tiny model (sizes under other names,
composite multimodal configs) are counted and listed, not run: they are out of its reach, not
passed."""

import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

import tplayers
from tplayers.hf import gather_grads
from tplayers.hf.verify import VerifyError
from tplayers.placement import PlacementError
from tplayers.testing.meshes import layout_mesh
from tplayers.tolerances import tolerance

pytestmark = pytest.mark.multirank

VOCAB = 96
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_local_experts=4, num_experts=4,
             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
             output_router_logits=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
# Multi-head latent attention reads its widths under its own names; one key/value head per query head
# (its forward expands the latent to every head) and the rotary width as head_dim, as its configs set them.
MLA_SIZES = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, head_dim=4,
                 num_key_value_heads=SIZES["num_attention_heads"])  # fmt: skip
TINY = 5_000_000  # parameters: above this the generic sizes did not reach the model's own
REFUSALS = (ValueError, VerifyError, PlacementError)


def newcomer_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    sys.path.insert(0, str(Path(__file__).parent))
    from test_families import EXACT, REFUSED, VARIANTS

    covered = {VARIANTS.get(f, (f,))[0] for f in EXACT} | set(REFUSED)
    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in covered)


def tiny_reference(model_type):
    """(config, unsharded loss, {name: gradient}) of one training step of the type's default config
    with the common sizes made tiny and every dropout / jitter off; None where that does not give a
    small model that trains."""
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = tf.AutoConfig.for_model(model_type)
            for key, value in SIZES.items():
                if hasattr(cfg, key):
                    setattr(cfg, key, value)
            if getattr(cfg, "kv_lora_rank", None):
                for key, value in MLA_SIZES.items():
                    setattr(cfg, key, value)
                if getattr(cfg, "q_lora_rank", None):
                    cfg.q_lora_rank = 16
            for key, value in list(vars(cfg).items()):
                if type(value) is float and any(n in key for n in ("dropout", "jitter", "pdrop")):
                    setattr(cfg, key, 0.0)
            with torch.device("meta"):
                meta = tf.AutoModelForCausalLM.from_config(cfg)
            if sum(p.numel() for p in meta.parameters()) > TINY:
                return None
            reference = _build(cfg)
            loss = _step(reference, *_batch())
        except Exception:  # the config, not tplayers: out of this sweep's reach
            return None
    return cfg, loss, {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}


def _build(cfg):
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tf.AutoModelForCausalLM.from_config(cfg)


def _batch():
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    return ids, torch.ones_like(ids)


def _step(model, ids, mask):
    loss = model(ids, attention_mask=mask, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


def _verdict(cfg, expected, reference_grads, group, sp):
    """("exact" | "refused" | "WRONG" | "CRASH", detail) of one type at one layout."""
    tol = tolerance(torch.float32)
    model = _build(cfg)
    try:
        tplayers.parallelize(model, group=group, sequence_parallel=sp)
    except Exception as e:
        ours = isinstance(e, REFUSALS) or str(e).startswith("parallelize")  # tplayers' own refusal
        return ("refused" if ours else "CRASH", f"{type(e).__name__}: {str(e)[:300]}")  # else from inside HF / torch
    try:
        loss = _step(model, *_batch())
        grads = gather_grads(model)
    except Exception as e:
        return "CRASH", f"training step: {type(e).__name__}: {str(e)[:300]}"
    wrong = [] if torch.allclose(loss, expected, **tol) else [f"loss {loss.item()} vs {expected.item()}"]
    for name, expected_grad in reference_grads.items():
        if not torch.allclose(grads.get(name, torch.zeros_like(expected_grad)), expected_grad, **tol):
            wrong.append(name)
    return ("WRONG", ", ".join(wrong[:5])) if wrong else ("exact", "")


def sweep(rank, world, group, types):
    """{(type, sequence_parallel): ("exact" | "refused" | "no tiny config" | "WRONG" | "CRASH", detail)}."""
    tp = layout_mesh(1, 1, world)["tp"]
    out = {}
    for model_type in types:
        reference = tiny_reference(model_type)
        if reference is None:
            out[model_type, False] = out[model_type, True] = ("no tiny config", "")
            continue
        out[model_type, False] = _verdict(*reference, tp, False)
        if out[model_type, False][0] == "refused" and "VerifyError" not in out[model_type, False][1]:
            # refused by what the model holds, before any forward: sequence parallelism adds hooks only
            out[model_type, True] = ("refused", "as without sequence parallelism")
        else:
            out[model_type, True] = _verdict(*reference, tp, True)
    return out


def test_every_newcomer_is_exact_or_refused(pool):
    types = newcomer_types()
    results = pool.run(sweep, 2, types, mesh=(1, 1, 2), timeout_s=1500)
    verdicts = results[0]
    assert results[1] == verdicts or {k: v[0] for k, v in results[1].items()} == {
        k: v[0] for k, v in verdicts.items()
    }, "ranks disagree"
    counts = Counter(v[0] for v in verdicts.values())
    print(f"\nnewcomer sweep over {len(types)} types x (TP 2, TP 2 + SP): {dict(counts)}")
    for (model_type, sp), (verdict, detail) in sorted(verdicts.items()):
        print(f"  {model_type:28s} {'sp' if sp else '  '} {verdict:15s} {detail[:160]}")
    bad = {k: v for k, v in verdicts.items() if v[0] in ("WRONG", "CRASH")}
    assert not bad, bad
    for verdict, detail in verdicts.values():  # a refusal names what stops it
        if verdict == "refused":
            assert "parallelize" in detail or detail == "as without sequence parallelism", detail
    assert counts["exact"] >= 20, counts  # the sweep reached models, not only configs it could not shrink
