"""LoRA on experts: peft's ParamWrapper (`LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])`) on a `tplayers.nn.ParallelExperts`, each adapter's factors held where
their experts and features are (`tplayers.hf.lora` does the linear layers).

peft adapts a 3-D parameter W (E, out, in) with each expert's factors stacked in two matrices:
lora_A (E r, in) holds expert e's A_e in rows e r .. e r + r - 1, lora_B (out, r E) its B_e in
columns e, E + e, 2 E + e, ...; while the base runs it parametrizes W_e + s B_e A_e. On a rank
holding experts [e0, e0 + E_r) and, over TP, the features `own` of each:

    gate_up_proj (E_r, 2f, H)   lora_A (E_r r, H)   its experts' rows; whole over TP, its gradient
                                                    summed over TP (each rank's rows of B give part)
                                lora_B (2f, r E_r)  its [gate; up] rows, its experts' columns
    down_proj (E_r, H, f)       lora_A (E_r r, f)   its experts' rows, its features' columns
                                lora_B (H, r E_r)   its experts' columns; whole over TP, summed

so peft's own forward computes this rank's part of each of its experts' W + s B A. The factors
carry the experts' records (`ep_group`): clipping, the loss scaler and `data_parallel` (ZeRO 0,
over the experts' own replicas; the gradient divided with the experts') treat them as the
experts. `gather_state_dict`, checkpoints and `save_pretrained` use peft's unsharded names
and shapes. Refused by name: a layer other than the standard experts (gpt-oss's, Llama 4's),
ZeRO 2-3 (FSDP2 and peft's parametrization both replace the parameter), peft's variants.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from tplayers.hf import pieces
from tplayers.hf.lora_checks import EXPERT_LORA, _refuse, check_config, keep_whole
from tplayers.hf.shard import copy_in, gather
from tplayers.hf.state_dict import ExportRecord
from tplayers.nn.experts import ParallelExperts
from tplayers.placement import seal, set_placement, shard_range, update_placement


def is_param_wrapper(layer) -> bool:
    """peft's LoRA wrapper of a parameter (ParamWrapper, or tplayers' subclass of it)."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        return False
    return isinstance(layer, ParamWrapper)


@functools.cache
def wrapper_class():
    """`ExpertParallelParamWrapper`: peft's ParamWrapper on a ParallelExperts, its adapters placed
    as they are made (`get_peft_model`, `add_adapter`, `load_adapter` go through `update_layer`)."""
    from peft.tuners.lora.layer import ParamWrapper

    class ExpertParallelParamWrapper(ParamWrapper):
        def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
            check_config(config, f"{type(self.get_base_layer()).__name__}.{self.parameter_name}")
            super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)  # this rank's shapes
            adopt(self, adapter_name)

    return ExpertParallelParamWrapper


def check_base(name, layer):
    """The innermost base of `layer` is a standard ParallelExperts (its layout and math)."""
    base = layer.get_base_layer()
    if type(base) is not ParallelExperts or layer.parameter_name not in ("gate_up_proj", "down_proj"):
        _refuse(name, f"{type(base).__name__}.{layer.parameter_name}: " + EXPERT_LORA)
    if layer.merged:
        _refuse(name, "has merged adapters; unmerge them (model.unmerge_adapter()) before parallelize")


