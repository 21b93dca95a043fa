"""Memory, communication and time estimates for TP x PP x DP x ZeRO training layouts.

Pure Python (no torch): `estimate` prices one `Layout` of a `ModelSpec` on a `ClusterSpec`;
`search` enumerates layouts for a global batch and ranks the valid ones that fit by step time.

Conventions (read these before the numbers)
-------------------------------------------
* Memory (`Estimate.memory`, `MemoryBreakdown`): bytes **per GPU**, for the pipeline stage
  that needs the most (`MemoryBreakdown.stage`; every stage is in `Estimate.stages`). That is
  the one that decides whether a layout fits. Under 1F1B it is usually stage 0 (most
  micro-batches in flight, plus the embedding); with a large vocabulary and few layers per
  stage it can be the last (LM head and fp32 logits).
* FLOPs (`Estimate.model_flops`, `Estimate.hardware_flops`): per optimizer step for the
  **whole job** (all GPUs), the Megatron / PaLM convention; divide by `num_gpus` for an
  average per GPU. Model FLOPs count forward + backward (3 passes of matmuls, no
  recomputation, true vocabulary); hardware FLOPs add the recomputed forward and the padded
  vocabulary.
* Communication (`Estimate.comm_bytes`): bytes **sent per GPU per step**, ring algorithms,
  split by link class ("intra_node" NVLink, "inter_node" network) and, in
  `Estimate.comm_bytes_by_group`, by parallelism ("tp", "pp", "dp"), for the critical stage.
* Time (`Estimate.step_time_s`): seconds per optimizer step of the slowest pipeline stage
  (`Estimate.critical_stage`); `Estimate.time_breakdown` splits it.
* `bubble_fraction` is pipeline bubble time / ideal (bubble-free) time, as in Narayanan et al.
  2021 Sec. 2.2; bubble / total is `b / (1 + b)`.

Parallel layout conventions
---------------------------
* Ranks are ordered tp fastest, then dp, then pp (`rank_order="tp-dp-pp"`, Megatron-LM's
  default), or tp, pp, dp (`"tp-pp-dp"`, the order of `tplayers.init_mesh`'s ("dp", "pp", "tp")
  mesh). A group runs over the network ("inter_node") as soon as any of its groups spans two
  nodes; TP must stay within a node.
* Pipeline stages hold `layers / pp` transformer layers each; stage 0 also holds the word (and
  learned position) embedding, stage pp-1 the final norm and the LM head. Tied embeddings keep
  a second copy of the word embedding on the last stage when pp > 1 (Megatron does, and
  all-reduces the two gradients).
* The vocabulary is padded to a multiple of `Assumptions.vocab_divisible_by * tp` (Megatron's
  `--make-vocab-size-divisible-by 128`), so any tp is valid for any vocabulary.
* Key / value heads: TP needs `kv_heads % tp == 0` (heads split) or `tp % kv_heads == 0`
  (each kv head replicated on tp / kv_heads ranks, k / v weights held whole on every rank,
  their gradients all-reduced over TP), exactly what `tplayers.ParallelAttention` accepts.

What is left out (see each function): the optimizer's temporary buffers, NCCL / CUDA context
memory (covered by `Assumptions.hbm_reserve_fraction`), allocator fragmentation, the
sequence-parallel re-gather of stored inputs in backward, and layer-norm / softmax FLOPs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

__all__ = [
    "Assumptions",
    "ClusterSpec",
    "Estimate",
    "ESTIMATE_FIELDS",
    "Layout",
    "MemoryBreakdown",
    "ModelSpec",
    "ParamCounts",
    "Precision",
    "StageEstimate",
    "all_gather_bytes",
    "all_reduce_bytes",
    "bubble_fraction",
    "count_params",
    "dp_bytes_per_step",
    "estimate",
    "estimate_to_dict",
    "format_estimate",
    "format_ranking",
    "group_link",
    "layer_activation_bytes",
    "microbatches_in_flight",
    "model_state_bytes",
    "padded_vocab",
    "reduce_scatter_bytes",
    "search",
    "tp_bytes_per_layer",
    "training_flops",
    "validate_layout",
]

RECOMPUTE_CHOICES = ("none", "selective", "full")
SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved")
RANK_ORDER_CHOICES = ("tp-dp-pp", "tp-pp-dp")
IMPLEMENTATION_CHOICES = ("megatron", "tplayers")
NORM_CHOICES = ("rmsnorm", "layernorm")
POSITION_CHOICES = ("rope", "learned")
ZERO_STAGES = (0, 1, 2, 3)
LINK_CLASSES = ("intra_node", "inter_node")
GROUPS = ("tp", "pp", "dp")

# Dropout masks are stored as 1 byte per element (Korthikanti et al. 2022, Sec. 4.1).
MASK_BYTES = 1
# Cross-entropy keeps the logits in fp32 (Korthikanti et al. 2022, Sec. 4.3: 4sbv/t).
LOGITS_BYTES = 4
# Megatron-Core DDP's default gradient bucket: max(40M, 1M * dp) parameters.
DP_BUCKET_PARAMS = 40_000_000
DP_BUCKET_PARAMS_PER_RANK = 1_000_000
# Backward of a matmul costs two forwards (dgrad + wgrad), so it is 2/3 of fwd + bwd.
BACKWARD_SHARE = 2 / 3
GiB = 2**30


def _choice(value, choices, what: str):
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(repr(c) for c in choices)}")
    return value


def _positive_int(owner: str, name: str, value, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{owner}.{name} must be a {kind} integer, got {value!r}")


def _positive_number(owner: str, name: str, value, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{owner}.{name} must be a {kind} number, got {value!r}")


def _fraction(owner: str, name: str, value) -> None:
    _positive_number(owner, name, value, allow_zero=True)
    if value > 1:
        raise ValueError(f"{owner}.{name} must be in [0, 1], got {value!r}")


def _preset(table: dict, name: str, what: str):
    key = name.lower() if isinstance(name, str) else name
    if key not in table:
        raise ValueError(f"unknown {what} preset {name!r}; valid: {', '.join(sorted(table))}")
    return table[key]


# --------------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of the model states, and per activation element.

    Default: mixed-precision Adam (ZeRO paper, Rajbhandari et al. 2020, Sec. 3.1): fp16/bf16
    parameters (2) and gradients (2), optimizer states K = 12 (fp32 master copy 4 + momentum 4 +
    variance 4): 16 bytes per parameter.
    """

    param_bytes: float = 2
    grad_bytes: float = 2
    optimizer_bytes: float = 12
    activation_bytes: float = 2

    def __post_init__(self):
        for name in ("param_bytes", "activation_bytes"):
            _positive_number("Precision", name, getattr(self, name))
        for name in ("grad_bytes", "optimizer_bytes"):
            _positive_number("Precision", name, getattr(self, name), allow_zero=True)

    @property
    def model_state_bytes(self) -> float:
        """Bytes per parameter of params + grads + optimizer states, unsharded."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @classmethod
    def preset(cls, name: str) -> Precision:
        """A named precision recipe; see `PRECISION_PRESETS` for the list."""
        return _preset(PRECISION_PRESETS, name, "precision")


PRECISION_PRESETS = {
    # ZeRO paper Sec. 3.1: 2 + 2 + 12 (fp32 master, momentum, variance).
    "mixed-adam": Precision(2, 2, 12),
    # Same recipe counting the fp32 gradient copy among optimizer states: 2 + 2 + 16 = 20.
    "mixed-adam-fp32-grads": Precision(2, 2, 16),
    # Everything fp32: 4 params + 4 grads + 8 (momentum, variance); fp32 activations.
    "fp32-adam": Precision(4, 4, 8, activation_bytes=4),
    # bf16 params / grads and bf16 Adam states, no master copy: 2 + 2 + 4.
    "bf16-adam": Precision(2, 2, 4),
    # Plain SGD in bf16 without momentum: no optimizer state.
    "bf16-sgd": Precision(2, 2, 0),
    # Mixed-precision SGD with momentum: fp32 master 4 + momentum 4.
    "mixed-sgd-momentum": Precision(2, 2, 8),
}


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def _llama_ffn(hidden: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256 (Touvron et al. 2023)."""
    return 256 * math.ceil(8 * hidden / 3 / 256)


