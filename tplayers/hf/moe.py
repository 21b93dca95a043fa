"""Mixture-of-experts blocks (Mixtral, Qwen2-MoE, and any HF experts module in transformers 5's
fused layout): every expert sharded like a dense MLP, the router replicated.

transformers 5 keeps all experts of a layer in one module with two 3-D parameters:
gate_up_proj (E, 2F, H) holding [gate; up] per expert, and down_proj (E, H, F); its forward
sends each token to its top-k experts and sums act(gate) * up -> down, weighted by the
router. Each expert's gate and up are split by columns (rank r keeps [gate_r; up_r], its rows
of each half, F split in 16-byte-aligned blocks as evenly as they go, placement Shard(1)) and
down by rows (its columns F, Shard(2)), so each rank holds its share of every expert and
computes a partial sum of the block's output:

    no sequence parallelism   the tokens and routing weights enter through copy_to_tp_region
                              (their gradients, partial on each rank, are summed), the output
                              leaves through one all-reduce: the cost of a dense MLP
    sequence parallelism      the block sees this rank's tokens: tokens, expert indices and
                              weights are all-gathered along the tokens, the output
                              reduce-scattered back to this rank's tokens

The router sees whole tokens on every rank and gets the whole gradient (under sequence
parallelism, parallelize sums its gradient like a norm's). Expert parallelism (whole experts per
rank) is not done here.
"""

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from tplayers.functional.collectives import (
    all_gather_dim,
    all_gather_sequence,
    copy_to_tp_region,
    own_slice,
    reduce_from_tp_region,
    reduce_scatter_sequence,
)
from tplayers.hf import pieces
from tplayers.hf.shard import ShardingPass, copy_in, gather
from tplayers.placement import even_sizes, set_placement

EXPERT_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")
# Flags HF's experts decorator sets; any other value is a layout or math this module does not know.
KNOWN_FLAGS = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
               "has_post_expert_norm": False}  # fmt: skip


def is_experts(module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3


def _check(name, module):
    unknown = {k: getattr(module, k) for k, v in KNOWN_FLAGS.items() if getattr(module, k, v) != v}
    experts, two_f, hidden = module.gate_up_proj.shape
    if unknown or two_f % 2 or tuple(module.down_proj.shape) != (experts, hidden, two_f // 2):
        raise ValueError(
            f"parallelize: {name} ({type(module).__name__}) holds experts in a layout tplayers does not know "
            f"(gate_up_proj {tuple(module.gate_up_proj.shape)}, down_proj {tuple(module.down_proj.shape)}"
            f"{', ' + str(unknown) if unknown else ''}); pass a plan for this model"
        )
    params = list(inspect.signature(type(module).forward).parameters)[1:4]
    if tuple(params) != EXPERT_INPUTS:
        raise ValueError(f"parallelize: {name} ({type(module).__name__}) takes {params}, not {list(EXPERT_INPUTS)}")


def _expert_hooks(module, group, sequence_parallel):
    if sequence_parallel:
        prepare = (
            lambda h: all_gather_sequence(h, group, 0),
            lambda i: all_gather_dim(i, 0, group),
            lambda w: all_gather_sequence(w, group, 0),
        )
        finish = lambda y: reduce_scatter_sequence(y, group, 0)  # noqa: E731
    else:
        prepare = (lambda h: copy_to_tp_region(h, group), lambda i: i, lambda w: copy_to_tp_region(w, group))
        finish = lambda y: reduce_from_tp_region(y, group)  # noqa: E731

    def before(mod, args, kwargs):
        values = list(args) + [kwargs.pop(k) for k in EXPERT_INPUTS[len(args) :]]
        return tuple(f(v) for f, v in zip(prepare, values, strict=True)), kwargs

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(lambda mod, args, out: finish(out))


def aligned_unit(f, n) -> int:
    """The unit F splits in: HF's grouped GEMM over the experts needs the rows of down_proj (E, H,
    F) 16-byte aligned, so F splits in whole blocks of up to 16 entries (16 bytes in any dtype
    from fp8 to fp32), the largest that divides F and leaves every rank a block."""
    return next(u for u in (16, 8, 4, 2, 1) if f % u == 0 and f // u >= n or u == 1)


def experts(sp: ShardingPass, name, module):
    """Shard every expert of `module` over the group (see the module docstring)."""
    _check(name, module)
    f = module.gate_up_proj.shape[1] // 2  # any size: its aligned blocks as evenly as they go
    unit = aligned_unit(f, sp.n)
    blocks = even_sizes(f // unit, sp.n)
    sizes = [unit * s for s in blocks]

    def own(t, dim):
        return own_slice(t, dim, sp.group, unit, blocks)

    with torch.no_grad():
        gate, up = module.gate_up_proj.detach().chunk(2, 1)
        local = {
            "gate_up_proj": torch.cat([own(gate, 1), own(up, 1)], 1),
            "down_proj": own(module.down_proj.detach(), 2),
        }
    for key, dim in (("gate_up_proj", 1), ("down_proj", 2)):
        param = nn.Parameter(local[key].clone(), requires_grad=getattr(module, key).requires_grad)
        setattr(module, key, param)
        set_placement(param, sp.group, Shard(dim))
    if isinstance(getattr(module, "intermediate_dim", None), int):
        module.intermediate_dim = sizes[dist.get_rank(sp.group)]
    _expert_hooks(module, sp.group, sp.sp)

    def export(pick, group):
        out = {}
        gate_up = gather(pick(module.gate_up_proj), 1, group)
        if gate_up is not None:  # [gate_0; up_0; gate_1; up_1; ...] -> [gate; up]
            halves = [rank.chunk(2, 1) for rank in gate_up.split([2 * s for s in sizes], 1)]
            out["gate_up_proj"] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 1)
        down = gather(pick(module.down_proj), 2, group)
        if down is not None:
            out["down_proj"] = down
        return out

    def load(full):
        gate, up = full["gate_up_proj"].chunk(2, 1)
        copy_in(module.gate_up_proj, torch.cat([own(gate, 1), own(up, 1)], 1))
        copy_in(module.down_proj, own(full["down_proj"], 2))

    def layout():  # gate_up holds [gate_r | up_r] along dim 1: this rank's 1/n of each half
        return [*pieces.halves("gate_up_proj", module.gate_up_proj, 1, sp.group, f, unit=unit, sizes=blocks),
                pieces.split("down_proj", module.down_proj, 2, sp.group, total=f, unit=unit, sizes=blocks)]  # fmt: skip

    sp.exports.append((name, export, load, layout))
    sp.done.add(name)
