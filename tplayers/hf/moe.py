"""Mixture-of-experts blocks (Mixtral, Qwen2-MoE, gpt-oss, Llama 4, and any HF experts module in
transformers 5's fused layouts): every expert sharded like a dense MLP, the router replicated.

transformers 5 keeps all experts of a layer in one module with two 3-D parameters, in the
layout its experts decorator names (`is_transposed`, `is_concatenated`, `has_bias`):

    gate_up_proj   (E, 2F, H), or (E, H, 2F) transposed (gpt-oss, Llama 4): each expert's gate
                   and up features, as [gate; up] halves or interleaved pairs (gpt-oss:
                   gate_0, up_0, gate_1, up_1, ...)
    down_proj      (E, H, F), or (E, F, H) transposed
    biases         gate_up_proj_bias (E, 2F) laid out as gate_up's features; down_proj_bias (E, H)

Its forward sends each token to its top-k experts and sums act(gate) * up -> down, weighted by
the router. Each rank keeps its share of every expert's F features (16-byte-aligned blocks as
evenly as they go): its rows of each half, or its whole pairs, of gate_up and its bias; its
features of down. It computes a partial sum of the block's output:

    no sequence parallelism   the tokens and routing weights enter through copy_to_tp_region
                              (their gradients, partial on each rank, are summed), the output
                              leaves through one all-reduce: the cost of a dense MLP
    sequence parallelism      the block sees this rank's tokens: tokens, expert indices and
                              weights are all-gathered along the tokens, the output
                              reduce-scattered back to this rank's tokens

down_proj_bias is added once to the summed output: every rank holds it whole and its forward
adds it, and every rank but rank 0 takes its (weighted) bias terms off its partial output before
the sum; each rank's gradient of it is then the whole one.

Llama 4's experts take the tokens already weighted and laid out expert by expert ((E * T, H),
one batched GEMM per expert): the same split, the tokens gathered (or summed) per expert.

LongCat-Flash's zero-computation experts (the token itself, weighted) would be summed once per
rank: every rank but rank 0 routes them a weight of 0.

The router sees whole tokens on every rank and gets the whole gradient (under sequence
parallelism, parallelize sums its gradient like a norm's). With an expert group, whole experts
are placed over it instead (`tplayers.hf.expert_parallel`).
"""

import copy
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from tplayers.functional.collectives import (
    all_gather_dim,
    all_gather_sequence,
    copy_to_tp_region,
    own_slice,
    reduce_from_tp_region,
    reduce_scatter_sequence,
)
from tplayers.functional.sequence import gathered_sizes
from tplayers.hf import expert_parallel, pieces
from tplayers.hf.shard import ShardingPass, copy_in, gather
from tplayers.hf.source import same_forward
from tplayers.hf.state_dict import ExportRecord
from tplayers.nn.experts import aligned_unit
from tplayers.placement import even_sizes, set_placement, shard_range

# (tokens, the experts each picks, their weights): transformers 5's names, and gpt-oss's
EXPERT_INPUTS = (
    ("hidden_states", "top_k_index", "top_k_weights"),
    ("hidden_states", "router_indices", "routing_weights"),
)
# Flags HF's experts decorator sets (with their defaults); the values this module splits exactly.
LAYOUT_FLAGS = {"is_concatenated": True, "is_transposed": False, "has_bias": False}
KNOWN_FLAGS = {"has_gate": (True,), "has_post_expert_norm": (False,), "is_concatenated": (True, False),
               "is_transposed": (True, False), "has_bias": (True, False)}  # fmt: skip
# Experts whose forward is not the decorator's but whose layout tplayers read from their source:
# class name -> (decorator flags, takes the tokens laid out expert by expert)
UNDECORATED = {"Llama4TextExperts": ({"is_transposed": True}, True)}