_DIM_FIELDS = ("layers", "hidden", "heads", "vocab", "seq_len")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, by its dimensions or only by its parameter count.

    Dimensions: `layers`, `hidden`, `heads`, `vocab`, `seq_len` (training sequence length) are
    required together; `kv_heads` defaults to `heads` (multi-head attention), `head_dim` to
    `hidden // heads`, `ffn_hidden` to 4*hidden (non-gated) or Llama's rounded 8*hidden/3
    (gated), `max_positions` to `seq_len`. These derived fields are filled in place:
    `dataclasses.replace` copies them, so pass `None` for any you want re-derived.

    `ModelSpec(num_params=N)` answers model-state questions only (params / grads / optimizer
    memory, DP traffic); activations, FLOPs and time are then `None`. With dimensions,
    `num_params` is the count derived from them (`count_params`); giving both is an error
    unless they agree.

    `dropout=True` (the default) counts dropout masks in the activations, which is Korthikanti
    et al.'s accounting; the Llama presets set it False (they train without dropout).
    """

    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    vocab: int | None = None
    seq_len: int | None = None
    gated_mlp: bool = True
    tied_embeddings: bool = False
    head_dim: int | None = None
    norm: str = "rmsnorm"
    linear_bias: bool = False
    position_embedding: str = "rope"
    max_positions: int | None = None
    dropout: bool = True
    num_params: float | None = None
    name: str | None = None

    def __post_init__(self):
        given = [f for f in _DIM_FIELDS if getattr(self, f) is not None]
        if not given:
            if self.num_params is None:
                raise ValueError("ModelSpec needs either num_params or the dimensions " + ", ".join(_DIM_FIELDS))
            _positive_number("ModelSpec", "num_params", self.num_params)
            return
        missing = [f for f in _DIM_FIELDS if getattr(self, f) is None]
        if missing:
            raise ValueError(f"ModelSpec dimensions incomplete: missing {', '.join(missing)}")
        self._resolve_dimensions()
        counted = count_params(self).total
        if self.num_params is not None and abs(self.num_params - counted) > 0.5:
            raise ValueError(
                f"ModelSpec got num_params={self.num_params:.6g} and dimensions whose parameter count is "
                f"{counted:.6g}; give one or the other (dataclasses.replace copies num_params: pass "
                "num_params=None when changing dimensions)"
            )
        object.__setattr__(self, "num_params", counted)

    def _resolve_dimensions(self) -> None:
        for name in (*_DIM_FIELDS, "kv_heads", "ffn_hidden", "head_dim", "max_positions"):
            if getattr(self, name) is not None:
                _positive_int("ModelSpec", name, getattr(self, name))
        _choice(self.norm, NORM_CHOICES, "norm")
        _choice(self.position_embedding, POSITION_CHOICES, "position_embedding")
        kv_heads = self.heads if self.kv_heads is None else self.kv_heads
        if self.heads % kv_heads:
            raise ValueError(f"ModelSpec.heads ({self.heads}) must be divisible by kv_heads ({kv_heads})")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(
                f"ModelSpec.hidden ({self.hidden}) is not divisible by heads ({self.heads}); give head_dim"
            )
        head_dim = self.hidden // self.heads if self.head_dim is None else self.head_dim
        ffn = self.ffn_hidden
        if ffn is None:
            ffn = _llama_ffn(self.hidden) if self.gated_mlp else 4 * self.hidden
        max_positions = self.seq_len if self.max_positions is None else self.max_positions
        if self.position_embedding == "learned" and self.seq_len > max_positions:
            raise ValueError(
                f"ModelSpec.seq_len ({self.seq_len}) exceeds max_positions ({max_positions}) of the learned "
                "position embedding"
            )
        for name, value in (("kv_heads", kv_heads), ("head_dim", head_dim), ("ffn_hidden", ffn)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "max_positions", max_positions)

    @property
    def has_dims(self) -> bool:
        """True when the dimensions are known (False for a `ModelSpec(num_params=...)`)."""
        return self.layers is not None

    @property
    def q_dim(self) -> int:
        """Width of the query / attention output: heads * head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the key and value projections: kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelSpec:
        """A published model; `overrides` replace fields (e.g. `seq_len=4096`)."""
        return _with_overrides(_preset(MODEL_PRESETS, name, "model"), overrides)

    @classmethod
    def from_hf_config(cls, config: str | os.PathLike | dict, **overrides) -> ModelSpec:
        """Read a HuggingFace `config.json` (a path to it, its folder, or the parsed dict).

        Llama-style keys (num_hidden_layers, hidden_size, num_attention_heads,
        num_key_value_heads, intermediate_size, head_dim) and GPT-2 style keys (n_layer,
        n_embd, n_head, n_inner, n_positions). `seq_len` is `max_positions`
        (max_position_embeddings / n_positions): pass `seq_len=` to train shorter.
        When `tie_word_embeddings` is absent it defaults as in HF's classes: True for GPT-2
        style configs, False otherwise. GPT-2 style configs and model_type gpt2 / gpt_neox /
        gptj / opt / bloom / falcon / phi / starcoder2 / gpt_bigcode are non-gated; others gated.
        """
        return _with_overrides(_spec_from_hf(_load_hf_config(config)), overrides)


def _with_overrides(spec: ModelSpec, overrides: dict) -> ModelSpec:
    """`spec` with fields replaced; the parameter count is re-derived from the dimensions."""
    if not overrides:
        return spec
    return replace(spec, **{"num_params": None, **overrides})


_NON_GATED_TYPES = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2", "gpt_bigcode"}


def _load_hf_config(config) -> dict:
    if isinstance(config, dict):
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no HuggingFace config at {str(path)!r}")
    return json.loads(path.read_text())


def _hf_get(cfg: dict, *keys, default=None):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _spec_from_hf(cfg: dict) -> ModelSpec:
    gpt2_style = "n_embd" in cfg or "n_layer" in cfg
    layers = _hf_get(cfg, "num_hidden_layers", "n_layer")
    hidden = _hf_get(cfg, "hidden_size", "n_embd")
    heads = _hf_get(cfg, "num_attention_heads", "n_head")
    vocab = _hf_get(cfg, "vocab_size")
    positions = _hf_get(cfg, "max_position_embeddings", "n_positions")
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
    return ModelSpec(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=_hf_get(cfg, "num_key_value_heads", default=heads),
        ffn_hidden=_hf_get(cfg, "intermediate_size", "n_inner", "ffn_dim", default=None if gated else 4 * hidden),
        vocab=vocab,
        seq_len=positions,
        gated_mlp=gated,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", gpt2_style)),
        head_dim=_hf_get(cfg, "head_dim"),
        norm="layernorm" if layernorm else "rmsnorm",
        linear_bias=bias,
        position_embedding="learned" if learned else "rope",
        max_positions=positions,
        dropout=dropout,
        name=cfg.get("_name_or_path") or model_type or None,
    )


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a model by block (unsharded, unpadded vocabulary)."""

    embedding: int  # word embedding (+ learned position table), on the first stage
    per_layer: int  # one transformer layer
    layers: int  # number of layers
    final_norm: int  # on the last stage
    lm_head: int  # output projection; 0 when tied to the embedding

    @property
    def total(self) -> int:
        return self.embedding + self.per_layer * self.layers + self.final_norm + self.lm_head


def _norm_params(model: ModelSpec) -> int:
    """RMSNorm has a weight; LayerNorm a weight and a bias."""
    return model.hidden * (2 if model.norm == "layernorm" else 1)


def _kv_sharded(model: ModelSpec, tp: int) -> bool:
    """kv heads split over TP (kv_heads % tp == 0), else replicated (tp % kv_heads == 0)."""
    return model.kv_heads % tp == 0


def _layer_params(model: ModelSpec, tp: int = 1) -> float:
    """Parameters of one transformer layer held by one TP rank (tp=1: the whole layer).

    Attention: q and o are h x (heads*head_dim) each, k and v h x (kv_heads*head_dim) each,
    column-parallel (q, k, v) / row-parallel (o), k / v whole when kv heads are replicated.
    MLP: 3 h x ffn matrices gated (gate, up, down), 2 non-gated. Biases: the column-parallel
    ones are sharded, the row-parallel ones (o, down) replicated. Two norms, replicated.
    """
    h, f = model.hidden, model.ffn_hidden
    kv_div = tp if _kv_sharded(model, tp) else 1
    attention = 2 * h * model.q_dim / tp + 2 * h * model.kv_dim / kv_div
    mlp_mats = 3 if model.gated_mlp else 2
    mlp = mlp_mats * h * f / tp
    bias = 0.0
    if model.linear_bias:
        column_mats = 2 if model.gated_mlp else 1  # gate and up, or fc1
        bias = model.q_dim / tp + 2 * model.kv_dim / kv_div + h + column_mats * f / tp + h
    return attention + mlp + bias + 2 * _norm_params(model)


def count_params(model: ModelSpec) -> ParamCounts:
    """Parameter count of a decoder-only LLM from its dimensions.

    Embedding V*h (+ max_positions*h for learned positions); per layer
    2*h*(heads*head_dim) + 2*h*(kv_heads*head_dim) + (3 gated | 2) * h * ffn + biases + norms;
    final norm; LM head V*h unless tied. For GPT-3 this is the 12*l*h^2 + 13*l*h + (V + s)*h
    of Narayanan et al. 2021 Sec. 5.1 (footnote) plus the final LayerNorm.
    """
    if not model.has_dims:
        raise ValueError("count_params needs the model's dimensions (this ModelSpec has num_params only)")
    h = model.hidden
    embedding = model.vocab * h + (model.max_positions * h if model.position_embedding == "learned" else 0)
    return ParamCounts(
        embedding=embedding,
        per_layer=int(_layer_params(model, 1)),
        layers=model.layers,
        final_norm=_norm_params(model),
        lm_head=0 if model.tied_embeddings else model.vocab * h,
    )


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padding: the vocabulary rounded up to a multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return multiple * math.ceil(vocab / multiple)


def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, seq_len):
    return ModelSpec(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        ffn_hidden=ffn,
        vocab=vocab,
        seq_len=seq_len,
        gated_mlp=True,
        dropout=False,
        name=name,
    )


MODEL_PRESETS = {
    # Llama 3 herd (Dubey et al. 2024, Table 3); training context 8192.
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    # Llama 2 (Touvron et al. 2023): multi-head attention at 7B, context 4096.
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    # GPT-3 175B (Brown et al. 2020, Table 2.1): GPT-2 architecture, tied embeddings,
    # learned positions, LayerNorm, biases, GeLU 4h MLP, dropout.
    "gpt3-175b": ModelSpec(
        layers=96,
        hidden=12288,
        heads=96,
        vocab=50257,
        seq_len=2048,
        gated_mlp=False,
        tied_embeddings=True,
        norm="layernorm",
        linear_bias=True,
        position_embedding="learned",
        dropout=True,
        name="gpt3-175b",
    ),
}


# --------------------------------------------------------------------------------------------
# Cluster
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs and links. Bandwidths are unidirectional bytes/s per GPU."""

    num_gpus: int
    peak_flops: float  # dense bf16 tensor-core FLOP/s per GPU
    hbm_bytes: float  # memory capacity per GPU
    hbm_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # NVLink, per GPU, one direction
    inter_node_bandwidth: float  # network, per GPU, one direction
    gpus_per_node: int = 8
    name: str = "custom"

    def __post_init__(self):
        _positive_int("ClusterSpec", "num_gpus", self.num_gpus)
        _positive_int("ClusterSpec", "gpus_per_node", self.gpus_per_node)
        for name in ("peak_flops", "hbm_bytes", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            _positive_number("ClusterSpec", name, getattr(self, name))
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"ClusterSpec.num_gpus ({self.num_gpus}) must be at most gpus_per_node ({self.gpus_per_node}) "
                "or a multiple of it"
            )

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.num_gpus / self.gpus_per_node)

    @classmethod
    def preset(cls, name: str, num_gpus: int = 8, **overrides) -> ClusterSpec:
        """A GPU type in DGX-style nodes of 8; `overrides` replace fields."""
        key = name.lower() if isinstance(name, str) else name
        key = _GPU_ALIASES.get(key, key)
        gpu = _preset(_GPU_PRESETS, key, "cluster")
        return cls(num_gpus=num_gpus, **{"name": key, **gpu, **overrides})


