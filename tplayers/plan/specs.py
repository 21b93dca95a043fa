"""What is trained on what: `ModelSpec` (dimensions, parameter counts, HuggingFace configs), `Precision`
and `ClusterSpec`, with the choice constants and argument checks the planner shares. The `preset`
constructors import `tplayers.plan.presets`, whose tables are built from these classes, on use."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from tplayers.plan import hf_config, presets

RECOMPUTE_CHOICES = ("none", "selective", "full")
SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved")
RANK_ORDER_CHOICES = ("tp-dp-pp", "tp-pp-dp")
IMPLEMENTATION_CHOICES = ("megatron", "tplayers")
NORM_CHOICES = ("rmsnorm", "layernorm")
POSITION_CHOICES = ("rope", "learned")
ZERO_STAGES = (0, 1, 2, 3)
LINK_CLASSES = ("intra_node", "inter_node")
GROUPS = ("tp", "pp", "dp", "ep")
GiB = presets.GiB


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
        return cls(**_preset(presets.PRECISION_PRESETS, name, "precision"))


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

    A mixture of experts: `experts` (E routed experts per MoE layer), `experts_per_token` (k),
    `expert_ffn` (each expert's width, default `ffn_hidden`), `shared_ffn` (the shared experts'
    width together, 0 for none) and `dense_layers` (leading layers with the dense MLP of
    `ffn_hidden`, DeepSeek's first_k_dense_replace). `num_params` counts every expert.
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
    # a mixture of experts (`tplayers.plan.experts`): `experts` routed experts of width `expert_ffn`
    # (default ffn_hidden) per MoE layer, `experts_per_token` picked per token, shared experts
    # `shared_ffn` wide together; the first `dense_layers` layers keep the dense MLP (ffn_hidden)
    experts: int = 0
    experts_per_token: int | None = None
    expert_ffn: int | None = None
    shared_ffn: int = 0
    dense_layers: int = 0

    def __post_init__(self):
        given = [f for f in _DIM_FIELDS if getattr(self, f) is not None]
        if not given:
            if self.num_params is None:
                raise ValueError("ModelSpec needs either num_params or the dimensions " + ", ".join(_DIM_FIELDS))
            _positive_number("ModelSpec", "num_params", self.num_params)
            if self.experts:
                raise ValueError("ModelSpec: experts need the model's dimensions (a count-only model is dense)")
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
        self._resolve_experts()

    def _resolve_experts(self) -> None:
        for name in ("experts", "shared_ffn", "dense_layers"):
            _positive_int("ModelSpec", name, getattr(self, name), allow_zero=True)
        if not self.experts:
            given = [n for n in ("experts_per_token", "expert_ffn") if getattr(self, n) is not None]
            given += [n for n in ("shared_ffn", "dense_layers") if getattr(self, n)]
            if given:
                raise ValueError(f"ModelSpec: {', '.join(given)} describe experts, but experts is 0 (a dense model)")
            return
        _positive_int("ModelSpec", "experts_per_token", self.experts_per_token)
        if self.experts_per_token > self.experts:
            raise ValueError(f"ModelSpec.experts_per_token ({self.experts_per_token}) > experts ({self.experts})")
        if self.expert_ffn is not None:
            _positive_int("ModelSpec", "expert_ffn", self.expert_ffn)
        if self.dense_layers > self.layers:
            raise ValueError(f"ModelSpec.dense_layers ({self.dense_layers}) > layers ({self.layers})")
        if self.expert_ffn is None:
            object.__setattr__(self, "expert_ffn", self.ffn_hidden)

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
        return _with_overrides(cls(**_preset(presets.MODEL_PRESETS, name, "model")), overrides)

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
        return _with_overrides(cls(**hf_config.spec_fields(config)), overrides)


def _with_overrides(spec: ModelSpec, overrides: dict) -> ModelSpec:
    """`spec` with fields replaced; the parameter count is re-derived from the dimensions."""
    if not overrides:
        return spec
    return replace(spec, **{"num_params": None, **overrides})


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a model by block (unsharded, unpadded vocabulary)."""

    embedding: int  # word embedding (+ learned position table), on the first stage
    per_layer: int  # one transformer layer (of a mixture of experts: one with the dense MLP)
    layers: int  # number of layers
    final_norm: int  # on the last stage
    lm_head: int  # output projection; 0 when tied to the embedding
    moe_layers: int = 0  # of `layers`, those with experts
    per_moe_layer: int = 0  # one MoE layer, every expert
    active_per_moe_layer: int = 0  # one MoE layer, the k experts a token runs

    @property
    def total(self) -> int:
        layers = self.per_layer * (self.layers - self.moe_layers) + self.per_moe_layer * self.moe_layers
        return self.embedding + layers + self.final_norm + self.lm_head

    @property
    def active(self) -> int:
        """The parameters one token runs through (a dense model: all of them)."""
        return self.total - (self.per_moe_layer - self.active_per_moe_layer) * self.moe_layers