def is_experts(module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3


def _layout(name, module) -> tuple[dict, bool]:
    """(the decorator's flags, whether the forward takes tokens laid out expert by expert) of an
    experts module whose layout and forward tplayers knows; anything else is refused by name."""
    flags, by_expert = UNDECORATED.get(type(module).__name__, ({}, False))
    flags = {k: getattr(module, k, flags.get(k, default)) for k, default in LAYOUT_FLAGS.items()}
    unknown = {k: getattr(module, k) for k, ok in KNOWN_FLAGS.items() if getattr(module, k, ok[0]) not in ok}
    experts, *gate_up = module.gate_up_proj.shape
    computed = experts - _zero_computation_experts(name, module)  # the experts down_proj holds
    two_f, hidden = reversed(gate_up) if flags["is_transposed"] else gate_up
    down = (computed, two_f // 2, hidden) if flags["is_transposed"] else (computed, hidden, two_f // 2)
    biases = {"gate_up_proj_bias": (experts, two_f), "down_proj_bias": (experts, hidden)} if flags["has_bias"] else {}
    shapes_ok = all(tuple(getattr(getattr(module, k, None), "shape", ())) == v for k, v in biases.items())
    if unknown or two_f % 2 or tuple(module.down_proj.shape) != down or not shapes_ok:
        raise ValueError(
            f"parallelize: {name} ({type(module).__name__}) holds experts in a layout tplayers does not know "
            f"(gate_up_proj {tuple(module.gate_up_proj.shape)}, down_proj {tuple(module.down_proj.shape)}"
            f"{', ' + str(unknown) if unknown else ''}); pass a plan for this model"
        )
    params = tuple(inspect.signature(type(module).forward).parameters)[1:]
    expected = [("hidden_states",)] if by_expert else [names for names in EXPERT_INPUTS]
    if not any(params[: len(names)] == names for names in expected):
        raise ValueError(f"parallelize: {name} ({type(module).__name__}) takes {list(params)}, not {expected[0]}")
    return flags, by_expert


def _zero_computation_experts(name, module) -> int:
    """How many of `module`'s experts are zero-computation ones (LongCat-Flash: the experts past
    `num_routed_experts` return the token itself, weighted), read where tplayers knows the forward
    that computes them: HF's LongcatFlashExperts, line for line. 0 for any other experts module."""
    zero = getattr(module, "zero_expert_num", 0) or 0
    if not zero:
        return 0
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    if not same_forward(module, LongcatFlashExperts):
        raise ValueError(
            f"parallelize: {name} ({type(module).__name__}) holds {zero} zero-computation experts under a forward "
            "tplayers does not know (LongCat-Flash's is the one it splits); pass a plan for this model"
        )
    return zero


def _bias_terms(module, indices, weights):
    """sum_k weights[t, k] * down_proj_bias[indices[t, k]] for every token t (an index past the
    experts, HF's padding, adds nothing); the bias detached: its gradient is the forward's."""
    bias = module.down_proj_bias.detach()
    padded = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])
    return (weights.unsqueeze(-1).to(bias.dtype) * padded[indices.clamp(max=bias.shape[0])]).sum(1)