# Datasheet numbers. Capacities are the nominal GiB nvidia-smi shows (within ~1%).
# NVLink / network bandwidths are per GPU, one direction.
_GPU_PRESETS = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOPS dense BF16, 40GB HBM2 1,555 GB/s,
    # NVLink 600 GB/s (bidirectional -> 300e9 one way). DGX A100 user guide: 8x 200 Gb/s HDR
    # InfiniBand compute ports, one per GPU -> 25e9 B/s.
    "a100-40gb": dict(
        peak_flops=312e12,
        hbm_bytes=40 * GiB,
        hbm_bandwidth=1.555e12,
        intra_node_bandwidth=300e9,
        inter_node_bandwidth=25e9,
    ),
    # Same datasheet, 80GB HBM2e SXM: 2,039 GB/s.
    "a100-80gb": dict(
        peak_flops=312e12,
        hbm_bytes=80 * GiB,
        hbm_bandwidth=2.039e12,
        intra_node_bandwidth=300e9,
        inter_node_bandwidth=25e9,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet, SXM: 989 TFLOPS dense BF16 (1,979 with sparsity),
    # 80GB HBM3 3.35 TB/s, NVLink 900 GB/s (-> 450e9 one way). DGX H100 user guide:
    # 8x 400 Gb/s NDR ConnectX-7, one per GPU -> 50e9 B/s.
    "h100-80gb": dict(
        peak_flops=989e12,
        hbm_bytes=80 * GiB,
        hbm_bandwidth=3.35e12,
        intra_node_bandwidth=450e9,
        inter_node_bandwidth=50e9,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: same compute as H100 (989 TFLOPS dense BF16),
    # 141GB HBM3e 4.8 TB/s, NVLink 900 GB/s; DGX H200 networking as DGX H100.
    "h200": dict(
        peak_flops=989e12,
        hbm_bytes=141 * GiB,
        hbm_bandwidth=4.8e12,
        intra_node_bandwidth=450e9,
        inter_node_bandwidth=50e9,
    ),
}
_GPU_ALIASES = {"h100": "h100-80gb", "h100-sxm": "h100-80gb", "h200-141gb": "h200", "a100": "a100-80gb"}
CLUSTER_PRESETS = tuple(sorted({*_GPU_PRESETS, *_GPU_ALIASES}))


# --------------------------------------------------------------------------------------------
# Layout and assumptions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """One parallel layout: tp x pp x dp GPUs, ZeRO stage, micro-batching, recomputation.

    `micro_batch` is sequences per micro-batch per DP replica; `num_microbatches` micro-batches
    per step (gradient accumulation / pipeline), so the global batch is
    dp * micro_batch * num_microbatches sequences. `virtual_stages` (model chunks per GPU)
    only with `schedule="interleaved"`.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    num_microbatches: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    rank_order: str = "tp-dp-pp"

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "micro_batch", "num_microbatches", "virtual_stages"):
            _positive_int("Layout", name, getattr(self, name))
        if isinstance(self.zero_stage, bool) or self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"unknown zero_stage {self.zero_stage!r}; valid: 0, 1, 2, 3")
        _choice(self.recompute, RECOMPUTE_CHOICES, "recompute")
        _choice(self.schedule, SCHEDULE_CHOICES, "schedule")
        _choice(self.rank_order, RANK_ORDER_CHOICES, "rank_order")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.dp * self.micro_batch * self.num_microbatches

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}", f"zero={self.zero_stage}"]
        parts.append(f"mb={self.micro_batch}x{self.num_microbatches}")
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(f"recompute={self.recompute}")
        if self.pp > 1:
            v = f"(v={self.virtual_stages})" if self.schedule == "interleaved" else ""
            parts.append(f"{self.schedule}{v}")
        return " ".join(parts)


@dataclass(frozen=True)
class Assumptions:
    """Knobs of the time and memory model that are assumptions, not measurements.

    compute_efficiency: achieved / peak FLOP/s of the matmuls (0.5: Megatron-LM reaches 44-52%
        of A100 peak on 1.7B-1T GPT models, Narayanan et al. 2021 Table 1).
    tp_comm_overlap, pp_comm_overlap: fraction of TP / PP communication time hidden behind
        compute (0: exposed, Megatron's behaviour without its overlap options).
    overlap_dp_comm: DP gradient reduction overlaps the backward pass, except the last bucket
        (`DP_BUCKET_PARAMS`) and whatever does not fit behind the backward of the last
        micro-batch (ZeRO 0/1) or behind all compute (ZeRO 2/3, reduced every micro-batch).
    hbm_reserve_fraction: HBM kept out of reach for the CUDA context, NCCL buffers and
        allocator fragmentation; `fits` means total <= hbm_bytes * (1 - reserve).
    vocab_divisible_by: Megatron's vocabulary padding multiple (times tp).
    implementation: whose layers the model's edges follow; the transformer layers are priced
        alike. "megatron" (Megatron-LM, the published accounting): the cross-entropy
        all-reduces three s*b fp32 vectors and keeps fp32 logits; under sequence parallelism the
        embedding reduce-scatters and the LM head all-gathers. "tplayers" (what
        `tplayers.parallelize` + `vocab_parallel_cross_entropy` do, checked by
        `tplayers.plan_validate`): the cross-entropy all-gathers 4 fp32 statistics per row and
        keeps the logits in the activation dtype; under sequence parallelism the embedding
        all-reduces, the first block keeps its sequence slice (an all-gather in backward), the
        last block's output is all-gathered (the final norm and LM head see the whole
        sequence), and column-parallel layers keep their all-gathered input for the weight
        gradient instead of re-gathering it.
    """

    compute_efficiency: float = 0.5
    tp_comm_overlap: float = 0.0
    pp_comm_overlap: float = 0.0
    overlap_dp_comm: bool = True
    hbm_reserve_fraction: float = 0.1
    vocab_divisible_by: int = 128
    implementation: str = "megatron"

    def __post_init__(self):
        _positive_number("Assumptions", "compute_efficiency", self.compute_efficiency)
        if self.compute_efficiency > 1:
            raise ValueError(f"Assumptions.compute_efficiency must be in (0, 1], got {self.compute_efficiency!r}")
        for name in ("tp_comm_overlap", "pp_comm_overlap", "hbm_reserve_fraction"):
            _fraction("Assumptions", name, getattr(self, name))
        _positive_int("Assumptions", "vocab_divisible_by", self.vocab_divisible_by)
        _choice(self.implementation, IMPLEMENTATION_CHOICES, "implementation")


