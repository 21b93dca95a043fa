"""LoRA adapters (peft) on tensor-parallel models, in either order:

    peft.get_peft_model(model, config); tplayers.parallelize(peft_model, group=...)   (order 1)
    tplayers.parallelize(model, group=...); tplayers.get_peft_model(model, config)   (order 2,
        tplayers.hf.lora_targets)

peft's own `lora.Linear` stays in the model, its forward, `set_adapter`, `merge_and_unload`,
`disable_adapter` unchanged; its base layer is the tplayers layer and each adapter's two factors
are tplayers layers sharded the way that base is, so peft's plain `lora_B(lora_A(dropout(x)))`
computes exactly the unsharded adapter's contribution to this rank's part of the output:

    column-parallel base (rows of W, in the base's row map: c_attn's [q_r; k_r; v_r], ...)
        lora_A  whole (r, in), replicated
        lora_B  a ColumnParallelLinear (r -> out) holding the base's rows of B, in its mode:
                - inside attention / MLP (the input prepared once for the module, its gradient
                  summed by the hook before it): no collective; the adapter's input gradient
                  joins the base's in that one reduction. lora_A's gradient is each rank's part
                  (its rows of B): summed over the group, one (r x in) all-reduce per backward.
                - sequence parallel (the input gathered inside the GEMM): lora_B gathers its
                  (tokens x r) input and reduce-scatters its gradient; lora_A's gradient summed.
                - plain: lora_B all-reduces its (tokens x r) input gradient; no sum needed.
    row-parallel base (columns of W)
        lora_A  a RowParallelLinear (in -> r) holding the base's columns of A: its (tokens x r)
                output all-reduced (reduce-scattered along the sequence under SP)
        lora_B  whole (out, r), replicated; under SP its gradient (this rank's tokens) summed
    key / value heads held where read (`SharedKVProjection`: more ranks than kv heads, uneven heads)
        lora_A  whole, its gradient summed; lora_B holds the base's rows (a SharedKVProjection),
                each shared head's gradient summed over the ranks holding it

The extra collectives are (tokens x r) or (r x in) wide: r / in of the base's. Each factor's
initial values are broadcast from the group's first rank before slicing (peft draws lora_A at
random on every rank). Exports name the factors as peft does, whole: `gather_state_dict`,
checkpoints and `tplayers.save_pretrained` (peft's adapter directory) read them.

Adapters on the experts' parameters (peft's ParamWrapper): `tplayers.hf.lora_experts`.

Refused, naming the module: LoRA on what tplayers does not shard as a column / row layer (an
embedding, a module kept whole, a multi-query projection), peft's variants (DoRA, ...),
initializations that read the whole base weight (PiSSA, OLoRA, ...: initialize before
parallelize), merged adapters.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate

from tplayers.functional.collectives import all_gather_any
from tplayers.functional.rng import shared_draws
from tplayers.functional.sequence import split_sizes
from tplayers.hf import lora_experts, pieces
from tplayers.hf.finish import finish
from tplayers.hf.fused import MultiQueryProjection, SharedKVProjection
from tplayers.hf.lora_checks import _refuse, check_config, keep_whole
from tplayers.hf.shard import copy_in, on_device
from tplayers.hf.state_dict import ExportRecord, LiveRecords
from tplayers.nn.linear import ColumnParallelLinear, GatheredWeightLinear, RowParallelLinear
from tplayers.placement import placement_or_none, seal
from tplayers.state import set_state, state_of

# the tplayers layers an adapter can sit on (SharedKVProjection before RowParallelLinear
# does not matter: neither subclasses the other)
SUPPORTED = (ColumnParallelLinear, RowParallelLinear, GatheredWeightLinear, SharedKVProjection, MultiQueryProjection)


def lora_layers(model) -> dict[str, nn.Module]:
    """peft's LoRA layers in `model`, by name ({} where peft is not installed)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@functools.cache