def _expert_hooks(module, group, sequence_parallel, bias_once=False, identity_from=None):
    """Tokens, expert indices and routing weights in (whole, or gathered along the tokens under
    sequence parallelism), the partial output summed (or reduce-scattered) out.

    `bias_once`: the forward adds down_proj_bias (weighted) to each rank's partial output, so the
    sum would hold it n times: every rank but rank 0 takes its bias terms off before the sum
    (`_bias_terms`, one rounding as the addition itself). The routing weights' gradient then sums
    to the unsharded one, and down_proj_bias's gradient is whole on every rank (the output
    gradient is whole there): a replicated parameter, with no hook on it.

    `identity_from`: experts from this index on return the token itself (LongCat-Flash's
    zero-computation experts), which every rank would add whole to its partial output: every rank
    but rank 0 routes them a weight of exactly 0, so the sum holds them once, and their gradients
    (the token's, the weight's) come from rank 0 alone and are summed with the others'."""
    shape = []  # the tokens' own layout on this rank, (B, s, H) or (tokens, H): the output's
    if sequence_parallel:  # gathered as rows (tokens, H): the ranks' parts of the sequence may differ in length
        prepare = (
            lambda h: all_gather_sequence(h.reshape(-1, h.shape[-1]), group, 0),
            lambda i: all_gather_dim(i, 0, group, sizes=gathered_sizes(i, 0, group)),  # int: no autograd
            lambda w: all_gather_sequence(w, group, 0),
        )
        finish = lambda y: reduce_scatter_sequence(y.reshape(-1, y.shape[-1]), group, 0).view(shape[-1])  # noqa: E731
    else:
        prepare = (lambda h: copy_to_tp_region(h, group), lambda i: i, lambda w: copy_to_tp_region(w, group))
        finish = lambda y: reduce_from_tp_region(y, group)  # noqa: E731
    names = next(n for n in EXPERT_INPUTS if tuple(inspect.signature(type(module).forward).parameters)[1:4] == n)

    def before(mod, args, kwargs):
        values = list(args) + [kwargs.pop(k) for k in names[len(args) :]]
        shape[:] = [values[0].shape]
        tokens, indices, weights = (f(v) for f, v in zip(prepare, values, strict=True))
        if identity_from is not None and dist.get_rank(group) != 0:
            weights = torch.where(indices >= identity_from, torch.zeros_like(weights), weights)
        return (tokens, indices, weights), kwargs

    def after(mod, args, out):
        if bias_once and dist.get_rank(group) != 0:
            out = out - _bias_terms(mod, args[1], args[2]).to(out.dtype).view_as(out)
        return finish(out)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)


def _by_expert_hooks(module, group, sequence_parallel, experts):
    """Llama 4: the tokens come laid out expert by expert, (E * T, H); under sequence parallelism
    each expert's rows are gathered along its tokens, and its output rows reduce-scattered back."""

    def per_expert(fn):
        return lambda t: fn(t.view(experts, -1, t.shape[-1])).reshape(-1, t.shape[-1])

    if sequence_parallel:
        prepare = per_expert(lambda t: all_gather_sequence(t, group, 1))
        finish = per_expert(lambda t: reduce_scatter_sequence(t, group, 1))
    else:
        prepare, finish = (lambda h: copy_to_tp_region(h, group)), (lambda y: reduce_from_tp_region(y, group))
    module.register_forward_pre_hook(lambda mod, args: (prepare(args[0]), *args[1:]))
    module.register_forward_hook(lambda mod, args, out: finish(out))


ALIGNED_ENTRIES = 8  # 16 bytes of bf16 / fp16: the row stride HF's grouped GEMM (torch._grouped_mm) needs


def _eager_where_unaligned(module, sizes):
    """A split too fine for 16-byte rows (a small F over many ranks: 16 over 8 leaves 2 per rank)
    cannot run HF's grouped GEMM, which needs them; that module alone runs HF's eager experts
    forward (the same math, one expert at a time), through its own copy of the config."""
    config = getattr(module, "config", None)
    if config is None or all(s % ALIGNED_ENTRIES == 0 for s in sizes):
        return
    module.config = copy.copy(config)
    module.config._experts_implementation = "eager"