# --------------------------------------------------------------------------------------------
# Formulas
# --------------------------------------------------------------------------------------------


def model_state_bytes(num_params: float, precision: Precision | None = None, *, zero_stage: int = 0, dp: int = 1):
    """(params, grads, optimizer) bytes per GPU for `num_params` parameters on one model replica slice.

    ZeRO paper (Rajbhandari et al. 2020), Sec. 3.1 and Figure 1: unsharded (2 + 2 + K) * psi;
    stage 1 (P_os) shards the optimizer states over the dp ranks, stage 2 (P_os+g) also the
    gradients, stage 3 (P_os+g+p) also the parameters:
        params = psi * param_bytes / (dp if stage >= 3 else 1)
        grads = psi * grad_bytes / (dp if stage >= 2 else 1)
        optimizer = psi * optimizer_bytes / (dp if stage >= 1 else 1)
    E.g. psi = 7.5e9, dp = 64, K = 12: 120, 31.4, 16.6, 1.9 GB for stages 0-3.
    """
    precision = Precision() if precision is None else precision
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"unknown zero_stage {zero_stage!r}; valid: 0, 1, 2, 3")
    _positive_int("model_state_bytes", "dp", dp)
    params = num_params * precision.param_bytes / (dp if zero_stage >= 3 else 1)
    grads = num_params * precision.grad_bytes / (dp if zero_stage >= 2 else 1)
    optimizer = num_params * precision.optimizer_bytes / (dp if zero_stage >= 1 else 1)
    return params, grads, optimizer


def _local_kv_heads(model: ModelSpec, tp: int) -> float:
    return model.kv_heads / tp if _kv_sharded(model, tp) else 1


def layer_activation_bytes(
    model: ModelSpec,
    micro_batch: int = 1,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    activation_bytes: float = 2,
    implementation: str = "megatron",
) -> float:
    """Activation bytes one transformer layer stores per micro-batch on one TP rank.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    Sec. 4 and Table 2 (s = seq_len, b = micro_batch, h = hidden, a = heads, t = tp; 16-bit
    activations, 1-byte dropout masks):
        no parallelism         s*b*h*(34 + 5*a*s/h)
        tensor parallel        s*b*h*(10 + 24/t + 5*a*s/(h*t))
        TP + sequence parallel s*b*h/t*(34 + 5*a*s/h)
        selective recompute    drops the 5*a*s/h term (FlashAttention stores the same)
        full recompute         2*s*b*h (the layer input; /t with sequence parallelism)

    Generalisation (d = activation_bytes, m = 1 if dropout else 0, q = heads*head_dim,
    k = local kv heads * head_dim, f = ffn_hidden). Outside the TP region (/t only with SP):
    the two norm inputs, the QKV input, the MLP input (4 d) and two dropout masks (2 m), i.e.
    Korthikanti's 10. Inside (per rank): Q, the attention output (2 d q / t), K and V (2 d k),
    the MLP intermediates: non-gated GeLU input and output (2 d f / t), gated gate and up
    outputs and their product (3 d f / t, a fused SwiGLU as in Megatron), i.e. Korthikanti's 24
    for q = k*t = h, f = 4h. Attention core per local head: softmax output d*s^2*b, plus its
    dropout mask and dropout output (m + d)*s^2*b when dropout, i.e. 5*a*s^2*b.

    implementation="tplayers" with sequence parallelism: the QKV and MLP inputs are kept
    all-gathered (whole sequence, not /t) for the weight gradients (see `Assumptions`).
    """
    if not model.has_dims:
        raise ValueError("activation memory needs the model's dimensions (this ModelSpec has num_params only)")
    _choice(recompute, RECOMPUTE_CHOICES, "recompute")
    _choice(implementation, IMPLEMENTATION_CHOICES, "implementation")
    s, b, h = model.seq_len, micro_batch, model.hidden
    d = activation_bytes
    sp_div = tp if sequence_parallel else 1
    if recompute == "full":
        return d * s * b * h / sp_div
    mask = MASK_BYTES if model.dropout else 0
    outside = (4 * d + 2 * mask) * s * b * h / sp_div
    if implementation == "tplayers" and sequence_parallel:  # the gathered QKV and MLP inputs
        outside += 2 * d * s * b * h * (1 - 1 / sp_div)
    mlp_tensors = 3 if model.gated_mlp else 2
    inside = d * s * b * (2 * model.q_dim / tp + 2 * _local_kv_heads(model, tp) * model.head_dim)
    inside += d * s * b * mlp_tensors * model.ffn_hidden / tp
    if recompute == "selective":
        return outside + inside
    core_bytes = d + (mask + d if model.dropout else 0)
    core = core_bytes * (model.heads / tp) * s * s * b
    return outside + inside + core


def _embedding_activation_bytes(model: ModelSpec, micro_batch: int, tp: int, sp: bool) -> float:
    """Input embedding: its dropout mask, s*b*h (/t with SP) bytes (Korthikanti Sec. 4.3)."""
    if not model.dropout:
        return 0.0
    return MASK_BYTES * model.seq_len * micro_batch * model.hidden / (tp if sp else 1)


def _output_activation_bytes(
    model: ModelSpec, micro_batch: int, tp: int, sp: bool, d: float, vocab: int, implementation: str = "megatron"
) -> float:
    """Output layer: final-norm input and projection input (2*d*s*b*h, /t with SP) and the fp32
    logits 4*s*b*V/t kept by the cross-entropy: Korthikanti Sec. 4.3, 4*s*b*h/t*(1 + V/h).
    tplayers: the final norm and LM head see the whole sequence, the logits are kept in d bytes."""
    s, b = model.seq_len, micro_batch
    if implementation == "tplayers":
        return 2 * d * s * b * model.hidden + d * s * b * vocab / tp
    return 2 * d * s * b * model.hidden / (tp if sp else 1) + LOGITS_BYTES * s * b * vocab / tp


def microbatches_in_flight(schedule: str, stage: int, pp: int, num_microbatches: int, virtual_stages: int = 1):
    """Micro-batches (in units of a whole stage's layers) whose activations a stage holds at peak.

    GPipe: all m forwards run before any backward. 1F1B (Narayanan et al. 2021 Sec. 2.2.1):
    stage i runs pp - i warm-up forwards, so min(pp - i, m); stage 0 holds pp micro-batches of
    layers/pp layers = all L layers' worth (Korthikanti Sec. 4.2.3). Interleaved: Megatron's
    warm-up of 2*(pp - i - 1) + (v - 1)*pp chunk forwards, +1, each chunk 1/v of the stage;
    for stage 0 that is L*(1 + (pp - 1)/(pp*v)) layers, Korthikanti Sec. 4.2.3.
    """
    m, v = num_microbatches, virtual_stages
    if pp == 1:  # no pipeline: plain gradient accumulation, one micro-batch at a time
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(pp - stage, m))
    chunks = min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v)
    return chunks / v