def _norm_params(model: ModelSpec) -> int:
    """RMSNorm has a weight; LayerNorm a weight and a bias."""
    return model.hidden * (2 if model.norm == "layernorm" else 1)


def _kv_sharded(model: ModelSpec, tp: int) -> bool:
    """kv heads split over TP with the query heads (both divisible), else whole on every rank."""
    return model.kv_heads % tp == 0 and model.heads % tp == 0


def ceil_share(total: int, tp: int, rank: int = 0) -> int:
    """TP rank `rank`'s share of a width or vocabulary of `total`, split as torch.chunk splits it
    (rank 0, the default: the largest share, ceil(total / tp))."""
    size = -(-total // tp)
    return max(0, min(size, total - rank * size))


def head_share(heads: int, tp: int, rank: int = 0) -> int:
    """TP rank `rank`'s whole query heads, split as evenly as they go (rank 0: the most)."""
    return heads // tp + (rank < heads % tp)


@dataclass(frozen=True)
class LocalDims:
    """What one TP rank holds of one layer (tplayers' splits: whole heads as evenly as they go,
    widths as torch.chunk splits them; nothing needs to divide). Both give the first ranks the
    larger shares: rank 0 is the most loaded, whose step the others wait for."""

    heads: int  # query heads
    q: int  # query rows (heads * head_dim); o's columns alike
    kv: int  # key (or value) rows held: its share when the kv heads split with the queries, else the heads read
    kv_heads_computed: int  # key/value heads computed per token (activations)
    ffn: int  # ffn columns


def local_dims(model: ModelSpec, tp: int, rank: int = 0) -> LocalDims:
    heads = head_share(model.heads, tp, rank)
    if _kv_sharded(model, tp):
        kv, computed = model.kv_dim // tp, model.kv_heads // tp
    elif model.heads % tp == 0 and tp % model.kv_heads == 0:
        kv, computed = model.head_dim, 1  # the one kv head its queries read, held here
    else:  # whole heads per rank: one kv head computed per local query head, those read held
        first, last = kv_heads_read(model, tp, rank)
        kv, computed = (last - first) * model.head_dim, heads
    return LocalDims(heads, heads * model.head_dim, kv, computed, ceil_share(model.ffn_hidden, tp, rank))


def kv_heads_read(model: ModelSpec, tp: int, rank: int) -> tuple[int, int]:
    """The key/value heads [first, last) that TP rank `rank`'s query heads read (whole query heads
    split as evenly as they go, `head_share`): what it holds of k / v when they are not split
    with the queries (`tplayers.hf`'s SharedKVProjection)."""
    start = sum(head_share(model.heads, tp, r) for r in range(rank))
    heads, per_group = head_share(model.heads, tp, rank), model.heads // model.kv_heads
    return (start // per_group, -(-(start + heads) // per_group)) if heads else (0, 0)


def kv_rows_exchanged(model: ModelSpec, tp: int, rank: int = 0) -> tuple[int, bool]:
    """(key/value heads' rows that TP rank `rank` shares with the other ranks, summed over them;
    whether every rank holds the same heads). Their gradients are summed over the ranks holding
    them in backward: one all-to-all of those rows per projection, or an all-reduce where every
    rank holds the same heads (one key/value head)."""
    if _kv_sharded(model, tp):
        return 0, False
    held = [range(*kv_heads_read(model, tp, r)) for r in range(tp)]
    if all(h == held[0] for h in held):
        return len(held[0]) * model.head_dim, True
    mine = set(held[rank])
    return sum(len(mine & set(h)) for r, h in enumerate(held) if r != rank) * model.head_dim, False


def tp_imbalance(model: ModelSpec, tp: int) -> float:
    """The most loaded TP rank's layer parameters over the mean of the ranks' (1.0: even splits)."""
    per_rank = [_layer_params(model, tp, r) for r in range(tp)]
    return max(per_rank) * tp / sum(per_rank)


# ------------------------------------------------------------------ experts (`tplayers.plan.experts`)


def expert_share(experts: int, ep: int, rank: int = 0) -> int:
    """Whole experts on expert-parallel rank `rank` (`tplayers.placement.even_sizes`)."""
    return experts // ep + (rank < experts % ep)


def _aligned_unit(f: int, tp: int) -> int:
    """`tplayers.nn.experts.aligned_unit` (16-byte blocks of the experts' features)."""
    return next(u for u in (16, 8, 4, 2, 1) if f % u == 0 and f // u >= tp or u == 1)


def expert_ffn_share(f: int, tp: int, rank: int = 0) -> int:
    """TP rank `rank`'s share of an expert's width `f`: whole aligned blocks as evenly as they go."""
    unit = _aligned_unit(f, tp)
    return expert_share(f // unit, tp, rank) * unit


def moe_layers(model: ModelSpec, first: int = 0, count: int | None = None) -> int:
    """How many of the layers [first, first + count) are MoE layers (all but the leading `dense_layers`)."""
    if not model.experts:
        return 0
    count = model.layers - first if count is None else count
    return max(0, first + count - max(first, model.dense_layers))


def moe_mlp_params(model: ModelSpec, tp: int = 1, ep: int = 1, tp_rank: int = 0, *, experts: bool = True) -> float:
    """Parameters of one MoE layer's MLP part on the most loaded rank: the router (E x h, replicated
    over TP; with its bias when `linear_bias`), the shared experts' dense MLP (TP-split) and, with
    `experts`, this rank's routed experts (E_r x (3 gated | 2) x h x its share of F)."""
    shared = ceil_share(model.shared_ffn, tp, tp_rank)
    params = model.experts * (model.hidden + model.linear_bias) + (_expert_params(model, shared) if shared else 0)
    if experts:
        params += expert_share(model.experts, ep) * _expert_params(
            model, expert_ffn_share(model.expert_ffn, tp, tp_rank)
        )
    return params


def _expert_params(model: ModelSpec, f: int) -> int:
    """One expert of width `f`: (3 gated | 2) h x f matrices, with gate|up's and down's biases."""
    mats = 3 if model.gated_mlp else 2
    return mats * model.hidden * f + model.linear_bias * ((mats - 1) * f + model.hidden)


def _layer_params(model: ModelSpec, tp: int = 1, rank: int = 0, *, ep: int = 1, moe: bool = False) -> float:
    """Parameters of one transformer layer held by TP rank `rank` (0: the most loaded; tp=1: the
    whole layer); `moe`: a MoE layer, its MLP `moe_mlp_params` (the experts over `ep` ranks).

    Attention: q and o are h x (heads*head_dim) each, k and v h x (kv_heads*head_dim) each,
    column-parallel (q, k, v) / row-parallel (o), of k / v the heads its queries read when kv heads
    are not split with the queries (`local_dims`). MLP: 3 h x ffn matrices gated (gate, up, down), 2 non-gated. Biases:
    the column-parallel ones are sharded, the row-parallel ones (o, down) replicated. Two norms,
    replicated.
    """
    h, local = model.hidden, local_dims(model, tp, rank)
    attention = 2 * h * local.q + 2 * h * local.kv
    bias = local.q + 2 * local.kv + h if model.linear_bias else 0
    if moe:
        return attention + bias + moe_mlp_params(model, tp, ep, rank) + 2 * _norm_params(model)
    mlp_mats = 3 if model.gated_mlp else 2
    mlp = mlp_mats * h * local.ffn
    if model.linear_bias:
        column_mats = 2 if model.gated_mlp else 1  # gate and up, or fc1
        bias += column_mats * local.ffn + h
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
    moe = {}
    if model.experts:
        every = _layer_params(model, moe=True)
        idle = (model.experts - model.experts_per_token) * _expert_params(model, model.expert_ffn)
        moe = dict(moe_layers=moe_layers(model), per_moe_layer=int(every), active_per_moe_layer=int(every - idle))
    return ParamCounts(
        embedding=embedding,
        per_layer=int(_layer_params(model, 1)),
        layers=model.layers,
        final_norm=_norm_params(model),
        lm_head=0 if model.tied_embeddings else model.vocab * h,
        **moe,
    )


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padding: the vocabulary rounded up to a multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return multiple * math.ceil(vocab / multiple)


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
        key = presets._GPU_ALIASES.get(key, key)
        gpu = _preset(presets._GPU_PRESETS, key, "cluster")
        return cls(num_gpus=num_gpus, **{"name": key, **gpu, **overrides})