def lora_class():
    """`TensorParallelLoraLinear`: peft's lora.Linear whose adapters are sharded as they are made."""
    from peft.tuners.lora.layer import Linear

    class TensorParallelLoraLinear(Linear):
        """peft's LoRA Linear over a tplayers layer: every adapter's factors sharded as its base is
        (`tplayers.hf.lora`), as soon as peft makes them (`get_peft_model`, `add_adapter`,
        `load_adapter` all go through `update_layer`)."""

        def __init__(self, base_layer, adapter_name, config, **kwargs):
            super().__init__(base_layer, adapter_name, config, **kwargs)
            self.fan_in_fan_out = False  # the base is a tplayers layer: (out, in) like nn.Linear

        @property
        def lora_variants(self):
            return {(): None}

        def _get_in_out_features(self, module):
            return base_features(module)  # the unsharded sizes

        def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
            check_config(config, kwargs.get("target_name") or type(self.get_base_layer()).__name__)
            super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
            shard_adapter(self, adapter_name)

    return TensorParallelLoraLinear


# -- the factors, sharded like their base ---------------------------------------------------------
def _broadcast(tensors, group):
    src = dist.get_global_rank(group, 0)
    for t in tensors:
        dist.broadcast(t.data, src=src, group=group)


def _column_like(base: ColumnParallelLinear, b: nn.Linear, rows) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(
        b.in_features, base.out_features, b.bias is not None, group=base.group, gather_output=base.gather_output,
        sequence_parallel=base.sequence_parallel, overlap=base.overlap, reduce_input_grad=base.reduce_input_grad,
        split_unit=base.split_unit, split_sizes=None if base.gather_output else base.split_sizes,
        device="meta", dtype=b.weight.dtype,
    )  # fmt: skip
    device = b.weight.device
    layer.weight = nn.Parameter(b.weight.detach()[rows.to(device)].clone())
    if b.bias is not None:
        layer.bias = nn.Parameter(b.bias.detach()[rows.to(device)].clone())
    layer._tag_parameters()
    return on_device(layer, device)


def _row_like(base: RowParallelLinear, a: nn.Linear, columns) -> RowParallelLinear:
    layer = RowParallelLinear(
        base.in_features, a.out_features, False, group=base.group, input_is_parallel=base.input_is_parallel,
        sequence_parallel=base.sequence_parallel, overlap=base.overlap, split_unit=base.split_unit,
        split_sizes=base.split_sizes if base.input_is_parallel else None, device="meta", dtype=a.weight.dtype,
    )  # fmt: skip
    layer.weight = nn.Parameter(a.weight.detach()[:, columns.to(a.weight.device)].clone())
    layer._tag_parameters()
    return on_device(layer, a.weight.device)


def _shared_like(base: SharedKVProjection, b: nn.Linear) -> SharedKVProjection:
    """B's rows of the key / value block `base` holds part of (all of B, or the key / value block
    of a multi-query [q; k; v]), held and computed as `base` holds and computes them."""
    rows = base.hf_rows.to(b.weight.device)
    whole = nn.Linear(b.in_features, base.out_features, bias=b.bias is not None, device="meta")
    whole.weight = nn.Parameter(b.weight.detach()[rows].clone())
    if b.bias is not None:
        whole.bias = nn.Parameter(b.bias.detach()[rows].clone())
    return on_device(SharedKVProjection(whole, base.rows_of_ranks, group=base.group, unit=base.unit), b.weight.device)


def replicated_base(base) -> bool:
    """A plain nn.Linear tplayers keeps whole on every rank (MLA's latent projections, a router):
    its adapter is whole too, its gradients summed where the base's are."""
    record = placement_or_none(getattr(base, "weight", None)) if type(base) is nn.Linear else None
    return record is not None and isinstance(record.placement, Replicate)


def base_group(base):
    if replicated_base(base):
        return placement_or_none(base.weight).group
    return base.query.group if isinstance(base, MultiQueryProjection) else base.group


def base_features(base) -> tuple[int, int]:
    """The unsharded (in, out) features of a tplayers base layer."""
    if isinstance(base, MultiQueryProjection):
        return base.query.in_features, base.query.out_features + base.key_value.out_features
    return base.in_features, base.out_features