def bubble_fraction(pp: int, num_microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Pipeline bubble time / ideal time, Narayanan et al. 2021 Sec. 2.2.

    GPipe and 1F1B: (p - 1)/m (Sec. 2.2.1); interleaved with v model chunks per GPU:
    (p - 1)/(v*m) (Sec. 2.2.2). As a fraction of the total step: b / (1 + b).
    """
    _choice(schedule, SCHEDULE_CHOICES, "schedule")
    v = virtual_stages if schedule == "interleaved" else 1
    return (pp - 1) / (v * num_microbatches)


@dataclass(frozen=True)
class _TokenFlops:
    """Forward matmul FLOPs per token: dense part and attention core of one layer, and logits."""

    layer_dense: float
    layer_attention: float
    logits: float

    @property
    def layer(self) -> float:
        return self.layer_dense + self.layer_attention


def _forward_flops_per_token(model: ModelSpec, vocab: int | None = None) -> _TokenFlops:
    """2 FLOPs per multiply-add. Per layer: QKV 2*h*(q + 2k), attention scores and
    attention over values 2*s*q each (no causal discount, as Narayanan eq. 3), output 2*q*h,
    MLP 2*h*f*(3 gated | 2). Logits 2*h*V. GPT (q = k = h, f = 4h): 24h^2 + 4sh per layer."""
    h, q = model.hidden, model.q_dim
    dense = 2 * h * (q + 2 * model.kv_dim) + 2 * q * h + 2 * h * model.ffn_hidden * (3 if model.gated_mlp else 2)
    attention = 4 * model.seq_len * q
    return _TokenFlops(dense, attention, 2 * h * (model.vocab if vocab is None else vocab))


def _recompute_flops_per_token(flops: _TokenFlops, recompute: str) -> float:
    """Extra forward FLOPs per token per layer: full recompute reruns the layer's forward,
    selective only the attention core (Korthikanti et al. 2022 Sec. 5)."""
    return {"none": 0.0, "selective": flops.layer_attention, "full": flops.layer}[recompute]


def training_flops(model: ModelSpec, global_batch: int, recompute: str = "none", *, vocab: int | None = None) -> float:
    """Matmul FLOPs of one training step (whole job): 3 passes (forward, backward = 2x forward),
    plus the recomputed forward.

    Narayanan et al. 2021, Sec. 5.1, eq. 3, with full recomputation (4 passes of the layers,
    3 of the logit layer), B = global_batch sequences:
        F = 96*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h))
    without recomputation (model FLOPs, 3 passes everywhere):
        F = 72*B*s*l*h^2 * (1 + s/(6h) + V/(12*l*h))
    Generalised to GQA / gated MLPs through `_forward_flops_per_token`.
    """
    _choice(recompute, RECOMPUTE_CHOICES, "recompute")
    if not model.has_dims:
        raise ValueError("FLOPs need the model's dimensions (this ModelSpec has num_params only)")
    per_token = _forward_flops_per_token(model, vocab)
    passes = 3 * (model.layers * per_token.layer + per_token.logits)
    extra = model.layers * _recompute_flops_per_token(per_token, recompute)
    return float(global_batch * model.seq_len * (passes + extra))


def all_reduce_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `size` bytes: 2*(n-1)/n * size."""
    return 2 * (n - 1) / n * size


def all_gather_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-gather whose output is `size` bytes: (n-1)/n * size."""
    return (n - 1) / n * size


def reduce_scatter_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter of a `size`-byte input: (n-1)/n * size."""
    return (n - 1) / n * size


def dp_bytes_per_step(params: float, dp: int, zero_stage: int, num_microbatches: int, precision: Precision) -> float:
    """Data-parallel bytes sent per GPU per step for `params` local parameters.

    ZeRO paper Sec. 7: stage 0 all-reduces the gradients once per step (2*psi); stages 1-2
    reduce-scatter gradients and all-gather parameters (same 2*psi); stage 3 all-gathers the
    parameters in forward and again in backward (3*psi, 1.5x). Sharded gradients cannot be
    accumulated locally, so stage 2 reduce-scatters every micro-batch and stage 3 gathers and
    reduces every micro-batch (m = num_microbatches; with m = 1 these are the paper's ratios).
    """
    grads, weights = params * precision.grad_bytes, params * precision.param_bytes
    m = num_microbatches
    if zero_stage == 0:
        return all_reduce_bytes(grads, dp)
    if zero_stage == 1:
        return reduce_scatter_bytes(grads, dp) + all_gather_bytes(weights, dp)
    if zero_stage == 2:
        return m * reduce_scatter_bytes(grads, dp) + all_gather_bytes(weights, dp)
    return m * (reduce_scatter_bytes(grads, dp) + 2 * all_gather_bytes(weights, dp))


def tp_bytes_per_layer(model: ModelSpec, micro_batch: int, tp: int, recompute: str, activation_bytes: float) -> float:
    """TP bytes sent per GPU per layer per micro-batch.

    Megatron (Shoeybi et al. 2019, Sec. 3): two all-reduces of the s*b*h activations in the
    forward (after attention and after the MLP) and two in the backward. With sequence
    parallelism each becomes an all-gather + reduce-scatter pair, the same bytes (Korthikanti
    Sec. 4.2.2; the extra backward re-gather of the stored sharded input is not counted).
    Full recomputation repeats the forward's two.
    """
    size = model.seq_len * micro_batch * model.hidden * activation_bytes
    collectives = 4 + (2 if recompute == "full" else 0)
    return collectives * all_reduce_bytes(size, tp)


def group_link(cluster: ClusterSpec, layout: Layout, group: str) -> str:
    """The link class of `group` ("tp" | "pp" | "dp"): "intra_node" if each of its groups lies
    within one node, else "inter_node".

    Ranks are ordered by `layout.rank_order` (fastest first); a group of size n and stride
    (product of the faster sizes) lies within nodes iff gpus_per_node is a multiple of n*stride.
    """
    _choice(group, GROUPS, "group")
    sizes = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}
    order = layout.rank_order.split("-")
    stride = math.prod(sizes[g] for g in order[: order.index(group)])
    n = sizes[group]
    if n == 1 or cluster.num_gpus <= cluster.gpus_per_node:
        return "intra_node"
    return "intra_node" if cluster.gpus_per_node % (n * stride) == 0 else "inter_node"


def _link_bandwidth(cluster: ClusterSpec, link: str) -> float:
    return cluster.intra_node_bandwidth if link == "intra_node" else cluster.inter_node_bandwidth


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def validate_layout(
    model: ModelSpec, cluster: ClusterSpec, layout: Layout, *, global_batch: int | None = None
) -> list[str]:
    """Reasons `layout` cannot run `model` on `cluster` (empty when it can).

    Checks the GPU count, TP within a node, head / kv-head / ffn / layer divisibility, the
    interleaved schedule's requirements, sequence parallelism's seq_len % tp, and (with
    `global_batch`) dp * micro_batch * num_microbatches == global_batch. Vocabulary size is
    never a reason: it is padded (see the module docstring).
    """
    reasons = []
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    if layout.num_gpus != cluster.num_gpus:
        reasons.append(f"tp*pp*dp = {tp}*{pp}*{dp} = {layout.num_gpus} != {cluster.num_gpus} GPUs in the cluster")
    if tp > cluster.gpus_per_node:
        reasons.append(f"tp={tp} > {cluster.gpus_per_node} GPUs per node: tensor parallelism must stay within a node")
    elif cluster.num_gpus > cluster.gpus_per_node and cluster.gpus_per_node % tp:
        reasons.append(
            f"tp={tp} does not divide {cluster.gpus_per_node} GPUs per node: some TP groups would span two nodes"
        )
    if global_batch is not None and layout.global_batch != global_batch:
        reasons.append(
            f"dp*micro_batch*num_microbatches = {dp}*{layout.micro_batch}*{layout.num_microbatches} = "
            f"{layout.global_batch} != global batch {global_batch}"
        )
    v = layout.virtual_stages
    if layout.schedule == "interleaved":
        if pp < 2:
            reasons.append(f"the interleaved schedule needs pp >= 2, got pp={pp}")
        if v < 2:
            reasons.append(f"the interleaved schedule needs virtual_stages >= 2, got {v}")
        if layout.num_microbatches % pp:
            reasons.append(
                f"num_microbatches ({layout.num_microbatches}) not divisible by pp ({pp}) "
                "(the interleaved schedule runs micro-batches in groups of pp)"
            )
    elif v != 1:
        reasons.append(f"virtual_stages={v} needs schedule='interleaved', got {layout.schedule!r}")
    if model.has_dims:
        reasons += _model_reasons(model, layout)
    return reasons


def _model_reasons(model: ModelSpec, layout: Layout) -> list[str]:
    tp, pp, v = layout.tp, layout.pp, layout.virtual_stages
    reasons = []
    if model.heads % tp:
        reasons.append(f"heads ({model.heads}) not divisible by tp ({tp})")
    if model.kv_heads % tp and tp % model.kv_heads:
        reasons.append(
            f"kv_heads ({model.kv_heads}) and tp ({tp}): one must divide the other "
            "(kv heads split over the ranks, or each replicated on tp/kv_heads ranks)"
        )
    if model.ffn_hidden % tp:
        reasons.append(f"ffn_hidden ({model.ffn_hidden}) not divisible by tp ({tp})")
    if model.layers % pp:
        reasons.append(f"layers ({model.layers}) not divisible by pp ({pp})")
    elif layout.schedule == "interleaved" and model.layers % (pp * v):
        reasons.append(f"layers ({model.layers}) not divisible by pp*virtual_stages ({pp}*{v} = {pp * v})")
    if layout.sequence_parallel and model.seq_len % tp:
        reasons.append(f"sequence parallelism: seq_len ({model.seq_len}) not divisible by tp ({tp})")
    return reasons


# --------------------------------------------------------------------------------------------
# Estimate
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on pipeline stage `stage`.

    `activations` is None when the model is given by its parameter count only; `total` then
    counts the model states alone. `buffers`: ZeRO-3's gathered copy of the largest unit
    (a layer, or the embedding / LM head) during its forward / backward.
    """

    params: float
    grads: float
    optimizer: float
    activations: float | None
    buffers: float = 0.0
    stage: int = 0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + (self.activations or 0.0) + self.buffers


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline stage, per GPU: memory, parameters, per-step comm bytes and time parts."""

    stage: int
    num_params: float  # parameters held by one GPU before ZeRO sharding (after TP)
    memory: MemoryBreakdown
    hardware_flops: float | None  # per GPU per step
    comm_bytes_by_group: dict[str, float | None]  # "tp" | "pp" | "dp" -> bytes per GPU per step
    time_breakdown: dict[str, float] | None  # seconds: compute, bubble, tp, pp, dp, optimizer

    @property
    def step_time_s(self) -> float | None:
        return None if self.time_breakdown is None else sum(self.time_breakdown.values())


