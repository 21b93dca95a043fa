"""Order 2 of LoRA on a tensor-parallel model (`tplayers.hf.lora`): `tplayers.get_peft_model`
on a model `tplayers.parallelize` already sharded, through peft's custom-module registration,
with what the sharding changed about the model's modules made good first: a gated MLP fused into
one ParallelMLP split back into the HF projections, names peft would skip refused, and the keys in
the unsharded peft model's order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tplayers.functional.collectives import all_gather_sequence, copy_to_tp_region
from tplayers.hf import lora_experts, model_methods
from tplayers.hf.lora import (
    SUPPORTED,
    _factor_record,
    _inner_model,
    _set_child,
    live_records,
    lora_class,
    on_whole_base,
    place_whole_adapter,
    record_weight_maps,
)
from tplayers.hf.shard import on_device
from tplayers.hf.state_dict import export_records
from tplayers.nn.linear import ColumnParallelLinear
from tplayers.state import set_state, state_of


def get_peft_model(model, config, adapter_name: str = "default", **kwargs):
    """`peft.get_peft_model` on a model `tplayers.parallelize` already sharded: peft's own call,
    with tplayers' column / row layers registered as LoRA targets (peft's custom-module
    registration), each adapter sharded like its base as peft makes it. A target the sharding
    fused away (a gated MLP's gate_proj / up_proj inside ParallelMLP) is refused on every rank,
    naming it: add LoRA before parallelize for those (order 1)."""
    import peft

    records = export_records(model)
    if not records:
        raise ValueError("tplayers.get_peft_model: the model is not parallelized (call tplayers.parallelize first)")
    if isinstance(config.target_modules, str) and config.target_modules == "all-linear":
        raise ValueError(
            "tplayers.get_peft_model: target_modules='all-linear' looks for nn.Linear modules, which parallelize "
            "replaced; name the projections (e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', "
            "'down_proj']) or add LoRA before parallelizing"
        )
    if getattr(config, "modules_to_save", None):
        raise ValueError(
            f"tplayers.get_peft_model: modules_to_save={list(config.modules_to_save)} would copy modules tplayers "
            "already sharded, copies no export knows (a checkpoint would lose them); add them with "
            "peft.get_peft_model before parallelize, which keeps the copies whole on every rank"
        )
    _refuse_internal_names(model, config)
    _unfuse_targeted_mlps(model, config)
    _refuse_fused_targets(model, config)
    cls = lora_class()
    config._register_custom_module(dict.fromkeys(SUPPORTED, cls))
    peft_model = peft.get_peft_model(model, config, adapter_name=adapter_name, **kwargs)
    for name, layer in peft_model.named_modules():
        if on_whole_base(layer):  # peft's own layer on a linear kept whole (MLA's latents): adapters whole
            for adapter in layer.lora_A:
                place_whole_adapter(layer, adapter)
        elif lora_experts.is_param_wrapper(layer):  # on the experts' parameters, in this rank's shapes
            lora_experts.check_base(name, layer)
            lora_experts.localize(layer)
            for adapter in layer.lora_A:
                lora_experts.adopt(layer, adapter)
    hf, hf_prefix = _inner_model(peft_model)
    held = state_of(hf)
    set_state(peft_model, exports=live_records(peft_model, hf_prefix, held.exports),
              original_keys=_peft_key_order(peft_model, hf_prefix, held.original_keys),
              tied={hf_prefix + k: hf_prefix + v for k, v in (held.tied or {}).items()})  # fmt: skip
    model_methods.install(peft_model)
    return peft_model


class GatedMLP(nn.Module):
    """A SwiGLU MLP as separate tplayers layers under the HF names, for LoRA targets that
    ParallelMLP fused: gate_proj and up_proj (or one gate_up_proj holding [gate_r; up_r])
    column-parallel on the input prepared once (its gradient summed, or the sequence gathered),
    down_proj row-parallel: the same shards, the same communication, without the fused GEMM."""

    def __init__(self, down_proj, group, sequence_parallel, **columns):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        for name, layer in columns.items():
            setattr(self, name, layer)
        self.down_proj = down_proj

    def forward(self, x):
        x = (all_gather_sequence if self.sequence_parallel else copy_to_tp_region)(x, self.group)
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.functional.silu(gate) * up)


def _unfuse_targeted_mlps(model, config):
    """Each ParallelMLP (SwiGLU) whose HF gate / up projections are LoRA targets, replaced by a
    `GatedMLP` holding the same shards under the HF names, with its export records."""
    from peft.tuners.tuners_utils import check_target_module_exists

    from tplayers.nn.mlp import ParallelMLP

    records = state_of(model).exports
    for record in list(records):
        prefix, layout = record.prefix, record.pieces
        try:
            mlp = model.get_submodule(prefix)
        except AttributeError:
            continue
        if not isinstance(mlp, ParallelMLP) or mlp.activation != "swiglu":
            continue
        keys = {piece.key.rpartition(".")[0] for piece in layout()}
        if not any(check_target_module_exists(config, f"{prefix}.{key}") for key in keys):
            continue
        new, new_records = _gated_mlp(prefix, mlp, layout(), keys)
        _set_child(model, prefix, new)
        at = next(i for i, r in enumerate(records) if r.prefix == prefix)
        records[at : at + 1] = new_records
        record_weight_maps(model, new_records)


def _gated_mlp(prefix, mlp, old_pieces, keys):
    """(GatedMLP, its records) from a SwiGLU ParallelMLP whose record lists `old_pieces`."""
    group, w, b = mlp.in_proj.group, mlp.in_proj.weight.detach(), mlp.in_proj.bias
    gate_rows = next(p.glob for p in old_pieces if p.key.endswith("weight") and p.param is mlp.in_proj.weight)
    ffn = mlp.out_proj.in_features
    parts = {"gate_proj": (w[0::2], None if b is None else b.detach()[0::2], gate_rows % ffn),
             "up_proj": (w[1::2], None if b is None else b.detach()[1::2], gate_rows % ffn)}  # fmt: skip
    if "gate_up_proj" in keys:  # one HF tensor [gate; up]: local [gate_r; up_r], chunked by the forward
        (gw, gb, own), (uw, ub, _) = parts["gate_proj"], parts["up_proj"]
        parts = {"gate_up_proj": (torch.cat([gw, uw]), None if gb is None else torch.cat([gb, ub]),
                                  torch.cat([own, ffn + own]))}  # fmt: skip
    columns, records = {}, []
    for name, (weight, bias, rows) in parts.items():
        total = 2 * ffn if name == "gate_up_proj" else ffn
        layer = ColumnParallelLinear(
            mlp.in_proj.in_features, total, bias is not None, group=group, reduce_input_grad=False,
            overlap=mlp.in_proj.overlap, split_sizes=_sizes(rows.numel(), group), device="meta", dtype=weight.dtype,
        )  # fmt: skip
        layer.weight = nn.Parameter(weight.clone(), requires_grad=mlp.in_proj.weight.requires_grad)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=mlp.in_proj.bias.requires_grad)
        layer._tag_parameters()
        columns[name] = on_device(layer, weight.device)
        records.append(_factor_record(f"{prefix}.{name}", [(columns[name], 0, rows, True)], total, group))
    down = mlp.out_proj
    down_rows = next(p.glob for p in old_pieces if p.param is down.weight)
    records.append(_factor_record(f"{prefix}.down_proj", [(down, 1, down_rows, True)], ffn, group))
    return GatedMLP(down, group, mlp.sequence_parallel, **columns), records


def _sizes(local: int, group) -> list[int]:
    """Every rank's row count, from this rank's (one tiny all-gather)."""
    told = [None] * dist.get_world_size(group)
    dist.all_gather_object(told, local, group=group)
    return told


def _refuse_internal_names(model, config):
    """ParallelMLP's in_proj (its fused gate|up, read by the SwiGLU kernel, not through its
    forward: an adapter there would be skipped) and out_proj are tplayers' names, not the
    model's: targets name the HF projections (gate_proj, up_proj, down_proj)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    from tplayers.nn.mlp import ParallelMLP

    for name, module in model.named_modules():
        if isinstance(module, ParallelMLP):
            for child in ("in_proj", "out_proj"):
                if check_target_module_exists(config, f"{name}.{child}"):
                    raise ValueError(
                        f"tplayers.get_peft_model: {name}.{child} is tplayers' fused MLP layer; target the model's "
                        "own projections (gate_proj, up_proj, down_proj, or gate_up_proj)"
                    )