class ShardedDropout(nn.Module):
    """peft's lora_dropout on an input this rank holds part of: the mask is drawn for the whole
    (unsharded) input, as the unsharded model's nn.Dropout draws it, and this rank's part taken
    (`dim` of `index`), so every element is dropped independently and the ranks' generators
    stay in step (each draws the same, whatever it holds). `dim` None: the input is whole on every
    rank (a column layer's), its mask every rank's alike. Drawn from the shared generator, also
    where the base layer's forward entered its sharded region (tplayers.functional.rng)."""

    def __init__(self, p: float, dim: int, index: torch.Tensor | None, total: int | None, group=None):
        super().__init__()
        self.p, self.dim, self.total, self.group = p, dim, total, group
        self.register_buffer("index", index, persistent=False)

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        dim, index, shape = self.dim, self.index, list(x.shape)
        if dim is None:
            with shared_draws(x.device):
                return nn.functional.dropout(x, self.p, True)
        if index is None:  # this rank's part of the sequence (dim 1), or of the tokens of a 2-D input
            dim, n, r = (1 if x.dim() == 3 else 0), dist.get_world_size(self.group), dist.get_rank(self.group)
            sizes = split_sizes(n) if x.dim() == 3 else None  # the open split's parts, where they differ
            if sizes is None or sizes[r] != shape[dim]:
                sizes = [shape[dim]] * n
            start = sum(sizes[:r])
            index = torch.arange(start, start + sizes[r])
            shape[dim] = sum(sizes)
        else:
            shape[dim] = self.total
        with shared_draws(x.device):
            mask = nn.functional.dropout(x.new_ones(shape), self.p, True)
        return x * mask.index_select(dim, index.to(x.device))

    def extra_repr(self):
        if self.dim is None:
            return f"p={self.p}, the whole input"
        return f"p={self.p}, " + ("this rank's part of the sequence" if self.index is None else f"dim={self.dim}")


def _dropout(layer, adapter, base):
    """The adapter's dropout over what this rank holds of the base's input (module docstring)."""
    dropout = layer.lora_dropout[adapter]
    if not isinstance(dropout, nn.Dropout) or dropout.p == 0:
        return
    if isinstance(base, RowParallelLinear) and base.input_is_parallel:  # this rank's input columns
        layer.lora_dropout[adapter] = ShardedDropout(dropout.p, -1, _map(base, 1), base.in_features)
    elif getattr(base, "sequence_parallel", False):  # this rank's part of the sequence
        layer.lora_dropout[adapter] = ShardedDropout(dropout.p, 1, None, None, base.group)
    else:  # the whole input, every rank's alike
        layer.lora_dropout[adapter] = ShardedDropout(dropout.p, None, None, None)


def on_whole_base(layer) -> bool:
    """A peft LoRA layer whose base tplayers keeps whole (`replicated_base`)."""
    return hasattr(layer, "lora_A") and replicated_base(getattr(layer, "base_layer", None))


def place_whole_adapter(layer, adapter, *, broadcast=True):
    """An adapter on a base kept whole (`replicated_base`): its factors whole on every rank (the
    same values: rank 0's, unless the caller broadcast them already), summed over the group where
    the base's gradient is."""
    base = layer.get_base_layer()
    factors = [*layer.lora_A[adapter].parameters(), *layer.lora_B[adapter].parameters()]
    record = placement_or_none(base.weight)
    if broadcast:
        _broadcast(factors, record.group)
    for p in factors:
        if placement_or_none(p) is None:
            keep_whole(p, record.group, partial=record.grad_summed)


