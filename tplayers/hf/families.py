"""What tplayers knows about each HuggingFace model family: one adapter per module pattern,
recognised by the module's children, next to each other in `ADAPTERS`.

    attention with q/k/v_proj and o_proj / out_proj / dense (Llama, Mistral, Qwen2/3, Gemma 1-3,
        OLMo, Cohere, Granite, StableLM, OPT, GPT-J, Phi, ...): q, k, v column-parallel split by
        heads, the output projection row-parallel; head counts and widths the forward reads are
        set to their local values
    GPT-2 attention (Conv1D c_attn holding [q; k; v], c_proj): c_attn column-parallel with rank
        r holding [q_r; k_r; v_r], c_proj row-parallel, `split_size` set to the local width
    gated MLP (gate/up/down_proj): SiLU -> ParallelMLP (one fused gate|up GEMM + SwiGLU kernel);
        any other activation -> gate, up column-parallel, down row-parallel
    GPT-2 MLP (Conv1D c_fc, c_proj): c_fc column-parallel, c_proj row-parallel
    fused qkv_proj [q; k; v] (Phi-3): column-parallel with rank r holding [q_r; k_r; v_r], the
        attention given its own config copy with the local head counts its forward reads
    fused gate_up_proj [gate; up] with SiLU (Phi-3, GLM-4): ParallelMLP's fused SwiGLU layout
    two-layer MLPs with an elementwise activation (fc1/fc2: OPT, Phi; fc_in/fc_out: GPT-J;
        c_fc/c_proj: Starcoder2; up_proj/down_proj: MPT; dense_h_to_4h/dense_4h_to_h): the first
        column-parallel, the second row-parallel
    Qwen2-MoE's shared-expert gate (H -> 1, then a sigmoid): kept whole on every rank

    input embeddings: nn.Embedding -> VocabParallelEmbedding; Gemma's scaled embedding (times
        sqrt(hidden)) -> the same with its scale kept; any other nn.Embedding subclass is refused

An adapter shards a module through the `ShardingPass` it is given (`tplayers.hf.shard`) and
records how to export / load anything it lays out in its own way. Attributes a module's own
forward reads (head counts) are set to their local values; a forward that reads a size tplayers
does not localise is refused, naming it.
"""

import copy
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tplayers.functional.collectives import copy_to_tp_region, own_slice
from tplayers.functional.linear import column_parallel_linear
from tplayers.hf.shard import ShardingPass, as_linear, copy_in, gather, is_conv1d
from tplayers.nn.attention import ReplicatedLinear
from tplayers.nn.embedding import VocabParallelEmbedding
from tplayers.nn.linear import ColumnParallelLinear, _divide
from tplayers.nn.mlp import ParallelMLP, fuse_gate_up, unfuse_gate_up


@dataclass(frozen=True)
class Adapter:
    """A module pattern tplayers knows exactly: `matches(module)` recognises it by its children,
    `apply(sharding_pass, name, module)` shards it in place."""

    name: str
    matches: Callable[[nn.Module], bool]
    apply: Callable[[ShardingPass, str, nn.Module], None]


@dataclass(frozen=True)
class EmbeddingAdapter:
    """An input embedding whose forward tplayers knows exactly: `build(embedding, group)` gives
    its vocabulary-parallel form."""

    name: str
    matches: Callable[[nn.Embedding], bool]
    build: Callable[[nn.Embedding, dist.ProcessGroup], VocabParallelEmbedding]


def _has_linears(module, names) -> bool:
    return all(isinstance(getattr(module, p, None), nn.Linear) for p in names)


def _has_conv1ds(module, names) -> bool:
    return all(is_conv1d(getattr(module, p, None)) for p in names)


def is_silu(act) -> bool:
    """Whether an activation module computes SiLU (HF has its own classes for it)."""
    if not isinstance(act, nn.Module):
        return False
    probe = torch.linspace(-4, 4, 17)
    try:
        return torch.equal(act(probe), nn.functional.silu(probe))
    except Exception:  # an activation that does not take a plain tensor is not SiLU
        return False