def _peft_key_order(peft_model, hf_prefix, hf_keys) -> list[str]:
    """The keys the unsharded peft model's state dict lists, in its order: the HF model's keys,
    a wrapped module's under `base_layer`, followed by its adapters' factors (peft's order:
    every lora_A, then every lora_B)."""
    wrapped = {
        n[len(hf_prefix) :]: m for n, m in peft_model.named_modules()
        if isinstance(m, lora_class()) or on_whole_base(m) or lora_experts.is_param_wrapper(m)
    }  # fmt: skip
    out, done = [], set()
    for key in hf_keys:
        module, _, leaf = key.rpartition(".")
        if module not in wrapped:
            out.append(hf_prefix + key)
            continue
        chain = [module]  # the wrappers around it, outermost first (one per adapted parameter of experts)
        while chain[-1] + ".base_layer" in wrapped:
            chain.append(chain[-1] + ".base_layer")
        inner = chain[-1] + ".base_layer"
        out.append(f"{hf_prefix}{inner}.{leaf}")
        if module in done:
            continue
        done.add(module)
        pending = [k for k in hf_keys if k.rpartition(".")[0] == module and k != key]
        out += [f"{hf_prefix}{inner}.{k.rpartition('.')[2]}" for k in pending]
        for name in reversed(chain):  # peft's order: the innermost wrapper's factors first
            for factor in ("lora_A", "lora_B"):
                for adapter, part in getattr(wrapped[name], factor).items():
                    bias = "bias" if isinstance(getattr(part, "bias", None), torch.Tensor) else None
                    out += [f"{hf_prefix}{name}.{factor}.{adapter}.{k}" for k in ("weight", bias) if k]
    return list(dict.fromkeys(out))


def _refuse_fused_targets(model, config):
    """A target name that matched a module of the HF model (its original state-dict keys) but
    matches none now: tplayers fused it, and peft would silently skip it."""
    from peft.tuners.tuners_utils import check_target_module_exists

    original = {k.rpartition(".")[0] for k in state_of(model).original_keys}
    present = {name for name, _ in model.named_modules()}
    lost = sorted(n for n in original - present if check_target_module_exists(config, n))
    if lost:
        raise ValueError(
            f"tplayers.get_peft_model: {lost[0]} (a LoRA target) is fused into another module by tplayers.parallelize; "
            "add the adapters before parallelizing (peft.get_peft_model, then tplayers.parallelize)"
        )