@dataclass(frozen=True)
class Estimate:
    """The estimate of one layout; see the module docstring for per-GPU / per-job conventions.

    Invalid layouts (`valid` False) carry their `reasons` and None for every number.
    """

    layout: Layout
    num_gpus: int
    num_params: float
    usable_hbm_bytes: float
    reasons: tuple[str, ...]
    valid: bool
    memory: MemoryBreakdown | None = None
    stages: tuple[StageEstimate, ...] = ()
    model_flops: float | None = None  # per step, whole job, no recompute
    hardware_flops: float | None = None  # per step, whole job, with recompute and padded vocab
    bubble_fraction: float | None = None  # bubble / ideal time
    comm_bytes: dict[str, float] | None = None  # link class -> bytes sent per GPU per step
    comm_bytes_by_group: dict[str, float | None] | None = None  # "tp" | "pp" | "dp" -> bytes
    comm_links: dict[str, str] | None = None  # "tp" | "pp" | "dp" -> link class
    critical_stage: int | None = None
    time_breakdown: dict[str, float] | None = None
    step_time_s: float | None = None
    mfu: float | None = None
    tokens_per_step: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """Valid and memory.total <= usable HBM (capacity * (1 - reserve))."""
        return self.valid and self.memory is not None and self.memory.total <= self.usable_hbm_bytes

    @property
    def tokens_per_s(self) -> float | None:
        if self.step_time_s is None or self.tokens_per_step is None:
            return None
        return self.tokens_per_step / self.step_time_s


@dataclass(frozen=True)
class _Context:
    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    precision: Precision
    assumptions: Assumptions

    @property
    def vocab(self) -> int:
        return padded_vocab(self.model.vocab, self.layout.tp, self.assumptions.vocab_divisible_by)


def _stage_params(ctx: _Context, stage: int) -> float:
    """Parameters one GPU of `stage` holds after TP sharding (before ZeRO).

    A count-only model splits evenly: num_params / (tp*pp)."""
    model, layout = ctx.model, ctx.layout
    if not model.has_dims:
        return model.num_params / (layout.tp * layout.pp)
    tp, pp = layout.tp, layout.pp
    word = ctx.vocab * model.hidden / tp
    params = model.layers // pp * _layer_params(model, tp)
    if stage == 0:
        params += word + (model.max_positions * model.hidden if model.position_embedding == "learned" else 0)
    if stage == pp - 1:
        params += _norm_params(model)
        if not model.tied_embeddings or pp > 1:
            params += word
    return params


def _zero3_buffer(ctx: _Context, stage: int) -> float:
    """ZeRO-3 gathers one unit at a time: the largest of a layer, the embedding, the LM head."""
    model, layout = ctx.model, ctx.layout
    if layout.zero_stage < 3 or layout.dp == 1 or not model.has_dims:
        return 0.0
    units = [_layer_params(model, layout.tp)]
    if stage in (0, layout.pp - 1):
        units.append(ctx.vocab * model.hidden / layout.tp)
    return max(units) * ctx.precision.param_bytes


def _stage_activations(ctx: _Context, stage: int) -> float | None:
    """Peak activation bytes of one GPU of `stage` (see `layer_activation_bytes`).

    layers_per_stage * micro-batches in flight * per-layer bytes, plus, during the backward of a
    recomputed layer, that layer's rematerialised activations (once); stage 0 adds the embedding
    dropout mask per micro-batch in flight (Korthikanti's s*b*h*p/t, min(p, m) for 1F1B), the
    last stage the output layer and fp32 logits per micro-batch in flight."""
    model, layout, precision = ctx.model, ctx.layout, ctx.precision
    if not model.has_dims:
        return None
    kw = dict(
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        activation_bytes=precision.activation_bytes,
        implementation=ctx.assumptions.implementation,
    )
    mb, tp, sp, pp, m = layout.micro_batch, layout.tp, layout.sequence_parallel, layout.pp, layout.num_microbatches
    per_layer = layer_activation_bytes(model, mb, recompute=layout.recompute, **kw)
    layers_per_stage = model.layers // pp
    in_flight = microbatches_in_flight(layout.schedule, stage, pp, m, layout.virtual_stages)
    total = layers_per_stage * in_flight * per_layer
    total += layer_activation_bytes(model, mb, recompute="none", **kw) - per_layer
    micro_batches_held = m if layout.schedule == "gpipe" else min(pp - stage, m)
    if stage == 0:
        total += micro_batches_held * _embedding_activation_bytes(model, mb, tp, sp)
    if stage == pp - 1:
        out = _output_activation_bytes(
            model, mb, tp, sp, precision.activation_bytes, ctx.vocab, ctx.assumptions.implementation
        )
        total += micro_batches_held * out
    return total


def _stage_memory(ctx: _Context, stage: int, params: float) -> MemoryBreakdown:
    layout = ctx.layout
    p, g, o = model_state_bytes(params, ctx.precision, zero_stage=layout.zero_stage, dp=layout.dp)
    return MemoryBreakdown(p, g, o, _stage_activations(ctx, stage), _zero3_buffer(ctx, stage), stage)


def _stage_flops_per_microbatch(ctx: _Context, stage: int) -> float:
    """Hardware matmul FLOPs of one GPU of `stage` for one micro-batch (fwd + bwd + recompute)."""
    model, layout = ctx.model, ctx.layout
    per_token = _forward_flops_per_token(model, ctx.vocab)
    layer = 3 * per_token.layer + _recompute_flops_per_token(per_token, layout.recompute)
    flops = model.layers // layout.pp * layer
    if stage == layout.pp - 1:
        flops += 3 * per_token.logits
    return flops * model.seq_len * layout.micro_batch / layout.tp


def _stage_tp_bytes_per_microbatch(ctx: _Context, stage: int) -> float:
    """TP bytes per GPU per micro-batch: the layers' collectives (`tp_bytes_per_layer`), plus,
    when tp > kv_heads, the all-reduce of the replicated k / v weights' (and biases') gradients
    in each backward (as `tplayers.ParallelAttention` does); under sequence parallelism the
    all-reduce of the gradients of the replicated weights that saw a sequence slice (the two
    norms; Megatron also its row-parallel biases); the vocab-parallel embedding's forward
    all-reduce (stage 0); the LM head's backward all-reduce and the cross-entropy's three
    all-reduces of s*b fp32 values (last stage). These weight gradients are all-reduced as
    autograd produces them, in the parameter's dtype (param_bytes). `Assumptions.implementation`
    "tplayers": the cross-entropy all-gathers 4 fp32 statistics per row instead, and under
    sequence parallelism the first block's entry (backward) and the last block's exit (forward)
    each all-gather s*b*h."""
    model, layout = ctx.model, ctx.layout
    tp, mb, d = layout.tp, layout.micro_batch, ctx.precision.activation_bytes
    if tp == 1:
        return 0.0
    tplayers = ctx.assumptions.implementation == "tplayers"
    sbh = model.seq_len * mb * model.hidden * d
    per_layer = tp_bytes_per_layer(model, mb, tp, layout.recompute, d)
    grad_bytes = ctx.precision.param_bytes
    if not _kv_sharded(model, tp):
        kv_params = 2 * model.kv_dim * (model.hidden + (1 if model.linear_bias else 0))
        per_layer += all_reduce_bytes(kv_params * grad_bytes, tp)
    if layout.sequence_parallel:
        seq_sliced = 2 * _norm_params(model) + (2 * model.hidden if model.linear_bias and not tplayers else 0)
        per_layer += all_reduce_bytes(seq_sliced * grad_bytes, tp)
    total = model.layers // layout.pp * per_layer
    sp_edge = all_gather_bytes(sbh, tp) if tplayers and layout.sequence_parallel else 0.0
    rows = model.seq_len * mb
    if stage == 0:
        total += all_reduce_bytes(sbh, tp) + sp_edge
    if stage == layout.pp - 1:
        if tplayers:
            cross_entropy = all_gather_bytes(tp * rows * 4 * 4, tp)  # every rank's (rows, 4) fp32
        else:
            cross_entropy = 3 * all_reduce_bytes(rows * LOGITS_BYTES, tp)
        total += all_reduce_bytes(sbh, tp) + sp_edge + cross_entropy
    return total