def shard_adapter(layer, adapter):
    """Replace `adapter`'s whole factors in `layer` (a TensorParallelLoraLinear) by their sharded
    forms (module docstring), with export records for them."""
    base = layer.get_base_layer()
    a, b = layer.lora_A[adapter], layer.lora_B[adapter]
    grads = {id(p): p.requires_grad for p in (*a.parameters(), *b.parameters())}
    group = base_group(base)
    _broadcast([*a.parameters(), *b.parameters()], group)
    if isinstance(base, MultiQueryProjection) and not isinstance(base.key_value, SharedKVProjection):
        _refuse(
            type(base.key_value).__name__,
            "rows computed once and gathered (a Mamba 2 mixer's in_proj with one "
            "group): add the adapter before tplayers.parallelize, which then keeps B / C whole for it",
        )
    if isinstance(base, MultiQueryProjection):  # [q_r; k; v]: B's query rows split, its kv rows whole
        query = _column_like(base.query, b, _map(base.query, 0))
        new_a, new_b = a, MultiQueryProjection(query, _shared_like(base.key_value, b), base.interleave)
        keep_whole(a.weight, group, partial=True)
    elif isinstance(base, SharedKVProjection):
        new_a, new_b = a, _shared_like(base, b)
        keep_whole(a.weight, group, partial=True)
    elif isinstance(base, GatheredWeightLinear):  # the whole output on every rank: the adapter whole too
        new_a, new_b = a, b
        for p in (*a.parameters(), *b.parameters()):  # under SP each rank's tokens give part of the gradient
            keep_whole(p, group, partial=base.sequence_parallel)
    elif isinstance(base, ColumnParallelLinear):
        new_a, new_b = a, _column_like(base, b, _map(base, 0))
        keep_whole(a.weight, group, partial=base.sequence_parallel or not base.reduce_input_grad)
    elif isinstance(base, RowParallelLinear):
        new_a, new_b = _row_like(base, a, _map(base, 1)), b
        for p in b.parameters():
            keep_whole(p, group, partial=base.sequence_parallel)
    elif replicated_base(base):  # whole like the base; each rank's heads give part of its gradient where they do
        new_a, new_b = a, b
        place_whole_adapter(layer, adapter, broadcast=False)  # broadcast above
    else:
        _refuse(type(base).__name__, "not a column / row layer tplayers knows")
    for old, new in ((a, new_a), (b, new_b)):  # trainable as peft made them (inference_mode: not)
        trainable = any(grads[id(p)] for p in old.parameters())
        for p in new.parameters():
            p.requires_grad_(trainable)
    layer.lora_A[adapter], layer.lora_B[adapter] = new_a, new_b
    _dropout(layer, adapter, base)
    seal(layer)


def _map(base, dim):
    """The HF rows (dim 0) or columns (dim 1) `base` holds, in its local order."""
    recorded = state_of(base).weight_map
    if recorded is None or recorded[0] != dim:
        _refuse(type(base).__name__, "its layout was not recorded by tplayers.parallelize")
    return recorded[1]


def record_weight_maps(model, records):
    """After the sharding pass: on each swapped layer (and the layers inside it: a multi-query
    projection's), the HF rows / columns its weight holds, from its record's pieces of the HF
    `weight`, which its adapters' factors follow."""
    for record in records:
        try:
            module = model.get_submodule(record.prefix)
        except AttributeError:
            continue
        layers = {id(m.weight): m for m in module.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)}
        for piece in record.pieces():
            if piece.key == "weight" and piece.dim is not None and id(piece.param) in layers:
                set_state(layers[id(piece.param)], weight_map=(piece.dim, piece.glob))


# -- export records of the factors ----------------------------------------------------------------
def _factor_record(prefix, parts, total, group):
    """(prefix, export, load, pieces) of a factor as `tplayers.hf.state_dict.EXPORTS` lists them:
    `parts` [(module, dim, index, split)], each module holding `index` of the HF tensor's `total`
    along `dim` (None: the whole factor), split over `group` (each rank its own) or the same
    on every rank."""
    keys = [k for k in ("weight", "bias") if getattr(parts[0][0], k, None) is not None]

    def dim_of(key, dim):
        return None if dim is None or (key == "bias" and dim == 1) else dim

    def export(pick, group_):
        out = {}
        for key in keys:
            full = None
            for module, dim, index, split in parts:
                t, d = pick(getattr(module, key)), dim_of(key, dim)
                if t is None:
                    continue
                if d is None:
                    full = t
                    continue
                where = index.to(t.device)
                if split:
                    t, where = all_gather_any(t.contiguous(), d, group), all_gather_any(where, 0, group)
                if full is None:
                    full = t.new_zeros(t.shape[:d] + (total,) + t.shape[d + 1 :])
                full.index_copy_(d, where, t)
            if full is not None:
                out[key] = full
        return out

    def load(full):
        for key in keys:
            for module, dim, index, _ in parts:
                t, d = full[key], dim_of(key, dim)
                copy_in(getattr(module, key), t if d is None else t.index_select(d, index.to(t.device)))

    def layout():
        return [
            pieces.whole(key, getattr(m, key)) if dim_of(key, dim) is None
            else pieces.Piece(
                key, getattr(m, key), dim_of(key, dim), torch.arange(index.numel()), index, total,
                unit=m.unit if isinstance(m, SharedKVProjection) else 0,
            )
            for key in keys for m, dim, index, _ in parts
        ]  # fmt: skip

    return ExportRecord(prefix, export, load, layout)


