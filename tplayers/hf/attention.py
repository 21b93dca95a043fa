"""Attention adapters: how each HF attention layout is split by heads over the group.

    q/k/v_proj and o_proj / out_proj / dense (Llama, Mistral, Qwen2/3, Gemma 1-3, OLMo/OLMo2,
        Cohere, Granite, StableLM, OPT, GPT-J, Phi, ...): q, k, v column-parallel split by heads
        (key/value heads fewer than ranks, or not following uneven query heads: each rank holds
        and computes only the key/value heads its queries read, `SharedKVProjection`), the
        output projection row-parallel; OLMo2's q_norm / k_norm over the whole projection ->
        ParallelRMSNorm; per-head norms (Qwen3) replicated with their gradients summed
    GPT-2's Conv1D c_attn [q; k; v], Phi-3's qkv_proj [q; k; v], MPT's Wqkv: rank r holds
        [q_r; k_r; v_r] (tplayers.hf.fused)
    per-head query_key_value (GPT-NeoX, Bloom), Falcon's three layouts, GPTBigCode's multi-query
        c_attn, CodeGen's 4-block qkv_proj: see each adapter
    ALiBi (Bloom, MPT, Falcon): the bias the model builds for all heads, sliced to each rank's heads

Attributes a module's own forward reads (head counts, widths) are set to their local values; a
forward that reads a size tplayers does not localise is refused, naming it.
"""

import copy
import inspect
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from tplayers.functional.collectives import all_gather_any, own_slice
from tplayers.hf import pieces
from tplayers.hf.fused import (
    SharedKVProjection,
    fused_column,
    multi_query_column,
    part_rows,
    shared_rows_record,
)
from tplayers.hf.norms import is_plain_layer_norm, l2_norm_eps, rms_norm_eps
from tplayers.hf.shard import ShardingPass, _under, copy_in, has_linears, on_device
from tplayers.hf.source import forward_source
from tplayers.hf.state_dict import ExportRecord
from tplayers.nn.linear import RowParallelLinear
from tplayers.nn.norm import ComputedRowsRMSNorm, ParallelL2Norm, ParallelLayerNorm, ParallelRMSNorm
from tplayers.placement import even_sizes, set_placement, shard_range

HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
KV_HEAD_COUNTS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
# Sizes that sharding changes: a forward reading one that is not set locally reshapes wrongly.
SIZE_NAMES = {*HEAD_COUNTS, *KV_HEAD_COUNTS, "hidden_size", "embed_dim", "all_head_size", "inner_dim", "split_size",
              # state-space and linear-attention mixers (tplayers.hf.mixers)
              "num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim", "intermediate_size", "n_groups",
              "groups_time_state_size", "o_groups"}  # fmt: skip
_SELF_READS = re.compile(r"self\.((?:config\.)?[A-Za-z_]\w*)")


def _forward_reads(module) -> set[str]:
    """`self.x` / `self.config.x` names read in the module's forward (none where it has no source)."""
    return set(_SELF_READS.findall(forward_source(module)))


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


OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "projection_layer", "Wo")  # InternViT, ModernBERT-decoder
HIDDEN_WIDTHS = ("hidden_size", "embed_dim", "all_head_size")


# Gated attention's output gates (AFMoE, Laguna, HRM): a projection of the attention's input with
# one output per head or per head element, multiplied into the heads' output before o_proj.
OUTPUT_GATES = ("gate_proj", "g_proj")


def output_gate(attn, heads, head_dim, width=None) -> str | None:
    """The name of `attn`'s output gate, or None: an nn.Linear among OUTPUT_GATES of the attention's
    input width (`width`, else q_proj's), fed `hidden_states` in the forward, one output per head or
    per head element. It splits by the query heads (each rank gates its own heads); the self-check
    proves the product."""
    width = width or attn.q_proj.in_features
    for gate in OUTPUT_GATES:
        module = getattr(attn, gate, None)
        if (isinstance(module, nn.Linear) and module.in_features == width
                and module.out_features in (heads, heads * head_dim)
                and f"self.{gate}(hidden_states)" in forward_source(attn)):  # fmt: skip
            return gate
    return None