def _stage_pp_bytes_per_microbatch(ctx: _Context, stage: int) -> float:
    """Point-to-point bytes one GPU sends per micro-batch: the s*b*h activation to the next
    stage and its gradient to the previous, split over the TP ranks (Narayanan et al. 2021
    Sec. 4.1, scatter/gather optimisation); v sends each way per micro-batch when interleaved."""
    model, layout = ctx.model, ctx.layout
    pp, v = layout.pp, layout.virtual_stages
    if pp == 1:
        return 0.0
    size = model.seq_len * layout.micro_batch * model.hidden * ctx.precision.activation_bytes / layout.tp
    forward_sends = v - (1 if stage == pp - 1 else 0)
    backward_sends = v - (1 if stage == 0 else 0)
    return (forward_sends + backward_sends) * size


def _dp_exposed_time(ctx: _Context, dp_time: float, params: float, compute_per_mb: float) -> float:
    """DP time not hidden by compute (see `Assumptions.overlap_dp_comm`)."""
    layout = ctx.layout
    if not ctx.assumptions.overlap_dp_comm or dp_time == 0:
        return dp_time
    if layout.zero_stage >= 2:
        hideable = layout.num_microbatches * compute_per_mb
    else:
        hideable = BACKWARD_SHARE * compute_per_mb
    bucket = max(DP_BUCKET_PARAMS, DP_BUCKET_PARAMS_PER_RANK * layout.dp)
    last_bucket = dp_time * min(1.0, bucket / params)
    return min(dp_time, max(dp_time - hideable, last_bucket))


def _optimizer_time(ctx: _Context, params: float) -> float:
    """The optimizer step is HBM-bound: it reads and writes its states (2x optimizer bytes),
    reads the gradients and writes the parameters, for its 1/dp share under ZeRO >= 1."""
    precision, layout = ctx.precision, ctx.layout
    local = params / (layout.dp if layout.zero_stage >= 1 else 1)
    touched = local * (2 * precision.optimizer_bytes + precision.grad_bytes + precision.param_bytes)
    return touched / ctx.cluster.hbm_bandwidth


def _stage_estimate(ctx: _Context, stage: int, links: dict[str, str], bubble: float) -> StageEstimate:
    model, layout, cluster = ctx.model, ctx.layout, ctx.cluster
    params = _stage_params(ctx, stage)
    memory = _stage_memory(ctx, stage, params)
    dp_bytes = dp_bytes_per_step(params, layout.dp, layout.zero_stage, layout.num_microbatches, ctx.precision)
    m = layout.num_microbatches
    if not model.has_dims:
        comm = {"tp": None, "pp": None, "dp": dp_bytes}
        return StageEstimate(stage, params, memory, None, comm, None)
    flops_mb = _stage_flops_per_microbatch(ctx, stage)
    tp_mb = _stage_tp_bytes_per_microbatch(ctx, stage)
    pp_mb = _stage_pp_bytes_per_microbatch(ctx, stage)
    comm = {"tp": m * tp_mb, "pp": m * pp_mb, "dp": dp_bytes}
    assume = ctx.assumptions
    compute_mb = flops_mb / (cluster.peak_flops * assume.compute_efficiency)
    tp_time_mb = tp_mb / _link_bandwidth(cluster, links["tp"]) * (1 - assume.tp_comm_overlap)
    pp_time_mb = pp_mb / _link_bandwidth(cluster, links["pp"]) * (1 - assume.pp_comm_overlap)
    dp_time = dp_bytes / _link_bandwidth(cluster, links["dp"])
    times = {
        "compute": m * compute_mb,
        "tp": m * tp_time_mb,
        "pp": m * pp_time_mb,
        "bubble": bubble * m * (compute_mb + tp_time_mb + pp_time_mb),
        "dp": _dp_exposed_time(ctx, dp_time, params, compute_mb),
        "optimizer": _optimizer_time(ctx, params),
    }
    return StageEstimate(stage, params, memory, m * flops_mb, comm, times)


def estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    layout: Layout,
    precision: Precision | None = None,
    *,
    assumptions: Assumptions | None = None,
) -> Estimate:
    """Memory, FLOPs, communication and step time of `layout` (see the module docstring).

    An invalid layout (GPU count, divisibility, TP across nodes, schedule rules: see
    `validate_layout`) is bad input: ValueError listing every reason. One that is valid but
    does not fit in memory comes back with its numbers, `fits=False` and a reason naming the
    bytes needed and available. `precision` is a `Precision` or a preset name.
    """
    est = _estimate(model, cluster, layout, precision, assumptions)
    if not est.valid:
        raise ValueError(f"invalid layout {layout.describe()}: " + "; ".join(est.reasons))
    return est


def _estimate(model, cluster, layout, precision, assumptions) -> Estimate:
    """`estimate`, returning an invalid layout as `valid=False` with its reasons (for `search`)."""
    precision = _resolve_precision(precision)
    assumptions = Assumptions() if assumptions is None else assumptions
    usable = cluster.hbm_bytes * (1 - assumptions.hbm_reserve_fraction)
    base = dict(layout=layout, num_gpus=cluster.num_gpus, num_params=model.num_params, usable_hbm_bytes=usable)
    invalid = validate_layout(model, cluster, layout)
    if invalid:
        return Estimate(**base, reasons=tuple(invalid), valid=False)
    ctx = _Context(model, cluster, layout, precision, assumptions)
    links = {g: group_link(cluster, layout, g) for g in GROUPS}
    bubble = bubble_fraction(layout.pp, layout.num_microbatches, layout.schedule, layout.virtual_stages)
    stages = tuple(_stage_estimate(ctx, i, links, bubble) for i in range(layout.pp))
    memory = max((s.memory for s in stages), key=lambda mem: mem.total)
    reasons, notes = [], []
    if memory.total > usable:
        reasons.append(
            f"needs {memory.total / 1e9:.1f} GB per GPU (stage {memory.stage}) > {usable / 1e9:.1f} GB usable "
            f"of {cluster.hbm_bytes / 1e9:.1f} GB ({cluster.hbm_bytes / GiB:.0f} GiB) on {cluster.name}"
        )
    timed = model.has_dims
    critical = max(stages, key=lambda s: s.step_time_s) if timed else stages[0]
    if not timed:
        notes.append("model given by num_params only: activations, FLOPs, TP/PP traffic and time unknown")
    comm = _by_link(critical.comm_bytes_by_group, links)
    tokens = layout.global_batch * model.seq_len if timed else None
    model_flops = training_flops(model, layout.global_batch) if timed else None
    hardware_flops = sum(s.hardware_flops for s in stages) * layout.dp * layout.tp if timed else None
    step = critical.step_time_s
    mfu = model_flops / (step * cluster.num_gpus * cluster.peak_flops) if timed else None
    return Estimate(
        **base,
        reasons=tuple(reasons),
        valid=True,
        memory=memory,
        stages=stages,
        model_flops=model_flops,
        hardware_flops=hardware_flops,
        bubble_fraction=bubble,
        comm_bytes=comm,
        comm_bytes_by_group=dict(critical.comm_bytes_by_group),
        comm_links=links,
        critical_stage=critical.stage,
        time_breakdown=critical.time_breakdown,
        step_time_s=step,
        mfu=mfu,
        tokens_per_step=tokens,
        notes=tuple(notes),
    )


def _resolve_precision(precision) -> Precision:
    if precision is None:
        return Precision()
    if isinstance(precision, str):
        return Precision.preset(precision)
    if not isinstance(precision, Precision):
        raise ValueError(f"precision must be a Precision or a preset name, got {precision!r}")
    return precision


def _by_link(by_group: dict[str, float | None], links: dict[str, str]) -> dict[str, float]:
    """Bytes per link class from bytes per group (unknown groups count as 0)."""
    out = dict.fromkeys(LINK_CLASSES, 0.0)
    for group, nbytes in by_group.items():
        out[links[group]] += nbytes or 0.0
    return out