class _Geometry:
    """What this rank holds of one adapted parameter of `experts`: its experts [e0, e0 + n) of E,
    its features `own` of F, and the unsharded factors' shapes for rank r."""

    def __init__(self, experts: ParallelExperts, name: str):
        self.experts, self.up = experts, name == "gate_up_proj"
        n_tp, r_tp = dist.get_world_size(experts.group), dist.get_rank(experts.group)
        unit = experts.unit
        start, size = (unit * v for v in shard_range(experts.ffn_size // unit, n_tp, r_tp, experts.ffn_blocks))
        self.own, self.tp_sizes = torch.arange(start, start + size), [unit * b for b in experts.ffn_blocks]
        self.e0, self.n, self.total = experts.first_expert, experts.local_experts, experts.num_experts
        f, h = experts.ffn_size, experts.hidden_size
        self.features = torch.cat([self.own, self.own + f]) if self.up else self.own  # rows of B / columns of A
        self.width = 2 * f if self.up else f  # the F side of the parameter (out of gate_up, in of down)
        self.hidden = h

    def expert_rows(self, r):  # of lora_A
        return torch.arange(self.e0 * r, (self.e0 + self.n) * r)

    def expert_columns(self, r):  # of lora_B, in peft's order (column j E + e), this rank's local order
        return (torch.arange(r)[:, None] * self.total + self.e0 + torch.arange(self.n)[None, :]).flatten()

    def local(self, a, b, r):
        """This rank's (A, B) of the unsharded factors a (E r, in), b (out, r E)."""
        a = a.index_select(0, self.expert_rows(r).to(a.device))
        b = b.index_select(1, self.expert_columns(r).to(b.device))
        if self.up:
            return a, b.index_select(0, self.features.to(b.device))
        return a.index_select(1, self.features.to(a.device)), b


def adopt(layer, adapter):
    """An adapter peft made in this rank's shapes (order 2, or added after parallelize): the factor
    kept whole over TP the TP group's first rank's, the records placed. Its values are not an
    unsharded adapter's cut (none exists); B starts at zero unless init_lora_weights says otherwise."""
    replicated = _factors(layer, adapter)[0 if layer.parameter_name == "gate_up_proj" else 1]
    _broadcast(replicated, layer.get_base_layer().group)
    _place(layer, adapter)


def _factors(layer, adapter):
    return layer.lora_A[adapter].weight, layer.lora_B[adapter].weight


def _broadcast(t, group):
    dist.broadcast(t.data, src=dist.get_global_rank(group, 0), group=group)


def shard_whole(layer, adapter):
    """Order 1: the unsharded adapter peft made (the same on every rank: the expert group's first
    rank's, then the TP group's first rank's), cut to this rank's factors."""
    experts = layer.get_base_layer()
    a, b = _factors(layer, adapter)
    for group in (experts.expert_group, experts.group):
        if group is not None:
            for t in (a, b):
                _broadcast(t, group)
    r = layer.r[adapter]
    local_a, local_b = _Geometry(experts, layer.parameter_name).local(a.detach(), b.detach(), r)
    for factors, value, old in ((layer.lora_A, local_a, a), (layer.lora_B, local_b, b)):
        linear = nn.Linear(value.shape[1], value.shape[0], bias=False, device="meta", dtype=value.dtype)
        linear.weight = nn.Parameter(value.clone(), requires_grad=old.requires_grad)
        factors[adapter] = linear
    _place(layer, adapter)


def localize(layer):
    """The wrapper's sizes as this rank's (peft reads them to make adapters and to view the factors)."""
    experts, geometry = layer.get_base_layer(), _Geometry(layer.get_base_layer(), layer.parameter_name)
    layer.num_experts = experts.local_experts
    f = geometry.features.numel()
    layer.in_features, layer.out_features = (experts.hidden_size, f) if geometry.up else (f, experts.hidden_size)
    layer.__class__ = wrapper_class()


def _place(layer, adapter):
    """The records of the adapter's factors: the experts' expert group; over TP the one split
    (B's rows of gate_up, A's columns of down), the other whole with its gradient summed."""
    experts = layer.get_base_layer()
    a, b = _factors(layer, adapter)
    split, summed, dim = (b, a, 0) if layer.parameter_name == "gate_up_proj" else (a, b, 1)
    set_placement(split, experts.group, Shard(dim))
    keep_whole(summed, experts.group, partial=True)
    if experts.expert_group is not None:
        for p in (a, b):
            update_placement(p, ep_group=experts.expert_group)
    seal(layer)


def adapter_records(name, layer) -> list:
    """The export records of every adapter's factors in `layer` under `name`, as peft names them."""
    out = []
    for adapter in layer.lora_A:
        out += [_record(f"{name}.lora_A.{adapter}", layer, adapter, "A"),
                _record(f"{name}.lora_B.{adapter}", layer, adapter, "B")]  # fmt: skip
    return out


def _record(prefix, layer, adapter, factor):
    experts = layer.get_base_layer()
    g = _Geometry(experts, layer.parameter_name)
    r = layer.r[adapter]
    module = (layer.lora_A if factor == "A" else layer.lora_B)[adapter]
    ep = experts.expert_group
    n_in, n_out = (g.hidden, g.width) if g.up else (g.width, g.hidden)  # peft's (in, out) of the parameter
    shape = (g.total * r, n_in) if factor == "A" else (n_out, r * g.total)

    def export(pick, group):
        t = pick(module.weight)
        if t is None:
            return {}
        if factor == "A":  # (E_r r, in) -> (E_r, r, in): features over TP (down), experts over EP
            t = t.view(g.n, r, -1)
            if not g.up:
                t = gather(t, 2, group)
            t = gather(t, 0, ep) if ep is not None else t
            return {"weight": t.reshape(shape)}
        t = t.view(t.shape[0], r, g.n)  # (out, r E_r): rows over TP (gate_up's [gate_r; up_r]), experts over EP
        if g.up:
            halves = [part.chunk(2, 0) for part in gather(t, 0, group).split([2 * s for s in g.tp_sizes], 0)]
            t = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
        t = gather(t, 2, ep) if ep is not None else t
        return {"weight": t.reshape(shape)}

    def load(full):
        t = full["weight"]
        if factor == "A":
            a = t.index_select(0, g.expert_rows(r).to(t.device))
            copy_in(module.weight, a if g.up else a.index_select(1, g.features.to(t.device)))
            return
        b = t.index_select(1, g.expert_columns(r).to(t.device))
        copy_in(module.weight, b.index_select(0, g.features.to(t.device)) if g.up else b)

    def layout():
        w = module.weight
        if factor == "A":
            if g.up:
                return [pieces.block("weight", w, shape, (g.e0 * r, 0))]
            return [pieces.block("weight", w, shape, (g.e0 * r, 0), 1, torch.arange(g.own.numel()), g.own)]
        columns = (1, torch.arange(r * g.n), g.expert_columns(r))
        if g.up:  # its [gate; up] rows and its experts' columns
            return [pieces.cross("weight", w, shape, (0, torch.arange(g.features.numel()), g.features), columns)]
        return [pieces.block("weight", w, shape, (0, 0), *columns)]

    return ExportRecord(prefix, export, load, layout)