def _split_output_gate(sp: ShardingPass, name, attn, heads, head_dim, sizes=None, width=None) -> set[str]:
    """The output gate (if any) split as the query heads are; returns its name, or nothing."""
    gate = output_gate(attn, heads, head_dim, width)
    if gate is None:
        return set()
    module = getattr(attn, gate)
    unit = head_dim if module.out_features == heads * head_dim else 1
    sp.shared_input_column(f"{name}.{gate}", module, **(dict(split_unit=unit, split_sizes=sizes) if sizes else {}))
    return {gate}


def output_projection(attn) -> str | None:
    return next((p for p in OUTPUT_PROJECTIONS if isinstance(getattr(attn, p, None), nn.Linear)), None)


def is_qkvo_attention(module) -> bool:
    """q / k / v / o projections; Gemma 4's keys read as values too (`use_alternative_attention`: no
    v_proj), or its keys and values taken from an earlier layer (`is_kv_shared_layer`: neither)."""
    if not has_linears(module, ("q_proj",)) or output_projection(module) is None:
        return False
    shares = getattr(module, "is_kv_shared_layer", False) is True and getattr(module, "k_proj", None) is None
    keys_as_values = getattr(module, "use_alternative_attention", False) is True
    keys_as_values = keys_as_values and getattr(module, "v_proj", 0) is None
    return shares or has_linears(module, ("k_proj", "v_proj") if not keys_as_values else ("k_proj",))