def interleave_shards(parts, n):
    """Unsharded (F, ...) parts [q, k, v] -> the (sum F, ...) tensor whose r-th contiguous slice is
    [q_r; k_r; v_r]: a fused projection whose shards stay local."""
    return torch.cat([t for shards in zip(*(p.chunk(n, 0) for p in parts), strict=True) for t in shards], 0)


def deinterleave_shards(fused, n, sizes):
    """Inverse of `interleave_shards`: the fused tensor -> the unsharded parts of `sizes` rows."""
    per_rank = [shard.split([s // n for s in sizes], 0) for shard in fused.chunk(n, 0)]
    return [torch.cat([rank_parts[i] for rank_parts in per_rank], 0) for i in range(len(sizes))]


class ReplicatedKVProjection(ReplicatedLinear):
    """k_proj / v_proj when the TP size exceeds the key/value heads: the whole weight on every rank
    (placement Replicate), each rank multiplying only the rows of the key/value head its query
    heads use (`rows`). The weight enters through copy_to_tp_region, whose backward sums the
    gradient over the group: each rank contributed its head's rows, so every rank ends with the
    whole gradient. dx, as for any column layer, is summed over the group."""

    rows: slice

    def forward(self, x):
        weight = copy_to_tp_region(self.weight, self.group)[self.rows]
        bias = copy_to_tp_region(self.bias, self.group)[self.rows] if self.bias is not None else None
        return column_parallel_linear(x, weight, bias, self.group, reduce_input_grad=False)


# -- attributes the model's own forward reads --------------------------------------------------
HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
KV_HEAD_COUNTS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
# Sizes that sharding changes: a forward reading one that is not set locally reshapes wrongly.
SIZE_NAMES = {*HEAD_COUNTS, *KV_HEAD_COUNTS, "hidden_size", "embed_dim", "all_head_size", "inner_dim", "split_size"}
_SELF_READS = re.compile(r"self\.((?:config\.)?[A-Za-z_]\w*)")


def _forward_reads(module) -> set[str]:
    """`self.x` / `self.config.x` names read in the module's forward (none where it has no source)."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return set()
    return set(_SELF_READS.findall(source))


def localize_attributes(name, module, local: dict[str, int], *, config_keys=()):
    """Set the module's size attributes to their local values (`local`: attribute -> value), then
    refuse the module if its forward still reads a size sharding changes: one of its own not set
    here, or one from the config (shared by every module) unless the module holds its own copy
    with those keys (`config_keys`) set locally."""
    for attr, value in local.items():
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, value)
    stale = []
    for attr in sorted(_forward_reads(module)):
        owner, _, key = attr.rpartition(".")
        if key in SIZE_NAMES and ((owner and key not in config_keys) or (not owner and key not in local)):
            stale.append(f"self.{attr}")
    if stale:
        raise ValueError(
            f"parallelize: {name} ({type(module).__name__}) reads {', '.join(stale)} in its forward, a global "
            "size that sharding changes and tplayers does not set locally; pass a plan for this model"
        )


# -- attention ------------------------------------------------------------------------------
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense")
HIDDEN_WIDTHS = ("hidden_size", "embed_dim", "all_head_size")


def _output_projection(attn) -> str | None:
    return next((p for p in OUTPUT_PROJECTIONS if isinstance(getattr(attn, p, None), nn.Linear)), None)


def qkvo_attention(sp: ShardingPass, name, attn):
    out = _output_projection(attn)
    o_proj = getattr(attn, out)
    head_dim = getattr(attn, "head_dim", None) or o_proj.in_features // sp.config("num_attention_heads")
    heads, kv_heads = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
    _divide(heads, sp.n, f"{name}: attention heads")
    if kv_heads % sp.n and sp.n % kv_heads:
        raise ValueError(
            f"{name}: key/value heads ({kv_heads}) and the tensor-parallel size ({sp.n}): one must divide "
            "the other (key/value heads split over the ranks, or each replicated on n / heads ranks)"
        )
    sp.shared_input_column(f"{name}.q_proj", attn.q_proj)
    if kv_heads % sp.n == 0:
        sp.shared_input_column(f"{name}.k_proj", attn.k_proj)
        sp.shared_input_column(f"{name}.v_proj", attn.v_proj)
    else:  # fewer key/value heads than ranks: each rank computes the one its query heads use
        kv_index = dist.get_rank(sp.group) // (sp.n // kv_heads)
        for proj in ("k_proj", "v_proj"):
            module = getattr(attn, proj)
            layer = ReplicatedKVProjection.from_linear(module, group=sp.group).to(module.weight.device)
            layer.rows = slice(kv_index * head_dim, (kv_index + 1) * head_dim)
            sp.swap(f"{name}.{proj}", layer)
            sp.record(f"{name}.{proj}", layer, None, False)
        attn.num_key_value_groups = heads // sp.n  # local query heads per (one) local kv head
    sp.row(f"{name}.{out}", o_proj)
    local_kv = max(kv_heads // sp.n, 1)
    # widths equal to all heads' (GPT-J's embed_dim, used to merge heads) become the local heads' width
    widths = {w: heads // sp.n * head_dim for w in HIDDEN_WIDTHS if getattr(attn, w, None) == heads * head_dim}
    localize_attributes(
        name,
        attn,
        {**dict.fromkeys(HEAD_COUNTS, heads // sp.n), **dict.fromkeys(KV_HEAD_COUNTS, local_kv), **widths},
    )
    _per_head_weights(sp, name, attn, head_dim, {"q_proj", "k_proj", "v_proj", out})
    sp.shared_input.append(attn)
    sp.done.add(name)


def _per_head_weights(sp: ShardingPass, name, attn, head_dim, projections):
    """Other weights inside the attention (Qwen3's q_norm / k_norm) act on each head alike:
    replicated, but each rank's heads give only part of their gradient, so it is summed.
    A weight spanning all heads, or one module per head (StableLM's per-head norms: each rank
    would apply the first heads' norms to its own heads), cannot be split by this pass: an error
    naming it."""
    for child_name, child in attn.named_children():
        if child_name in projections:
            continue
        if any(True for _ in child.children()) and any(True for _ in child.parameters()):
            raise ValueError(
                f"parallelize: {name}.{child_name} ({type(child).__name__}) holds weights per head in "
                "submodules; tplayers does not shard it: pass a plan for this model"
            )
        for param_name, p in child.named_parameters():
            if p.shape[-1] != head_dim:
                raise ValueError(
                    f"parallelize: {name}.{child_name}.{param_name} {tuple(p.shape)} spans all heads; "
                    "pass a plan for this model"
                )
            sp.partial_grads.append(p)


def gpt2_attention(sp: ShardingPass, name, attn):
    width = attn.c_attn.nf // 3
    _divide(attn.num_heads, sp.n, f"{name}: attention heads")
    _fused_column(sp, f"{name}.c_attn", attn.c_attn, [width] * 3)
    # HF splits c_attn's output into q, k, v of split_size
    localize_attributes(name, attn, {"split_size": width // sp.n, **dict.fromkeys(HEAD_COUNTS, attn.num_heads // sp.n)})
    sp.row(f"{name}.c_proj", attn.c_proj)
    sp.shared_input.append(attn)
    sp.done.add(name)


def fused_qkv_attention(sp: ShardingPass, name, attn):
    """Phi-3: one qkv_proj holding [q; k; v] row blocks, sliced by the forward at
    config.num_attention_heads * head_dim. Rank r holds [q_r; k_r; v_r] (no gathered output); the
    attention gets its own copy of the config with the local head counts, which its forward reads."""
    head_dim, config = attn.head_dim, attn.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    _divide(heads, sp.n, f"{name}: attention heads")
    _divide(kv_heads, sp.n, f"{name}: key/value heads (fused qkv_proj)")
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    if attn.qkv_proj.out_features != sum(sizes):
        raise ValueError(f"parallelize: {name}.qkv_proj has {attn.qkv_proj.out_features} rows, not q+k+v {sizes}")
    _fused_column(sp, f"{name}.qkv_proj", attn.qkv_proj, sizes)
    sp.row(f"{name}.o_proj", attn.o_proj)
    attn.config = copy.copy(config)  # this module's own: the model's config stays global
    attn.config.num_attention_heads, attn.config.num_key_value_heads = heads // sp.n, kv_heads // sp.n
    localize_attributes(
        name,
        attn,
        dict.fromkeys(KV_HEAD_COUNTS, kv_heads // sp.n),
        config_keys=("num_attention_heads", "num_key_value_heads"),
    )
    sp.shared_input.append(attn)
    sp.done.add(name)


def _fused_column(sp: ShardingPass, name, linear, sizes, *, shared_input=True):
    """A column layer over a fused projection (nn.Linear, or Conv1D with its weight stored (in, out))
    of parts with `sizes` rows: rank r holds the r-th slice of every part, side by side; exported
    back to the fused HF layout exactly."""
    transpose = is_conv1d(linear)
    full = as_linear(linear, name)
    fused = nn.Linear(full.in_features, full.out_features, bias=full.bias is not None, device="meta")
    fused.weight = nn.Parameter(interleave_shards(full.weight.split(sizes, 0), sp.n), requires_grad=False)
    if full.bias is not None:
        fused.bias = nn.Parameter(interleave_shards(full.bias.split(sizes, 0), sp.n), requires_grad=False)
    kwargs = dict(reduce_input_grad=False) if shared_input else dict(sequence_parallel=sp.sp)
    layer = ColumnParallelLinear.from_linear(fused, group=sp.group, **kwargs).to(linear.weight.device)
    sp.swap(name, layer)
    keys = ("weight", "bias") if layer.bias is not None else ("weight",)

    def export(pick, group):
        out = {}
        for key in keys:
            t = gather(pick(getattr(layer, key)), 0, group)
            if t is not None:
                t = torch.cat(deinterleave_shards(t, sp.n, sizes), 0)
                out[key] = t.t() if transpose and key == "weight" else t
        return out

    def load(full_tensors):
        for key in keys:
            t = full_tensors[key]
            parts = (t.t() if transpose and key == "weight" else t).split(sizes, 0)
            copy_in(getattr(layer, key), own_slice(interleave_shards(parts, sp.n), 0, sp.group))

    sp.exports.append((name, export, load))
    return layer


# -- MLP ------------------------------------------------------------------------------------
def fused_gate_up_mlp(sp: ShardingPass, name, mlp):
    """Phi-3: gate_up_proj holding [gate; up] halves, up * act(gate). SiLU: ParallelMLP (one fused
    gate|up GEMM with the SwiGLU epilogue), exported back to [gate; up]; other activations refused."""
    act = getattr(mlp, "activation_fn", None)
    if not is_silu(act):
        raise ValueError(f"parallelize: {name} gates with {type(act).__name__}, not SiLU; pass a plan for this model")
    fused = as_linear(mlp.gate_up_proj, f"{name}.gate_up_proj")
    halves = []
    for part in fused.weight.detach().chunk(2, 0):
        half = nn.Linear(part.shape[1], part.shape[0], bias=False, device="meta")
        half.weight = nn.Parameter(part, requires_grad=False)
        halves.append(half)
    if fused.bias is not None:
        raise ValueError(f"parallelize: {name}.gate_up_proj has a bias; pass a plan for this model")
    layer = ParallelMLP.from_modules(
        *halves, as_linear(mlp.down_proj, f"{name}.down_proj"), group=sp.group, sequence_parallel=sp.sp
    ).to(mlp.down_proj.weight.device)
    sp.swap(name, layer)

    def export(pick, group):
        w = pick(layer.in_proj.weight)
        out = {}
        if w is not None:
            out["gate_up_proj.weight"] = torch.cat(unfuse_gate_up(gather(w, 0, group), sp.n), 0)
        down = pick(layer.out_proj.weight)
        if down is not None:
            out["down_proj.weight"] = gather(down, 1, group)
        return out

    def load(full):
        gate, up = full["gate_up_proj.weight"].chunk(2, 0)
        copy_in(layer.in_proj.weight, own_slice(fuse_gate_up(gate, up, sp.n), 0, sp.group))
        copy_in(layer.out_proj.weight, own_slice(full["down_proj.weight"], 1, sp.group))

    sp.exports.append((name, export, load))


def gated_mlp(sp: ShardingPass, name, mlp):
    if not is_silu(getattr(mlp, "act_fn", None)):
        sp.shared_input_column(f"{name}.gate_proj", mlp.gate_proj)
        sp.shared_input_column(f"{name}.up_proj", mlp.up_proj)
        sp.row(f"{name}.down_proj", mlp.down_proj)
        sp.shared_input.append(mlp)
        sp.done.add(name)
        return
    layer = ParallelMLP.from_modules(
        mlp.gate_proj, mlp.up_proj, mlp.down_proj, group=sp.group, sequence_parallel=sp.sp
    ).to(mlp.down_proj.weight.device)
    sp.swap(name, layer)

    def export(pick, group):
        out = {}
        for key in ("weight", "bias"):
            if getattr(layer.in_proj, key) is None:
                continue
            gate, up = unfuse_gate_up(gather(pick(getattr(layer.in_proj, key)), 0, group), sp.n)
            out[f"gate_proj.{key}"], out[f"up_proj.{key}"] = gate, up
            down = pick(getattr(layer.out_proj, key))
            out[f"down_proj.{key}"] = gather(down, 1, group) if key == "weight" else down
        return out

    def load(full):
        for key in ("weight", "bias"):
            if getattr(layer.in_proj, key) is None:
                continue
            fused = fuse_gate_up(full[f"gate_proj.{key}"], full[f"up_proj.{key}"], sp.n)
            copy_in(getattr(layer.in_proj, key), own_slice(fused, 0, sp.group))
            down = full[f"down_proj.{key}"]
            copy_in(getattr(layer.out_proj, key), own_slice(down, 1, sp.group) if key == "weight" else down)

    sp.exports.append((name, export, load))


MLP_PAIRS = (("fc1", "fc2"), ("fc_in", "fc_out"), ("c_fc", "c_proj"), ("up_proj", "down_proj"),
             ("dense_h_to_4h", "dense_4h_to_h"))  # fmt: skip


def _two_layer_pair(module):
    """The (in, out) names of a two-layer MLP's linears in `module` (no gate: that is gated_mlp)."""
    if isinstance(getattr(module, "gate_proj", None), nn.Linear):
        return None
    return next((pair for pair in MLP_PAIRS if _has_linears(module, pair)), None)


def two_layer_mlp(sp: ShardingPass, name, module):
    """fc_out(act(fc_in(x))) with an elementwise act: fc_in column-, fc_out row-parallel. The two
    may sit in the MLP module or in the decoder layer itself (OPT), so only they are marked done."""
    first, second = _two_layer_pair(module)
    if sp.sp and any(isinstance(c, nn.Module) and _output_projection(c) for c in module.children()):
        raise ValueError(
            f"parallelize(sequence_parallel=True): {name}.{first} / {second} sit in the decoder layer itself "
            f"({type(module).__name__}), which may flatten the tokens before them; sequence parallelism is not "
            "supported for this model yet (use it without)"
        )
    sp.column(f"{name}.{first}", getattr(module, first))
    sp.row(f"{name}.{second}", getattr(module, second))


def shared_expert_gate(sp: ShardingPass, name, module):
    """Qwen2-MoE: sigmoid(shared_expert_gate(x)) scales the shared expert: one output, kept whole.
    The block feeds its experts flattened (tokens, hidden) inputs, which the sequence-parallel
    shared expert cannot split by sequence: refused under SP."""
    if sp.sp:
        raise ValueError(
            f"parallelize(sequence_parallel=True): {name} ({type(module).__name__}) feeds its shared expert "
            "flattened tokens; sequence parallelism is not supported for this model yet (use it without)"
        )
    sp.done.add(f"{name}.shared_expert_gate")


def gpt2_mlp(sp: ShardingPass, name, mlp):
    sp.column(f"{name}.c_fc", mlp.c_fc)
    sp.row(f"{name}.c_proj", mlp.c_proj)
    sp.done.add(name)


# -- input embeddings -----------------------------------------------------------------------
def _plain_embedding(m) -> bool:
    return type(m).forward is nn.Embedding.forward


def _as_plain_embedding(m) -> nn.Embedding:
    """An nn.Embedding (on the meta device, then given the weight) with `m`'s weight and options."""
    plain = nn.Embedding(m.num_embeddings, m.embedding_dim, m.padding_idx, device="meta")
    plain.weight = nn.Parameter(m.weight.detach(), requires_grad=False)
    plain.max_norm, plain.scale_grad_by_freq, plain.sparse = m.max_norm, m.scale_grad_by_freq, m.sparse
    return plain


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding times a constant `embed_scale` cast to the weight's dtype (Gemma's
    sqrt(hidden), applied as HF applies it: after the lookup, in the weight's dtype)."""

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


def _scaled_embedding(m) -> bool:
    """Gemma's *ScaledWordEmbedding: embedding(ids) * embed_scale; checked on a probe where the
    weights are materialised, so a look-alike with other math is refused."""
    scale = getattr(m, "embed_scale", None)
    named = type(m).__name__.endswith("ScaledWordEmbedding")
    if not (named and isinstance(scale, torch.Tensor) and scale.numel() == 1):
        return False
    if m.weight.is_meta:
        return True
    ids = torch.arange(min(8, m.num_embeddings), device=m.weight.device)
    with torch.no_grad():
        return torch.equal(m(ids), nn.functional.embedding(ids, m.weight) * scale.to(m.weight.dtype))


def _build_scaled_embedding(m, group):
    layer = ScaledVocabParallelEmbedding.from_embedding(_as_plain_embedding(m), group=group)
    layer.register_buffer("embed_scale", m.embed_scale.detach().clone(), persistent=False)
    return layer


EMBEDDINGS = (
    EmbeddingAdapter("nn.Embedding", _plain_embedding, lambda m, g: VocabParallelEmbedding.from_embedding(m, group=g)),
    EmbeddingAdapter("scaled embedding (Gemma)", _scaled_embedding, _build_scaled_embedding),
)

ADAPTERS = (
    Adapter(
        "q/k/v/o attention",
        lambda m: _has_linears(m, ("q_proj", "k_proj", "v_proj")) and _output_projection(m) is not None,
        qkvo_attention,
    ),
    Adapter("fused qkv attention (Phi-3)", lambda m: _has_linears(m, ("qkv_proj", "o_proj")), fused_qkv_attention),
    Adapter("fused gate|up MLP (Phi-3)", lambda m: _has_linears(m, ("gate_up_proj", "down_proj")), fused_gate_up_mlp),
    Adapter("GPT-2 attention", lambda m: _has_conv1ds(m, ("c_attn", "c_proj")), gpt2_attention),
    Adapter("gated MLP", lambda m: _has_linears(m, ("gate_proj", "up_proj", "down_proj")), gated_mlp),
    Adapter("GPT-2 MLP", lambda m: _has_conv1ds(m, ("c_fc", "c_proj")), gpt2_mlp),
    Adapter("two-layer MLP", lambda m: _two_layer_pair(m) is not None, two_layer_mlp),
    Adapter(
        "shared-expert gate (Qwen2-MoE)",
        lambda m: _has_linears(m, ("shared_expert_gate",)) and m.shared_expert_gate.out_features == 1,
        shared_expert_gate,
    ),
)