# --------------------------------------------------------------------------------------------
# Search
# --------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidate_layouts(cluster: ClusterSpec, global_batch: int, include_invalid: bool, options: dict):
    """Every layout of the option grid, skipping equivalent duplicates: ZeRO stages with dp = 1,
    schedules with pp = 1, sequence parallelism with tp = 1."""
    n = cluster.num_gpus
    tps = options["tp_sizes"] or [d for d in _divisors(n) if d <= cluster.gpus_per_node]
    for tp in tps:
        pps = options["pp_sizes"] or _divisors(max(1, n // tp))
        for pp in pps:
            dp = max(1, n // (tp * pp))  # an explicit tp / pp that does not divide n stays invalid
            for mb in options["micro_batches"]:
                if global_batch % (dp * mb) and not include_invalid:
                    continue
                m = max(1, global_batch // (dp * mb))
                yield from _variants(tp, pp, dp, mb, m, options)


def _variants(tp, pp, dp, mb, m, options):
    zero_stages = options["zero_stages"] if dp > 1 else (0,)
    sps = options["sequence_parallel"] if tp > 1 else (False,)
    schedules = [
        (s, v) for s in options["schedules"] for v in (options["virtual_stages"] if s == "interleaved" else (1,))
    ]
    if pp == 1:
        schedules = [("1f1b", 1)]
    for zero in zero_stages:
        for recompute in options["recompute"]:
            for sp in sps:
                for schedule, v in schedules:
                    for order in options["rank_orders"]:
                        yield Layout(
                            tp=tp,
                            pp=pp,
                            dp=dp,
                            zero_stage=zero,
                            micro_batch=mb,
                            num_microbatches=m,
                            sequence_parallel=sp,
                            recompute=recompute,
                            schedule=schedule,
                            virtual_stages=v,
                            rank_order=order,
                        )


def search(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    precision: Precision | None = None,
    *,
    zero_stages=ZERO_STAGES,
    recompute=RECOMPUTE_CHOICES,
    micro_batches=(1, 2, 4, 8),
    schedules=("1f1b", "interleaved"),
    virtual_stages=(2, 4),
    sequence_parallel=(False, True),
    tp_sizes=None,
    pp_sizes=None,
    rank_orders=("tp-dp-pp",),
    include_invalid: bool = False,
    assumptions: Assumptions | None = None,
) -> list[tuple[Layout, Estimate]]:
    """All layouts of `cluster.num_gpus` GPUs for `global_batch` sequences per step, ranked.

    tp runs over the divisors of num_gpus up to gpus_per_node (or `tp_sizes`), pp over the
    divisors of num_gpus / tp (or `pp_sizes`), dp = num_gpus / (tp*pp), and num_microbatches =
    global_batch / (dp * micro_batch). Returns (layout, estimate) pairs, fitting layouts first
    by step time (fastest first). With `include_invalid`, the invalid and non-fitting ones
    follow (global batches that do not divide included), each with its `reasons`.
    """
    if not model.has_dims:
        raise ValueError("search ranks by step time, which needs the model's dimensions (not just num_params)")
    _positive_int("search", "global_batch", global_batch)
    for name, values in (("micro_batches", micro_batches), ("virtual_stages", virtual_stages),
                         ("tp_sizes", tp_sizes or ()), ("pp_sizes", pp_sizes or ())):  # fmt: skip
        for value in values:
            _positive_int("search", name, value)
    for value in zero_stages:
        if value not in ZERO_STAGES:
            raise ValueError(f"unknown zero_stage {value!r}; valid: 0, 1, 2, 3")
    for value in recompute:
        _choice(value, RECOMPUTE_CHOICES, "recompute")
    for value in schedules:
        _choice(value, SCHEDULE_CHOICES, "schedule")
    options = dict(
        zero_stages=tuple(zero_stages),
        recompute=tuple(recompute),
        micro_batches=tuple(micro_batches),
        schedules=tuple(schedules),
        virtual_stages=tuple(virtual_stages),
        sequence_parallel=tuple(sequence_parallel),
        tp_sizes=tp_sizes,
        pp_sizes=pp_sizes,
        rank_orders=tuple(rank_orders),
    )
    good, bad = [], []
    for layout in _candidate_layouts(cluster, global_batch, include_invalid, options):
        reasons = validate_layout(model, cluster, layout, global_batch=global_batch)
        if reasons and not include_invalid:
            continue
        est = _estimate(model, cluster, layout, precision, assumptions)
        if reasons:
            est = replace(est, reasons=tuple(dict.fromkeys((*reasons, *est.reasons))), valid=False)
        (good if est.fits else bad).append((layout, est))
    good.sort(key=lambda pair: pair[1].step_time_s)
    bad.sort(key=lambda pair: (pair[1].step_time_s is None, pair[1].step_time_s or 0.0))
    return good + bad if include_invalid else good


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

ESTIMATE_FIELDS = (
    *(f.name for f in fields(Layout)),
    "num_gpus",
    "num_params",
    "valid",
    "fits",
    "memory_stage",
    "memory_params_bytes",
    "memory_grads_bytes",
    "memory_optimizer_bytes",
    "memory_activations_bytes",
    "memory_buffers_bytes",
    "memory_total_bytes",
    "usable_hbm_bytes",
    "model_flops",
    "hardware_flops",
    "bubble_fraction",
    "comm_intra_node_bytes",
    "comm_inter_node_bytes",
    "comm_tp_bytes",
    "comm_pp_bytes",
    "comm_dp_bytes",
    "critical_stage",
    "time_compute_s",
    "time_bubble_s",
    "time_tp_s",
    "time_pp_s",
    "time_dp_s",
    "time_optimizer_s",
    "step_time_s",
    "tokens_per_s",
    "mfu",
    "reasons",
)


def estimate_to_dict(est: Estimate) -> dict[str, Any]:
    """One flat row (keys `ESTIMATE_FIELDS`, bytes and seconds unscaled) for CSV / JSON."""
    row: dict[str, Any] = dict.fromkeys(ESTIMATE_FIELDS)
    row.update(asdict(est.layout))
    row.update(num_gpus=est.num_gpus, num_params=est.num_params, valid=est.valid, fits=est.fits)
    row.update(usable_hbm_bytes=est.usable_hbm_bytes, reasons="; ".join(est.reasons))
    if est.memory is not None:
        mem = est.memory
        row.update(memory_stage=mem.stage, memory_params_bytes=mem.params, memory_grads_bytes=mem.grads)
        row.update(memory_optimizer_bytes=mem.optimizer, memory_activations_bytes=mem.activations)
        row.update(memory_buffers_bytes=mem.buffers, memory_total_bytes=mem.total)
    for key in ("model_flops", "hardware_flops", "bubble_fraction", "critical_stage", "step_time_s", "mfu"):
        row[key] = getattr(est, key)
    row["tokens_per_s"] = est.tokens_per_s
    for link, nbytes in (est.comm_bytes or {}).items():
        row[f"comm_{link}_bytes"] = nbytes
    for group, nbytes in (est.comm_bytes_by_group or {}).items():
        row[f"comm_{group}_bytes"] = nbytes
    for part, seconds in (est.time_breakdown or {}).items():
        row[f"time_{part}_s"] = seconds
    return row


def _gb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f}"


def format_estimate(est: Estimate) -> str:
    """A human-readable table of one estimate (GB = 1e9 bytes)."""
    lines = [f"layout    {est.layout.describe()}  ({est.num_gpus} GPUs, {est.num_params:.4g} params)"]
    if not est.valid:
        lines.append("INVALID")
        lines += [f"  - {r}" for r in est.reasons]
        return "\n".join(lines)
    mem = est.memory
    lines.append(f"memory per GPU, stage {mem.stage} of {est.layout.pp}    GB")
    for name in ("params", "grads", "optimizer", "activations", "buffers"):
        lines.append(f"  {name:<12}{_gb(getattr(mem, name)):>10}")
    verdict = "fits" if est.fits else "DOES NOT FIT"
    lines.append(f"  {'total':<12}{_gb(mem.total):>10}  / {_gb(est.usable_hbm_bytes)} usable -> {verdict}")
    if est.model_flops is not None:
        lines.append(
            f"FLOPs per step (job)  model {est.model_flops:.3e}  hardware {est.hardware_flops:.3e}  "
            f"bubble {est.bubble_fraction:.1%} of ideal"
        )
    by_group = est.comm_bytes_by_group or {}
    groups = "  ".join(f"{g} {_gb(by_group.get(g))} ({est.comm_links[g]})" for g in GROUPS)
    lines.append(
        f"comm per GPU per step GB  intra-node {_gb(est.comm_bytes['intra_node'])}  "
        f"inter-node {_gb(est.comm_bytes['inter_node'])}  [{groups}]"
    )
    if est.step_time_s is not None:
        parts = "  ".join(f"{k} {v:.3f}" for k, v in est.time_breakdown.items())
        lines.append(f"step time {est.step_time_s:.3f} s (stage {est.critical_stage}: {parts})  MFU {est.mfu:.1%}")
    lines += [f"  - {r}" for r in est.reasons]
    lines += [f"  note: {n}" for n in est.notes]
    return "\n".join(lines)


def format_ranking(ranked: list[tuple[Layout, Estimate]], top: int = 10) -> str:
    """A table of the first `top` search results: layout, memory, step time, MFU."""
    header = f"{'#':>3}  {'layout':<72}{'mem GB':>9}{'step s':>10}{'MFU':>8}  fits"
    lines = [header]
    for i, (layout, est) in enumerate(ranked[:top], 1):
        mem = _gb(est.memory.total if est.memory else None)
        step = "-" if est.step_time_s is None else f"{est.step_time_s:.3f}"
        mfu = "-" if est.mfu is None else f"{est.mfu:.1%}"
        lines.append(f"{i:>3}  {layout.describe():<72}{mem:>9}{step:>10}{mfu:>8}  {'yes' if est.fits else 'no'}")
    return "\n".join(lines)