def experts(sp: ShardingPass, name, module):
    """Shard every expert of `module` over the group (see the module docstring); transformers'
    standard experts, and any experts under an expert group, become `ParallelExperts`
    (`tplayers.hf.expert_parallel`: whole experts over the expert group, the grouped GEMM)."""
    flags, by_expert = _layout(name, module)
    if sp.expert_group is not None or expert_parallel.standard(module, flags, by_expert):
        return expert_parallel.experts(sp, name, module, flags, by_expert)
    n_experts = module.gate_up_proj.shape[0]
    fa, fd = (2, 1) if flags["is_transposed"] else (1, 2)  # the F axis of gate_up_proj, of down_proj
    f = module.gate_up_proj.shape[fa] // 2  # any size: its aligned blocks as evenly as they go
    unit = aligned_unit(f, sp.n)
    blocks = even_sizes(f // unit, sp.n)
    sizes = [unit * s for s in blocks]
    pairs = not flags["is_concatenated"]  # gpt-oss: gate / up interleaved, a rank keeps whole pairs

    def own(t, dim):
        return own_slice(t, dim, sp.group, unit, blocks)

    def own_gate_up(t, dim):  # [gate_r; up_r], or this rank's whole pairs
        if pairs:
            return own_slice(t, dim, sp.group, 2 * unit, blocks)
        gate, up = t.chunk(2, dim)
        return torch.cat([own(gate, dim), own(up, dim)], dim)

    split = {"gate_up_proj": (fa, own_gate_up), "down_proj": (fd, own)}
    if flags["has_bias"]:
        split["gate_up_proj_bias"] = (1, own_gate_up)
    with torch.no_grad():
        local = {key: cut(getattr(module, key).detach(), dim) for key, (dim, cut) in split.items()}
    for key, (dim, _) in split.items():
        param = nn.Parameter(local[key].clone(), requires_grad=getattr(module, key).requires_grad)
        setattr(module, key, param)
        set_placement(param, sp.group, Shard(dim))
    if flags["has_bias"]:  # whole on every rank, added once to the sum (`_expert_hooks`)
        set_placement(module.down_proj_bias, sp.group, Replicate())
    _eager_where_unaligned(module, sizes)
    for attr in ("intermediate_dim", "intermediate_size", "expert_dim"):
        if getattr(module, attr, None) == f:
            setattr(module, attr, sizes[dist.get_rank(sp.group)])
    if by_expert:
        _by_expert_hooks(module, sp.group, sp.sp, n_experts)
    else:
        zero = _zero_computation_experts(name, module)
        identity_from = n_experts - zero if zero else None
        _expert_hooks(module, sp.group, sp.sp, bias_once=flags["has_bias"], identity_from=identity_from)

    def gathered_gate_up(t, dim):
        if t is None or pairs:
            return t
        halves = [rank.chunk(2, dim) for rank in t.split([2 * s for s in sizes], dim)]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)  # [gate; up]

    def export(pick, group):
        out = {}
        for key, (dim, _) in split.items():
            full = gather(pick(getattr(module, key)), dim, group)
            full = full if key == "down_proj" else gathered_gate_up(full, dim)
            if full is not None:
                out[key] = full
        if flags["has_bias"] and pick(module.down_proj_bias) is not None:
            out["down_proj_bias"] = pick(module.down_proj_bias)
        return out

    def load(full):
        for key, (dim, cut) in split.items():
            copy_in(getattr(module, key), cut(full[key], dim))
        if flags["has_bias"]:
            copy_in(module.down_proj_bias, full["down_proj_bias"])

    def layout():
        def gate_up_pieces(key, dim):  # [gate_r | up_r] along dim: this rank's 1/n of each half; or its pairs
            param = getattr(module, key)
            if pairs:
                return [pieces.split(key, param, dim, sp.group, total=2 * f, unit=2 * unit, sizes=blocks)]
            return pieces.halves(key, param, dim, sp.group, f, unit=unit, sizes=blocks)

        out = [*gate_up_pieces("gate_up_proj", fa),
               pieces.split("down_proj", module.down_proj, fd, sp.group, total=f, unit=unit, sizes=blocks)]  # fmt: skip
        if flags["has_bias"]:
            down_bias = pieces.whole("down_proj_bias", module.down_proj_bias)
            out += [*gate_up_pieces("gate_up_proj_bias", 1), down_bias]
        return out

    sp.exports.append(ExportRecord(name, export, load, layout))
    sp.done.add(name)


def is_any_experts(module) -> bool:
    return is_experts(module) or is_dbrx_experts(module)


def experts_child(block) -> nn.Module | None:
    """The experts module directly under `block` (an MoE block), if any."""
    return next((m for m in block.children() if is_any_experts(m)), None)


def expert_count(experts) -> int:
    return experts.num_experts if is_dbrx_experts(experts) else experts.gate_up_proj.shape[0]