def qkvo_attention(sp: ShardingPass, name, attn):
    """Split by heads: q / k / v column-parallel, o row-parallel. A layer that reads another's keys
    and values (Gemma 4's KV sharing) splits its query heads as that layer (the same head counts):
    each rank's queries meet the keys and values its own heads of that layer stored."""
    out = output_projection(attn)
    o_proj = getattr(attn, out)
    head_dim = getattr(attn, "head_dim", None) or o_proj.in_features // sp.config("num_attention_heads")
    heads = attn.q_proj.out_features // head_dim
    k_proj = getattr(attn, "k_proj", None)
    kv_heads = k_proj.out_features // head_dim if k_proj is not None else heads // attn.num_key_value_groups
    q_unit = head_dim
    if attn.q_proj.out_features == 2 * o_proj.in_features and "head_dim * 2" in forward_source(attn):
        # an output gate per head (Qwen3-Next, Qwen3.5): q_proj's rows are [query; gate] head by head
        heads, q_unit = o_proj.in_features // head_dim, 2 * head_dim
    if heads < sp.n and _under(name, sp.towers):  # a tower's activations and their gradients are whole on every
        sp.done.add(name)  # rank: an attention with fewer heads than ranks (Emu3's VQ encoder: one) kept whole
        sp.whole.add(name)
        return
    if heads % sp.n or (kv_heads % sp.n and sp.n % kv_heads):
        return _qkvo_by_whole_heads(sp, name, attn, out, head_dim, heads, kv_heads, q_unit)
    sp.shared_input_column(f"{name}.q_proj", attn.q_proj)
    gates = _split_output_gate(sp, name, attn, heads, head_dim)
    if kv_heads % sp.n == 0:
        for proj in _kv_projections(attn):
            sp.shared_input_column(f"{name}.{proj}", getattr(attn, proj))
    else:  # fewer key/value heads than ranks: each rank computes the one its query heads use
        block = torch.arange(head_dim)
        _shared_kv(sp, name, attn, [r // (sp.n // kv_heads) * head_dim + block for r in range(sp.n)], head_dim)
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
    rows = dict(q_norm=even_sizes(heads, sp.n), k_norm=even_sizes(kv_heads, sp.n) if kv_heads % sp.n == 0 else None)
    _per_head_weights(sp, name, attn, head_dim, {"q_proj", "k_proj", "v_proj", out, *gates}, rows)
    _held_per_head(sp, name, attn, heads, None)
    sp.shared_input.append(attn)
    sp.done.add(name)


def head_split(name, heads, n) -> list[int]:
    """Every rank's whole query heads, as evenly as they go (`even_sizes`: 9 over 2: 5, 4; 14
    over 4: 4, 4, 3, 3; 12 over 8: 2, 2, 2, 2, 1, 1, 1, 1). Fewer heads than ranks is refused:
    a rank would hold none, and the models' attention forwards cannot run on none."""
    if heads < n:
        raise ValueError(
            f"parallelize: {name}: {heads} attention heads over {n} ranks leave {n - heads} ranks without a head, and "
            f"the model's attention forward cannot run on none; use at most {heads} ranks for this model"
        )
    return even_sizes(heads, n)


def _heads_and_kv_rows(name, heads, kv_heads, head_dim, sp: ShardingPass):
    """(every rank's query heads (`head_split`), this rank's count; for every rank the rows of the
    key (or value) weight each of its query heads reads, one head_dim block per query head)."""
    sizes = head_split(name, heads, sp.n)
    if heads % kv_heads:
        raise ValueError(f"parallelize: {name}: {heads} attention heads do not share {kv_heads} key/value heads evenly")
    rows = []
    for r in range(sp.n):
        start, local = shard_range(heads, sp.n, r, sizes)
        kv_of = torch.arange(start, start + local) // (heads // kv_heads)
        rows.append((kv_of[:, None] * head_dim + torch.arange(head_dim)).flatten())
    return sizes, sizes[dist.get_rank(sp.group)], rows


def _shared_kv(sp: ShardingPass, name, attn, rows: list[torch.Tensor], head_dim):
    """k_proj and v_proj held where they are read: rank r holds the key/value heads among
    `rows[r]` (the rows its query heads read) and computes those rows (`SharedKVProjection`)."""
    for proj in _kv_projections(attn):
        module = getattr(attn, proj)
        layer = on_device(SharedKVProjection(module, rows, group=sp.group, unit=head_dim), module.weight.device)
        sp.swap(f"{name}.{proj}", layer)
        sp.exports.append(shared_rows_record(f"{name}.{proj}", layer))


def _kv_projections(attn) -> list[str]:
    return [p for p in ("k_proj", "v_proj") if getattr(attn, p, None) is not None]


def _qkvo_by_whole_heads(sp: ShardingPass, name, attn, out, head_dim, heads, kv_heads, q_unit=None):
    """Heads that do not split evenly (9 over 2: 5 and 4; 14 over 4: 4, 4, 3, 3), or key/value
    groups that do not follow the query heads: the query heads split whole (`head_split`); each
    rank holds the key / value heads its query heads read and computes, for each query head, the
    one it reads (`SharedKVProjection`: a head shared by several ranks has its gradient summed
    over them), so its heads
    pair one to one (num_key_value_groups 1) even where its queries straddle two key/value groups.
    The output projection splits its input by the same heads. `q_unit`: q_proj's rows per head
    (2 head_dim with an output gate)."""
    sizes, local, rows = _heads_and_kv_rows(name, heads, kv_heads, head_dim, sp)
    sp.shared_input_column(f"{name}.q_proj", attn.q_proj, split_unit=q_unit or head_dim, split_sizes=sizes)
    gates = _split_output_gate(sp, name, attn, heads, head_dim, sizes)
    _shared_kv(sp, name, attn, rows, head_dim)
    attn.num_key_value_groups = 1  # one key / value head computed per local query head
    sp.row(f"{name}.{out}", getattr(attn, out), split_unit=head_dim, split_sizes=sizes)
    widths = {w: local * head_dim for w in HIDDEN_WIDTHS if getattr(attn, w, None) == heads * head_dim}
    localize_attributes(
        name, attn, {**dict.fromkeys(HEAD_COUNTS, local), **dict.fromkeys(KV_HEAD_COUNTS, local), **widths}
    )
    _per_head_weights(sp, name, attn, head_dim, {"q_proj", "k_proj", "v_proj", out, *gates}, dict(q_norm=sizes))
    _held_per_head(sp, name, attn, heads, sizes)
    sp.shared_input.append(attn)
    sp.done.add(name)


def _held_per_head(sp: ShardingPass, name, attn, heads, sizes):
    """Parameters the attention module holds itself with one entry per query head along dim 0
    (attention sinks: gpt-oss, GraniteMoE-SWA, MiMo-V2-Flash, Flint; the forward reads them for
    the heads it computes): cut to this rank's heads, split as the query heads are (`sizes`, or
    evenly), placement Shard(0), exported under their own name. Anything else the module holds
    directly is left to parallelize's rule for parameters inside sharded modules (a scalar's
    gradient summed, anything else refused by name)."""
    for key, p in list(attn._parameters.items()):
        if p is None or p.dim() == 0 or p.shape[0] != heads or heads == 1:
            continue
        split_per_head(sp, name, attn, key, 1, sizes)


def split_per_head(sp: ShardingPass, name, module, key, unit=1, sizes=None, dim=0):
    """`module.<key>` (one entry per head along `dim`, `unit` each) cut to this rank's heads
    (`sizes`, or evenly), placement Shard(dim), exported and loaded under its own name."""
    p = getattr(module, key)
    total = p.shape[dim]
    local = nn.Parameter(own_slice(p.detach(), dim, sp.group, unit, sizes).clone(), requires_grad=p.requires_grad)
    setattr(module, key, local)
    set_placement(local, sp.group, Shard(dim))

    def export(pick, group):
        value = pick(getattr(module, key))
        return {"": all_gather_any(value.contiguous(), dim, group)} if value is not None else {}

    def load(full):
        copy_in(getattr(module, key), own_slice(full[""], dim, sp.group, unit, sizes))

    def layout():
        return [pieces.split("", getattr(module, key), dim, sp.group, total=total, unit=unit, sizes=sizes)]

    sp.exports.append(ExportRecord(f"{name}.{key}", export, load, layout))


NORMS_OVER_PROJECTION = {"q_norm": "q_proj", "k_norm": "k_proj"}


def _norm_over_projection(sp: ShardingPass, name, norm, projection):
    """OLMo2's q_norm / k_norm: an RMSNorm over a whole projection's output. Over a column-split
    projection -> ParallelRMSNorm (its sum of squares summed over the group); over keys each rank
    computes for its own query heads (some key/value heads on several ranks) ->
    ComputedRowsRMSNorm (each key counted once in the sum)."""
    eps = rms_norm_eps(norm)
    if eps is None:
        raise ValueError(
            f"parallelize: {name} ({type(norm).__name__}) spans all heads and is not an RMSNorm tplayers knows"
        )
    source = getattr(sp.model.get_submodule(name.rpartition(".")[0]), projection)
    if isinstance(source, SharedKVProjection):
        layer = on_device(
            ComputedRowsRMSNorm(norm.weight, eps, source.rows_of_ranks, group=sp.group), norm.weight.device
        )
        dim = None
    else:
        layer = ParallelRMSNorm.from_weight(
            norm.weight, eps, group=sp.group, split_unit=source.split_unit, split_sizes=source.split_sizes
        )
        dim = 0
    sp.swap(name, layer)
    sp.record(name, layer, dim=dim)


# Norms over a row projection's whole input (BitNet's, Dory's, Kosmos-2's sub-norms): {norm: the projection after it}
NORMS_BEFORE_PROJECTION = {"attn_sub_norm": "o_proj", "ffn_sub_norm": "down_proj", "inner_attn_ln": "out_proj",
                           "ffn_layernorm": "fc2"}  # fmt: skip


def norm_before_row(sp: ShardingPass, name, norm, row):
    """BitNet's attn_sub_norm / ffn_sub_norm: an RMSNorm over all heads' (all features') output,
    just before the row-parallel projection `row`: a ParallelRMSNorm over the same split as the
    row layer's input (its sum of squares summed over the group). Dory's, weightless L2 norms:
    ParallelL2Norm; Kosmos-2's nn.LayerNorms: ParallelLayerNorm. Any other norm there is refused
    by name: over split features it would see a rank's slice."""
    eps = rms_norm_eps(norm)
    if eps is None and l2_norm_eps(norm) is not None:
        sp.swap(name, ParallelL2Norm(l2_norm_eps(norm), group=sp.group))
        return
    if is_plain_layer_norm(norm):  # Kosmos-2's sub-LayerNorms
        layer = ParallelLayerNorm.from_norm(norm, group=sp.group, split_unit=row.split_unit,
                                            split_sizes=row.split_sizes)  # fmt: skip
        sp.swap(name, layer)
        sp.record(name, layer, dim=0)
        return
    if eps is None:
        raise ValueError(
            f"parallelize: {name} ({type(norm).__name__}) spans every head's features and is not an RMSNorm tplayers "
            "knows"
        )
    layer = ParallelRMSNorm.from_weight(norm.weight, eps, group=sp.group, split_unit=row.split_unit,
                                        split_sizes=row.split_sizes)  # fmt: skip
    sp.swap(name, layer)
    sp.record(name, layer, dim=0)


def _per_head_weights(sp: ShardingPass, name, attn, head_dim, projections, per_head_rows=None):
    """Other weights inside the attention. Acting on each head alike (Qwen3's q_norm / k_norm):
    replicated, but each rank's heads give only part of their gradient, so it is summed. One row
    per head (Chameleon's): cut to this rank's heads, split as `per_head_rows` says ({child: every
    rank's heads}, None where they are not split by whole heads: refused). An
    RMSNorm over a whole projection (OLMo2): split with it (`_norm_over_projection`). Any other
    weight spanning all heads, or one module per head (StableLM's per-head norms: each rank would
    apply the first heads' norms to its own heads), cannot be split by this pass: an error naming
    it. A sparse-attention indexer (Qwen4-Exp's query-sparse attention) picks the keys every head
    attends to from the whole hidden states: whole on every rank."""
    for child_name, child in attn.named_children():
        if child_name in projections:
            continue
        if child_name == "indexer":  # a sparse-attention indexer: whole, as beside MLA (see mla.MLA_LATENT)
            sp.partial_grads.extend(child.parameters())
            continue
        row = getattr(attn, NORMS_BEFORE_PROJECTION.get(child_name, ""), None)
        if isinstance(row, RowParallelLinear) and tuple(getattr(child, "weight", torch.empty(0)).shape) in (
            (row.in_features,),
            (0,),  # weightless
        ):
            norm_before_row(sp, f"{name}.{child_name}", child, row)
            continue
        projection = NORMS_OVER_PROJECTION.get(child_name)
        width = getattr(getattr(attn, projection, None), "out_features", None) if projection else None
        weight = getattr(child, "weight", None)
        if width and isinstance(weight, torch.Tensor) and tuple(weight.shape) == (width,) and width != head_dim:
            _norm_over_projection(sp, f"{name}.{child_name}", child, projection)
            continue
        if any(True for _ in child.children()) and any(True for _ in child.parameters()):
            raise ValueError(
                f"parallelize: {name}.{child_name} ({type(child).__name__}) holds weights per head in "
                "submodules; tplayers does not shard it: pass a plan for this model"
            )
        for param_name, p in list(child.named_parameters()):
            if p.shape[-1] != head_dim:
                raise ValueError(
                    f"parallelize: {name}.{child_name}.{param_name} {tuple(p.shape)} spans all heads; "
                    "pass a plan for this model"
                )
            if p.dim() == 1:
                sp.partial_grads.append(p)
                continue
            # one row per head (Chameleon's q / k norms): cut with the heads where they split by whole heads
            sizes = (per_head_rows or {}).get(child_name)
            if p.dim() != 2 or sizes is None or p.shape[0] != sum(sizes):
                raise ValueError(
                    f"parallelize: {name}.{child_name}.{param_name} {tuple(p.shape)} holds a row per head, and its "
                    "heads are not split by whole heads here (key/value heads shared by ranks); use a tensor-parallel "
                    "size dividing the key/value heads"
                )
            split_per_head(sp, f"{name}.{child_name}", child, param_name, 1, sizes)


def _local_heads(name, heads, sp: ShardingPass):
    """(every rank's whole heads (`head_split`), this rank's first head, its count)."""
    split = head_split(name, heads, sp.n)
    return (split, *shard_range(heads, sp.n, dist.get_rank(sp.group), split))


def gpt2_attention(sp: ShardingPass, name, attn):
    width = attn.c_attn.nf // 3
    heads = next((getattr(attn, k) for k in HEAD_COUNTS if isinstance(getattr(attn, k, None), int)), None)
    if heads is None:
        raise ValueError(
            f"parallelize: {name} ({type(attn).__name__}) holds a fused c_attn but none of {HEAD_COUNTS}, so tplayers "
            "cannot tell its heads; pass a plan for this model"
        )
    head_dim = width // heads
    split, _, local = _local_heads(name, heads, sp)
    fused_column(sp, f"{name}.c_attn", attn.c_attn, part_rows([width] * 3, sp.n, head_dim, split))
    # HF splits c_attn's output into q, k, v of split_size
    localize_attributes(name, attn, {"split_size": local * head_dim, **dict.fromkeys(HEAD_COUNTS, local)})
    sp.row(f"{name}.c_proj", attn.c_proj, split_unit=head_dim, split_sizes=split)
    sp.shared_input.append(attn)
    sp.done.add(name)


def _fused_qkv(sp: ShardingPass, name, attn, proj, out, heads, kv_heads, head_dim) -> tuple[int, int]:
    """One projection `proj` holding [q; k; v] row blocks: rank r holds [q_r; k_r; v_r] (no
    gathered output); with heads that do not split evenly, or fewer key/value heads than ranks,
    whole query heads per rank, each computing the key / value head it reads (see qkvo). `out`
    row-parallel by the same heads. Returns (local query heads, local key/value heads)."""
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    linear = getattr(attn, proj)
    if linear.out_features != sum(sizes):
        raise ValueError(f"parallelize: {name}.{proj} has {linear.out_features} rows, not q+k+v {sizes}")
    if heads % sp.n == 0 and kv_heads % sp.n == 0:
        fused_column(sp, f"{name}.{proj}", linear, part_rows(sizes, sp.n))
        sp.row(f"{name}.{out}", getattr(attn, out))
        return heads // sp.n, kv_heads // sp.n
    split, local_heads, kv_rows = _heads_and_kv_rows(name, heads, kv_heads, head_dim, sp)
    rows = [torch.cat([r, kv_heads * head_dim + r]) for r in kv_rows]  # [k; v] of the [k; v] block
    multi_query_column(sp, f"{name}.{proj}", linear, heads * head_dim, head_dim=head_dim, kv_rows=rows, split=split)
    sp.row(f"{name}.{out}", getattr(attn, out), split_unit=head_dim, split_sizes=split)
    attn.num_key_value_groups = 1
    return local_heads, local_heads


def fused_qkv_attention(sp: ShardingPass, name, attn):
    """Phi-3: one qkv_proj holding [q; k; v] row blocks, sliced by the forward at
    config.num_attention_heads * head_dim (`_fused_qkv`); the attention gets its own copy of the
    config with the local head counts, which its forward reads."""
    head_dim, config = attn.head_dim, attn.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    local_heads, local_kv = _fused_qkv(sp, name, attn, "qkv_proj", "o_proj", heads, kv_heads, head_dim)
    attn.config = copy.copy(config)  # this module's own: the model's config stays global
    attn.config.num_attention_heads, attn.config.num_key_value_heads = local_heads, local_kv
    localize_attributes(
        name,
        attn,
        dict.fromkeys(KV_HEAD_COUNTS, local_kv),
        config_keys=("num_attention_heads", "num_key_value_heads"),
    )
    sp.shared_input.append(attn)
    sp.done.add(name)


def dbrx_attention(sp: ShardingPass, name, attn):
    """DBRX: Wqkv holding [q; k; v] row blocks (`_fused_qkv`), sliced by the forward at its own
    hidden_size and num_key_value_heads * head_dim, set to the local widths; clip_qkv clamps each
    element alike, so it applies to any rows."""
    heads, kv_heads, head_dim = attn.num_heads, attn.num_key_value_heads, attn.head_dim
    local_heads, local_kv = _fused_qkv(sp, name, attn, "Wqkv", "out_proj", heads, kv_heads, head_dim)
    local = {**dict.fromkeys(HEAD_COUNTS, local_heads), **dict.fromkeys(KV_HEAD_COUNTS, local_kv)}
    _finish_attention(sp, name, attn, {**local, "hidden_size": local_heads * head_dim})


def named(*names):
    """Matches a module whose class (or a base class) has one of `names`: a fused layout is in the
    model's forward code, not in its children, so it is recognised by the class that reads it."""
    return lambda m: any(c.__name__ in names for c in type(m).__mro__)


def _local_head_bias(sp: ShardingPass, attn, arg, heads, start, count):
    """ALiBi (Bloom, MPT, Falcon with alibi): the model builds one bias for all heads and passes it
    to every attention as `arg`, as (batch * heads, 1, keys), (heads, 1, keys) or (batch, heads,
    1, keys); Falcon also folds it into a (batch, heads, queries, keys) attention mask. Each rank's
    attention gets the rows of its own heads (`count` from `start`), so each rank applies its own
    heads' slopes."""
    params = list(inspect.signature(type(attn).forward).parameters)[1:]

    def per_head(t):
        return t.dim() == 4 and t.shape[1] == heads

    def local(name, t):
        if not isinstance(t, torch.Tensor) or heads == 1:
            return t
        if per_head(t):
            return t.narrow(1, start, count)
        if name == arg and t.dim() == 3 and t.shape[0] % heads == 0:
            return t.unflatten(0, (-1, heads)).narrow(1, start, count).flatten(0, 1)
        if name == arg:
            raise ValueError(f"parallelize: {arg} of shape {tuple(t.shape)} does not hold the {heads} heads")
        return t  # a mask shared by all heads

    sliced = (arg, "attention_mask")
    names = [p if p in sliced else None for p in params]

    def hook(module, args, kwargs):
        args = tuple(local(names[i], a) if i < len(names) and names[i] else a for i, a in enumerate(args))
        return args, {k: local(k, v) if k in sliced else v for k, v in kwargs.items()}

    attn.register_forward_pre_hook(hook, with_kwargs=True)


def _finish_attention(sp: ShardingPass, name, attn, local: dict, **kwargs):
    localize_attributes(name, attn, local, **kwargs)
    sp.shared_input.append(attn)
    sp.done.add(name)


def _heads_and_widths(attn, heads, head_dim, local_heads, local_kv=None):
    """Local values of the head counts and of widths equal to all heads' (hidden_size, embed_dim)."""
    local = dict.fromkeys(HEAD_COUNTS, local_heads)
    if local_kv is not None:
        local.update(dict.fromkeys(KV_HEAD_COUNTS, local_kv))
    widths = (*HIDDEN_WIDTHS, "split_size")
    local.update({w: local_heads * head_dim for w in widths if getattr(attn, w, None) == heads * head_dim})
    return local


def interleaved_qkv_attention(sp: ShardingPass, name, attn):
    """GPT-NeoX, Bloom, Persimmon: query_key_value's rows run head by head ([q, k, v] of head 0, then head 1,
    ...), so a contiguous column split gives each rank its own heads whole; dense row-parallel.
    Bloom's ALiBi bias is sliced to each rank's heads."""
    head_dim = getattr(attn, "head_dim", None) or attn.head_size
    heads = attn.query_key_value.out_features // (3 * head_dim)
    split, start, local = _local_heads(name, heads, sp)
    if getattr(attn, "pretraining_tp", 1) > 1 and getattr(attn, "slow_but_exact", False):
        raise ValueError(f"parallelize: {name} slices dense by pretraining_tp (slow_but_exact); set it to False")
    sp.shared_input_column(f"{name}.query_key_value", attn.query_key_value, split_unit=3 * head_dim, split_sizes=split)
    sp.row(f"{name}.dense", attn.dense, split_unit=head_dim, split_sizes=split)
    if "alibi" in inspect.signature(type(attn).forward).parameters:
        _local_head_bias(sp, attn, "alibi", heads, start, local)
    if isinstance(getattr(attn, "dense_bias", None), nn.Parameter):
        # GPT-NeoX-Japanese returns dense's bias for its layer to add to the summed output: whole, and
        # under sequence parallelism added to this rank's tokens (its gradient summed)
        if sp.sp:
            sp.partial_grads.append(attn.dense_bias)
        else:
            set_placement(attn.dense_bias, sp.group, Replicate())
    # Persimmon's q / k LayerNorms over each head's features act on every head alike: gradients summed
    _per_head_weights(sp, name, attn, head_dim, {"query_key_value", "dense"})
    _finish_attention(sp, name, attn, _heads_and_widths(attn, heads, head_dim, local))