def adapter_records(name, layer) -> list:
    """The records of every adapter's two factors in `layer` (a TensorParallelLoraLinear) under
    `name`, named as peft names them (`<name>.lora_A.<adapter>`)."""
    base = layer.get_base_layer()
    group, (n_in, n_out) = base_group(base), base_features(base)
    out = []
    for adapter in layer.lora_A:
        a, b = layer.lora_A[adapter], layer.lora_B[adapter]
        a_parts, b_parts = [(a, None, None, False)], [(b, None, None, False)]
        if isinstance(base, RowParallelLinear):
            a_parts = [(a, 1, _map(base, 1), True)]
        elif isinstance(base, ColumnParallelLinear):
            b_parts = [(b, 0, _map(base, 0), True)]
        elif isinstance(base, SharedKVProjection):
            b_parts = [(b, 0, _map(base, 0), True)]
        elif isinstance(base, MultiQueryProjection):
            b_parts = [(b.query, 0, _map(base.query, 0), True), (b.key_value, 0, _map(base.key_value, 0), True)]
        out.append(_factor_record(f"{name}.lora_A.{adapter}", a_parts, n_in, group))
        out.append(_factor_record(f"{name}.lora_B.{adapter}", b_parts, n_out, group))
    return out


def live_records(root, hf_prefix: str, hf_records: list):
    """The records of `root` as it is now: the sharding pass's (of the HF model under
    `hf_prefix`), a LoRA-wrapped layer's under `<name>.base_layer`, and every adapter present
    (adapters added, deleted, merged and unloaded after parallelize included)."""

    def records():
        wrapped = {n: m for n, m in root.named_modules()
                   if isinstance(m, lora_class()) or isinstance(m, lora_experts.wrapper_class())}  # fmt: skip
        out = []
        for record in hf_records:
            full = hf_prefix + record.prefix
            while full in wrapped:  # under each wrapper around it (one per adapted parameter of experts)
                full += ".base_layer"
            out.append(record._replace(prefix=full))
        for name, layer in wrapped.items():
            records_of = lora_experts.adapter_records if lora_experts.is_param_wrapper(layer) else adapter_records
            out += records_of(name, layer)
        return out

    return LiveRecords(records)