def routers(sp: ShardingPass, name, block):
    """An MoE block's routers, found by what they are: a linear layer whose outputs are one score
    per expert, held directly (Llama 4's `router`, PhiMoE's `router`) or as the only weight of a
    child (Hunyuan-MoE's `gate.wg`), beside vectors of its own at most (Gemma 4's router scales its
    input per feature and its weights per expert). Each is replicated: it sees whole tokens and
    gets its whole gradient (the routing weights' gradient is summed where they enter the experts),
    or under sequence parallelism sees this rank's tokens and has its gradient summed like a norm's."""
    n_experts = expert_count(experts_child(block))
    for child_name, child in block.named_children():
        if is_any_experts(child):
            continue
        linears = [(k, m) for k, m in child.named_modules() if isinstance(m, nn.Linear)]
        if len(linears) != 1 or linears[0][1].out_features != n_experts:
            continue  # a shared expert, a gate of its own kind: the other adapters see it
        own = {id(p) for p in linears[0][1].parameters()}
        if any(p.dim() > 1 for p in child.parameters() if id(p) not in own):
            continue  # a matrix beside the scores: not a router tplayers knows
        router = f"{name}.{child_name}"  # whole with its vectors: their gradient whole or summed as the scores'
        sp.done.add(router)
        sp.whole.add(router)


def is_dbrx_experts(module) -> bool:
    """DBRX's experts: mlp.w1 / v1 / w2, each (E * F, H), viewed (E, F, H) by its forward."""
    glu = getattr(module, "mlp", None)
    return type(module).__name__ == "DbrxExperts" and all(
        isinstance(getattr(glu, k, None), nn.Parameter) for k in ("w1", "v1", "w2")
    )


def dbrx_experts(sp: ShardingPass, name, module):
    """DBRX: gate (w1), up (v1) and down (w2, applied transposed) of every expert stacked as
    (E * F, H). Rank r keeps its F features of each expert (the rows e * F + its block, for every
    e), stacked the same way, and the forward's view reads the local F (ffn_hidden_size set
    locally); the tokens go in and out as for the fused layouts (`_expert_hooks`)."""
    if sp.expert_group is not None:
        return expert_parallel.dbrx_experts(sp, name, module)
    glu, n_experts, f, hidden = module.mlp, module.num_experts, module.ffn_hidden_size, module.hidden_size
    for key in ("w1", "v1", "w2"):
        if tuple(getattr(glu, key).shape) != (n_experts * f, hidden):
            raise ValueError(f"parallelize: {name}.mlp.{key} is not ({n_experts} x {f}, {hidden})")
    unit = aligned_unit(f, sp.n)
    blocks = even_sizes(f // unit, sp.n)
    start, size = (unit * v for v in shard_range(f // unit, sp.n, dist.get_rank(sp.group), blocks))
    own_rows = (torch.arange(n_experts)[:, None] * f + torch.arange(start, start + size)).flatten()
    for key in ("w1", "v1", "w2"):
        full = getattr(glu, key)
        param = nn.Parameter(full.detach()[own_rows].clone(), requires_grad=full.requires_grad)
        setattr(glu, key, param)
        set_placement(param, sp.group, Shard(0))  # rows per expert: the record below maps them exactly
    module.ffn_hidden_size = size
    _expert_hooks(module, sp.group, sp.sp)

    def export(pick, group):
        out = {}
        for key in ("w1", "v1", "w2"):
            local = pick(getattr(glu, key))
            if local is not None:  # (E, F_r, H) of each rank -> (E, F, H) -> (E * F, H)
                out[f"mlp.{key}"] = gather(local.view(n_experts, -1, hidden), 1, group).reshape(-1, hidden)
        return out

    def load(full):
        for key in ("w1", "v1", "w2"):
            copy_in(getattr(glu, key), full[f"mlp.{key}"][own_rows])

    def layout():
        return [pieces.rows(f"mlp.{key}", getattr(glu, key), own_rows, n_experts * f) for key in ("w1", "v1", "w2")]

    sp.exports.append(ExportRecord(name, export, load, layout))
    sp.done.add(name)
