"""`ModelSpec.from_hf_config`: a HuggingFace `config.json` read into a `ModelSpec`, dense decoders
and mixtures of experts alike; what the planner cannot price (latent attention, linear-attention
or state-space layers, experts on only some layers) is refused by name rather than estimated as
something else."""

from __future__ import annotations

import json
from pathlib import Path

_NON_GATED_TYPES = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2", "gpt_bigcode"}
# keys a mixture-of-experts config counts its routed experts, and each token's picks, under
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_topk", "moe_top_k")
# attention layers, priced as full attention (Llama 4's chunked layers attend within chunks: fewer FLOPs)
PRICED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention"}


def _load(config) -> dict:
    if isinstance(config, dict):
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no HuggingFace config at {str(path)!r}")
    return json.loads(path.read_text())


def _get(cfg: dict, *keys, default=None):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _refuse(cfg: dict, why: str):
    raise ValueError(
        f"ModelSpec.from_hf_config: {cfg.get('model_type', 'this model')}: {why}; estimating it as a model the "
        "planner prices would be wrong. Give the ModelSpec's dimensions yourself to plan the part it does price"
    )


def _refusals(cfg: dict) -> None:
    """What the planner's formulas do not describe, named."""
    if cfg.get("kv_lora_rank") or cfg.get("q_lora_rank"):
        _refuse(cfg, "multi-head latent attention (kv_lora_rank / q_lora_rank) is not priced (q / k / v / o only)")
    other = sorted({str(t) for t in cfg.get("layer_types") or ()} - PRICED_LAYER_TYPES)
    if other:
        _refuse(cfg, f"layer types {other} (linear attention / state-space mixers) are not priced")
    if isinstance(cfg.get("ffn_config"), dict):
        _refuse(cfg, "the experts of ffn_config (DBRX) are not read")
    patterns = {k: cfg[k] for k in ("decoder_sparse_step", "interleave_moe_layer_step", "moe_layer_freq")
                if isinstance(cfg.get(k), int) and cfg[k] > 1}  # fmt: skip
    if cfg.get("mlp_only_layers"):
        patterns["mlp_only_layers"] = cfg["mlp_only_layers"]
    for key in ("attn_layer_period", "expert_layer_period"):  # Jamba: Mamba layers, experts every other layer
        if key in cfg:
            patterns[key] = cfg[key]
    if patterns:
        _refuse(
            cfg,
            f"experts on some layers only ({patterns}): only leading dense layers (first_k_dense_replace) are priced",
        )


def _experts(cfg: dict) -> dict:
    """The ModelSpec's mixture-of-experts fields ({} for a dense model)."""
    experts = _get(cfg, *EXPERT_KEYS)
    if not isinstance(experts, int) or experts < 2:
        return {}
    k = _get(cfg, *TOP_K_KEYS)
    if not isinstance(k, int):
        _refuse(cfg, f"{experts} experts but no picks per token under {', '.join(TOP_K_KEYS)}")
    expert_ffn = _get(cfg, "moe_intermediate_size", "intermediate_size")
    shared = _get(cfg, "shared_expert_intermediate_size", "shared_intermediate_size")
    if shared is None and cfg.get("n_shared_experts"):
        shared = cfg["n_shared_experts"] * expert_ffn
    if shared is None and str(cfg.get("model_type", "")).startswith("llama4"):  # its shared expert, unnamed
        shared = cfg.get("intermediate_size")
    return dict(
        experts=experts,
        experts_per_token=k,
        expert_ffn=expert_ffn,
        shared_ffn=shared or 0,
        dense_layers=cfg.get("first_k_dense_replace") or 0,
    )


def spec_fields(config) -> dict:
    """A `ModelSpec`'s fields read from a HuggingFace `config.json` (a path to it, its folder, or the
    parsed dict); see `ModelSpec.from_hf_config`."""
    cfg = _load(config)
    _refusals(cfg)
    gpt2_style = "n_embd" in cfg or "n_layer" in cfg
    layers = _get(cfg, "num_hidden_layers", "n_layer")
    hidden = _get(cfg, "hidden_size", "n_embd")
    heads = _get(cfg, "num_attention_heads", "n_head")
    vocab = _get(cfg, "vocab_size")
    positions = _get(cfg, "max_position_embeddings", "n_positions")
    needed = {"layers": layers, "hidden": hidden, "heads": heads, "vocab_size": vocab, "max positions": positions}
    missing = [k for k, v in needed.items() if v is None]
    if missing:
        raise ValueError(f"HuggingFace config lacks {', '.join(missing)}")
    model_type = str(cfg.get("model_type", "gpt2" if gpt2_style else "")).lower()
    gated = not gpt2_style and model_type not in _NON_GATED_TYPES
    layernorm = gpt2_style or "layer_norm_epsilon" in cfg or "layer_norm_eps" in cfg
    dropout_keys = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop", "dropout")
    dropout = any(float(cfg.get(k) or 0) > 0 for k in dropout_keys)
    bias = gpt2_style or bool(cfg.get("attention_bias") or cfg.get("mlp_bias") or cfg.get("use_bias"))
    learned = gpt2_style or model_type in {"opt", "gpt_bigcode"}
    return dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=_get(cfg, "num_key_value_heads", default=heads),
        ffn_hidden=_get(cfg, "intermediate_size", "n_inner", "ffn_dim", default=None if gated else 4 * hidden),
        vocab=vocab,
        seq_len=positions,
        gated_mlp=gated,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", gpt2_style)),
        head_dim=_get(cfg, "head_dim"),
        norm="layernorm" if layernorm else "rmsnorm",
        linear_bias=bias,
        position_embedding="learned" if learned else "rope",
        max_positions=positions,
        dropout=dropout,
        name=cfg.get("_name_or_path") or model_type or None,
        **_experts(cfg),
    )