# -- order 1: parallelize a peft model -----------------------------------------------------------
def _inner_model(model):
    """(the HF model peft wraps, its name under `model` with a trailing dot)."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraModel
    except ImportError:
        return model, ""
    if isinstance(model, PeftModel):
        return model.base_model.model, "base_model.model."
    if isinstance(model, LoraModel):
        return model.model, "model."
    return model, ""


def _check_layer(name, layer):
    from peft.tuners.lora.layer import Linear

    if type(layer) is lora_class():
        _refuse(name, "already tensor-parallel (tplayers.parallelize was called twice)")
    if type(layer) is not Linear:
        _refuse(name, f"peft's {type(layer).__name__} is not supported; target linear projections only")
    if layer.merged:
        _refuse(name, "has merged adapters; unmerge them (model.unmerge_adapter()) before parallelize")
    if layer.lora_variant:
        _refuse(name, f"peft's LoRA variant {type(next(iter(layer.lora_variant.values()))).__name__} is not supported")


def _set_child(root, name, module):
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def _saved_copies_whole(hf, plan) -> dict:
    """`plan` with peft's `modules_to_save` copies of a linear (an LM head or classifier trained
    whole beside its frozen original, often for added tokens) kept whole on every rank, as peft
    computes them, where the plan does not place them itself."""
    from peft.utils import ModulesToSaveWrapper

    plan = dict(plan or {})
    for name, wrapper in hf.named_modules():
        if isinstance(wrapper, ModulesToSaveWrapper):
            for inner, module in wrapper.named_modules(prefix=name):
                if isinstance(module, nn.Linear) and inner not in plan:
                    plan[inner] = "replicate"
    return plan


def parallelize_peft(model, layers: dict, shard, *, group, verify, **kwargs):
    """`parallelize` of a model holding peft LoRA layers (`layers`, by name): the HF model is
    sharded as it would be without them (only no two adapted projections fused into one, e.g.
    a gated MLP's gate / up keep their own layers), then each LoRA layer is put back around its
    tplayers base with its adapters sharded. `shard(hf_model, keep=names, verify=False, ...)`
    is parallelize's own pass."""
    from tplayers.hf import verify as verification

    experts = {n: m for n, m in layers.items() if lora_experts.is_param_wrapper(m)}  # on the experts' parameters
    layers = {n: m for n, m in layers.items() if n not in experts}
    outermost = [n for n in experts if not (n.endswith(".base_layer") and n[: -len(".base_layer")] in experts)]
    for name, layer in layers.items():
        _check_layer(name, layer)
    for name, layer in experts.items():
        if layer.merged:
            _refuse(name, "has merged adapters; unmerge them (model.unmerge_adapter()) before parallelize")
    n = dist.get_world_size(group)
    probe = verification.before(model, verify, n)
    hf, hf_prefix = _inner_model(model)
    root_keys = list(model.state_dict().keys())
    for name in [*layers, *outermost]:  # the plain HF model the sharding pass knows
        _set_child(model, name, (layers.get(name) or experts[name]).get_base_layer())
    relative = {name[len(hf_prefix) :]: name for name in layers}
    kwargs["plan"] = _saved_copies_whole(hf, kwargs.get("plan"))
    shard(hf, keep=frozenset(relative), verify=False, group=group, **kwargs)
    records = state_of(hf).exports  # the base as frozen as peft left it (the pass keeps requires_grad)
    record_weight_maps(hf, records)
    cls = lora_class()
    for rel, name in relative.items():
        layer = layers[name]
        try:
            base = hf.get_submodule(rel)
        except AttributeError:
            _refuse(name, "tplayers fused it into another module; it cannot carry an adapter")
        if not isinstance(base, SUPPORTED) and not replicated_base(base):
            _refuse(name, f"tplayers holds it as {type(base).__name__}, not a column / row layer; drop it from "
                          "target_modules")  # fmt: skip
        layer.base_layer = base
        layer.__class__ = cls  # peft's layer, its adapters sharded now and whenever added later
        layer.fan_in_fan_out = False  # the base is (out, in) now, whatever HF stored
        layer.in_features, layer.out_features = base_features(base)
        for adapter in list(layer.lora_A):
            shard_adapter(layer, adapter)
        _set_child(model, name, layer)
    for name in outermost:  # each chain of wrappers (one per adapted parameter) around its ParallelExperts
        chain = [experts[name]]
        while lora_experts.is_param_wrapper(chain[-1].base_layer):
            chain.append(chain[-1].base_layer)
        chain[-1].base_layer = hf.get_submodule(name[len(hf_prefix) :])
        for depth, layer in enumerate(chain):
            lora_experts.check_base(name + ".base_layer" * depth, layer)
            lora_experts.localize(layer)
            for adapter in list(layer.lora_A):
                lora_experts.shard_whole(layer, adapter)
        _set_child(model, name, chain[0])
    held = state_of(hf)
    return finish(model, probe, group=group, exports=live_records(model, hf_prefix, records), original_keys=root_keys,
                  tied={hf_prefix + k: hf_prefix + v for k, v in (held.tied or {}).items()},
                  sequence_group=held.sequence_group, expert_group=kwargs.get("expert_group"),
                  inputs_checked_on=hf)  # re-armed: the user's first forward is checked  # fmt: skip


# -- export ---------------------------------------------------------------------------------------
def save_adapter(model, path, *, group=None, **kwargs) -> None:
    """peft's adapter directory (adapter_config.json + adapter_model.safetensors, whole tensors)
    of a parallelized peft model, written by the first rank of the model's groups through peft's
    own `save_pretrained`; a collective on every rank of them (`group`: as `save_pretrained`'s)."""
    from tplayers.hf.state_dict import gather_state_dict
    from tplayers.placement import covering_group

    pg = covering_group(list(model.parameters()), group, "save_pretrained")
    full = gather_state_dict(model)
    if dist.get_rank(pg) == 0:
        model.save_pretrained(path, state_dict=full, **kwargs)
    dist.barrier(group=pg)


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


__all__ = ["lora_layers", "parallelize_peft", "save_adapter"]
