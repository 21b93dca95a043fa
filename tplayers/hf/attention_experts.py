"""JetMoE: attention as a mixture of experts (MoA: each expert its own query and output projections
over keys and values all experts share) and MLP experts, both stacked in `JetMoeParallelExperts`
((E, out, in) weights, one GEMM per expert) and routed by a top-k gate inside the module.

Attention, split by key/value heads. The k-th expert a token picks gives its query heads
k * kv_heads + h, and query head k * kv_heads + h reads key/value head h (HF repeats the keys and
values top_k times; it does not interleave them): a rank holding key/value heads [a, b) holds those
heads' query rows of every expert and computes its query heads (k, a..b) for every k.
    kv_proj                 [k; v]: this rank's heads' rows of each half
    experts.input_linear    (E, kv_heads * head_dim, H): this rank's heads' rows of every expert
    experts.output_linear   (E, H, kv_heads * head_dim): the same heads' columns; a partial output
MLP experts, split by features like Mixtral's:
    input_linear            (E, 2F, H): this rank's features of each of [gate; up]
    output_linear           (E, H, F): the same features' columns; a partial output

Each module's input feeds all its projections: it enters as a shared input (its gradient summed
over the group, or gathered along the sequence under sequence parallelism), and the module's
partial output is summed (reduce-scattered) as it leaves. `bias`, added after the experts, is whole
on every rank and counted once: every rank but rank 0 takes it off before the sum (its gradient,
the summed output's, is whole everywhere).

The router (`router.layer`) is whole and sees whole tokens, so every rank routes alike. Its gates
enter the experts through copy_to_tp_region (their gradient, partial on each rank, summed): its
weight gets the whole gradient on every rank, the auxiliary loss's included. Its input's gradient,
whole on every rank, is passed on by rank 0 alone, since the module input's gradient is summed.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from tplayers.functional.collectives import copy_to_tp_region, own_slice, reduce_from_tp_region, reduce_scatter_sequence
from tplayers.hf import pieces
from tplayers.hf.attention import head_split, localize_attributes, split_per_head
from tplayers.hf.fused import fused_column, part_rows
from tplayers.hf.shard import ShardingPass, copy_in, gather
from tplayers.hf.source import same_forward, source
from tplayers.hf.state_dict import ExportRecord
from tplayers.placement import even_sizes, set_placement

GATES = 2  # the router's outputs: (index_sorted_experts, batch_index, batch_gates, expert_size, logits)


def _same_code(module, hf_class, methods=("forward",)) -> bool:
    return all(source(getattr(type(module), m)) == source(getattr(hf_class, m)) for m in methods)


def _same_experts(moe, hf) -> bool:
    """The module's router and stacked experts run transformers' code line for line."""
    return (
        same_forward(moe.router, hf.JetMoeTopKGating)
        and same_forward(moe.input_linear, hf.JetMoeParallelExperts)
        and same_forward(moe.output_linear, hf.JetMoeParallelExperts)
    )


def is_mixture_of_attention(module) -> bool:
    """JetMoE's attention and its MoA, with transformers' code line for line."""
    if type(module).__name__ != "JetMoeAttention":
        return False
    from transformers.models.jetmoe import modeling_jetmoe as hf

    moa = module.experts
    return (
        same_forward(module, hf.JetMoeAttention)
        and _same_code(moa, hf.JetMoeMoA, ("map", "reduce"))
        and _same_experts(moa, hf)
    )


def is_stacked_experts_mlp(module) -> bool:
    """JetMoE's MLP experts (JetMoeMoE), with transformers' code line for line."""
    if type(module).__name__ != "JetMoeMoE":
        return False
    from transformers.models.jetmoe import modeling_jetmoe as hf

    return same_forward(module, hf.JetMoeMoE) and _same_experts(module, hf)


def mixture_of_attention(sp: ShardingPass, name, attn):
    head_dim, kv_heads, top_k = attn.head_dim, attn.num_key_value_heads, attn.top_k
    split = head_split(f"{name} (its key/value heads)", kv_heads, sp.n)
    local = split[dist.get_rank(sp.group)]
    fused_column(sp, f"{name}.kv_proj", attn.kv_proj, part_rows([kv_heads * head_dim] * 2, sp.n, head_dim, split))
    moa = attn.experts
    split_per_head(sp, f"{name}.experts.input_linear", moa.input_linear, "weight", head_dim, split, dim=1)
    split_per_head(sp, f"{name}.experts.output_linear", moa.output_linear, "weight", head_dim, split, dim=2)
    moa.hidden_size = moa.input_linear.output_size = moa.output_linear.input_size = local * head_dim
    localize_attributes(
        name, attn, dict(num_key_value_heads=local, num_heads=local * top_k, kv_projection_size=local * head_dim)
    )
    _routed(sp, f"{name}.experts", moa, attn, output=0)
    sp.done.add(name)


def stacked_experts_mlp(sp: ShardingPass, name, moe):
    features = moe.hidden_size
    split = even_sizes(features, sp.n)

    def own(t):
        return own_slice(t, 1, sp.group, sizes=split)

    def own_gate_up(t):  # [gate_r; up_r]
        gate, up = t.chunk(2, 1)
        return torch.cat([own(gate), own(up)], 1)

    cuts = {"input_linear": own_gate_up, "output_linear": lambda t: own_slice(t, 2, sp.group, sizes=split)}
    for key, cut in cuts.items():
        experts = getattr(moe, key)
        weight = torch.nn.Parameter(cut(experts.weight.detach()).clone(), requires_grad=experts.weight.requires_grad)
        experts.weight = weight
        set_placement(weight, sp.group, Shard(1 if key == "input_linear" else 2))
    local = split[dist.get_rank(sp.group)]
    moe.hidden_size = moe.output_linear.input_size = local
    moe.input_linear.output_size = 2 * local

    def gate_up_export(pick, group):  # [gate_0; up_0; gate_1; up_1 ...] -> [gate; up]
        full = gather(pick(moe.input_linear.weight), 1, group)
        if full is None:
            return {}
        halves = [rank.chunk(2, 1) for rank in full.split([2 * s for s in split], 1)]
        return {"": torch.cat([h[0] for h in halves] + [h[1] for h in halves], 1)}

    def down_export(pick, group):
        full = gather(pick(moe.output_linear.weight), 2, group)
        return {} if full is None else {"": full}

    def loader(key):
        return lambda full: copy_in(getattr(moe, key).weight, cuts[key](full[""]))

    def gate_up_layout():
        return pieces.halves("", moe.input_linear.weight, 1, sp.group, features, sizes=split)

    def down_layout():
        return [pieces.split("", moe.output_linear.weight, 2, sp.group, total=features, sizes=split)]

    sp.exports += [
        ExportRecord(f"{name}.input_linear.weight", gate_up_export, loader("input_linear"), gate_up_layout),
        ExportRecord(f"{name}.output_linear.weight", down_export, loader("output_linear"), down_layout),
    ]
    _routed(sp, name, moe, moe, output=None)
    sp.done.add(name)


def _routed(sp: ShardingPass, name, experts, module, output):
    """The router whole, the bias counted once and `module`'s partial output (or its `output`-th
    item) summed over the group: see the module docstring."""
    sp.done.add(f"{name}.router")
    sp.whole.add(f"{name}.router")
    for p in (experts.bias, *experts.router.parameters()):  # whole gradients, under sequence parallelism too
        set_placement(p, sp.group, Replicate())
    sp.shared_input.append(module)
    if sp.n == 1:
        return
    group, first = sp.group, dist.get_rank(sp.group) == 0
    if not first:  # the router's input gradient is whole on every rank; the module's input sums it once
        experts.router.register_forward_pre_hook(lambda mod, args: (args[0].detach(), *args[1:]))
    experts.router.register_forward_hook(
        lambda mod, args, out: (*out[:GATES], copy_to_tp_region(out[GATES], group), *out[GATES + 1 :])
    )
    if sp.sp:
        finish = lambda y: reduce_scatter_sequence(y, group, 1)  # noqa: E731
    else:
        finish = lambda y: reduce_from_tp_region(y, group)  # noqa: E731

    bias = "bias" if experts is module else "experts.bias"  # read off the hooked module: a deep copy's own

    def summed(mod, args, out):
        y = out if output is None else out[output]
        y = finish(y if first else y - mod.get_parameter(bias).detach())
        return y if output is None else (*out[:output], y, *out[output + 1 :])

    module.register_forward_hook(summed)
