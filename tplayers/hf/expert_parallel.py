"""Expert parallelism for HF MoE models: `parallelize(model, expert_group=mesh["ep"])` replaces
each experts module with a `tplayers.nn.ParallelExperts` holding whole experts over the expert
group (and each expert's features split over the tensor-parallel group), under HF's own names
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). Without an expert group, standard experts
are replaced the same way (every expert on every rank, its features split over the TP group), so
the grouped GEMM kernel runs them too.

The replacement runs its own forward (dispatch, grouped GEMM, combine), so it is taken only for
experts whose math tplayers knows exactly: transformers 5's standard experts, whose forward is
the one 50-odd families share (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, Granite-MoE, ...):
act(x W_gate^T) * (x W_up^T) -> W_down, scaled by the routing weight, summed over the top k.
gpt-oss's experts (clamped, interleaved gate / up pairs with biases) go whole over the expert
group as `ClampedGluExperts` (one tensor-parallel rank). Llama 4's MoE block (its experts fed
every token expert by expert, each pre-scaled by its sigmoid routing score, zero for the experts
not picked) becomes `PreScaledMoe`: the same router and shared expert, the picked experts only
(`PreScaledExperts`, exact: an unpicked expert's zero input gives zero). DBRX's experts, stacked
(E F, H) in w1 / v1 / w2, become `StackedExperts` under their names. Anything else is refused by
name under an expert group; without one, its experts are split over the tensor-parallel group.
"""

import torch
import torch.distributed as dist
from torch import nn

from tplayers.hf import pieces
from tplayers.hf.shard import ShardingPass, copy_in, gather, on_device
from tplayers.hf.source import forward_source, same_forward, source
from tplayers.hf.state_dict import ExportRecord
from tplayers.nn.experts import ClampedGluExperts, ParallelExperts, PreScaledExperts, StackedExperts
from tplayers.placement import shard_range

STANDARD_FLAGS = {"is_concatenated": True, "is_transposed": False, "has_bias": False}


def refuse(name, module, why):
    raise ValueError(
        f"parallelize(expert_group=...): {name} ({type(module).__name__}) cannot be placed whole over the expert "
        f"group: {why}. Parallelize without expert_group (its experts are then split over the tensor-parallel "
        "group, exactly)"
    )


def _standard_forward() -> str:
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    return source(MixtralExperts.forward)


def is_standard(module) -> bool:
    """Whether `module`'s forward is transformers' standard experts forward, line for line."""
    return bool(forward_source(module)) and forward_source(module) == _standard_forward()


def standard(module, flags, by_expert) -> bool:
    """Whether `module` is transformers 5's standard experts: its layout and its forward."""
    return not by_expert and all(flags.get(k, v) == v for k, v in STANDARD_FLAGS.items()) and is_standard(module)


def is_gpt_oss(module) -> bool:
    """gpt-oss's experts: its class, whose forward tplayers' ClampedGluExperts computes."""
    if type(module).__name__ != "GptOssExperts":
        return False
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    return same_forward(module, GptOssExperts)


def is_llama4(block, module) -> bool:
    """Llama 4's MoE block around `module`: its classes, with HF's forwards (block, router, experts)."""
    if type(block).__name__ != "Llama4TextMoe" or not isinstance(getattr(block, "router", None), nn.Linear):
        return False
    from transformers.models.llama4 import modeling_llama4 as hf

    pairs = ((block, hf.Llama4TextMoe), (block.router, hf.Llama4Router), (module, hf.Llama4TextExperts))
    return all(same_forward(mine, theirs) for mine, theirs in pairs)


class PreScaledMoe(nn.Module):
    """Llama 4's MoE block with its experts whole over the expert group: HF's forward, with each
    token sent to its top-k experts only, scaled by its sigmoid score (HF feeds every expert every
    token, scaled by a score of zero where not picked, which gives zero: no bias, act(0) * 0 = 0).
    The router and the shared expert are the block's own (the shared expert placed as any MLP)."""

    def __init__(self, block, experts):
        super().__init__()
        self.top_k, self.hidden_dim, self.num_experts = block.top_k, block.hidden_dim, block.num_experts
        self.experts, self.router, self.shared_expert = experts, block.router, block.shared_expert  # HF's order

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_scores, router_logits = self.router(hidden_states)
        picked = torch.topk(router_logits, self.top_k, dim=1).indices  # the router's own picks
        out = self.shared_expert(hidden_states)
        return out + self.experts(hidden_states, picked, router_scores.gather(1, picked)), router_logits


def experts(sp: ShardingPass, name, module, flags, by_expert):
    """Replace `module` (transformers 5's standard experts) with a `ParallelExperts`: whole
    experts over the expert group if there is one, each expert's features over the TP group."""
    if sp.expert_group is not None and is_gpt_oss(module):
        return gpt_oss_experts(sp, name, module)
    block_name = name.rpartition(".")[0]
    block = sp.model.get_submodule(block_name) if block_name else None
    if sp.expert_group is not None and by_expert and is_llama4(block, module):
        new = PreScaledExperts.from_weights(module.gate_up_proj, module.down_proj, expert_group=sp.expert_group,
                                            group=sp.group, sequence_parallel=sp.sp, act_fn=module.act_fn)  # fmt: skip
        moe = PreScaledMoe(block, on_device(new, module.gate_up_proj.device)).train(block.training)
        parent, _, child = block_name.rpartition(".")
        setattr(sp.model.get_submodule(parent) if parent else sp.model, child, moe)  # its children still to place
        return _place(sp, name, moe.experts)
    if by_expert:
        refuse(name, module, "it takes the tokens laid out expert by expert, which the dispatch does not compute")
    odd = {k: v for k, v in flags.items() if STANDARD_FLAGS.get(k, v) != v}
    if odd:
        refuse(name, module, f"its experts are laid out {odd}, a forward the dispatch does not compute")
    if not is_standard(module):
        refuse(name, module, "its forward is not transformers' standard experts forward, which the dispatch computes")
    new = ParallelExperts.from_weights(
        module.gate_up_proj, module.down_proj, expert_group=sp.expert_group, group=sp.group,
        sequence_parallel=sp.sp, act_fn=module.act_fn,
    )  # fmt: skip
    sp.swap(name, on_device(new, module.gate_up_proj.device))
    _place(sp, name, new)


def _place(sp: ShardingPass, name, new):
    """The export records of `new` (a ParallelExperts in place under `name`): HF's tensors, in
    the layer's layout (`FEATURE_DIMS`: the F axis of gate_up_proj and of down_proj)."""
    sp.done.add(name)
    hidden, f = new.hidden_size, new.ffn_size
    tp_sizes = [new.unit * b for b in new.ffn_blocks]
    fa, fd = new.FEATURE_DIMS

    def export(pick, group):
        out = {}
        gate_up, down = pick(new.gate_up_proj), pick(new.down_proj)
        if gate_up is not None:  # every TP rank's [gate_r; up_r] -> [gate; up], then the experts in order
            halves = [part.chunk(2, fa) for part in gather(gate_up, fa, group).split([2 * s for s in tp_sizes], fa)]
            full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], fa)
            out["gate_up_proj"] = whole_experts(full)
        if down is not None:
            out["down_proj"] = whole_experts(gather(down, fd, group))
        return out

    def whole_experts(t):
        return gather(t, 0, new.expert_group) if new.expert_group is not None else t

    def load(full):
        copy_in(new.gate_up_proj, new.own_gate_up(full["gate_up_proj"]))
        copy_in(new.down_proj, new.own_down(full["down_proj"]))

    def layout():
        n_tp, r_tp = dist.get_world_size(new.group), dist.get_rank(new.group)
        start, size = (new.unit * v for v in shard_range(f // new.unit, n_tp, r_tp, new.ffn_blocks))
        own, offset = torch.arange(start, start + size), (new.first_expert, 0, 0)
        gate_up_shape, down_shape = [new.num_experts, hidden, hidden], [new.num_experts, hidden, hidden]
        gate_up_shape[fa], down_shape[fd] = 2 * f, f
        return [
            pieces.block("gate_up_proj", new.gate_up_proj, tuple(gate_up_shape), offset, dim=fa,
                         local=torch.arange(2 * size), glob=torch.cat([own, own + f])),
            pieces.block("down_proj", new.down_proj, tuple(down_shape), offset, dim=fd,
                         local=torch.arange(size), glob=own),
        ]  # fmt: skip

    sp.exports.append(ExportRecord(name, export, load, layout))


def gpt_oss_experts(sp: ShardingPass, name, module):
    """gpt-oss's experts whole over the expert group (`ClampedGluExperts`), under HF's names."""
    if sp.n > 1:
        why = "under expert parallelism its clamped, interleaved gate / up pairs are not split over TP (use tp=1)"
        refuse(name, module, why)
    new = on_device(ClampedGluExperts.from_hf(module, expert_group=sp.expert_group, group=sp.group,
                                              sequence_parallel=sp.sp), module.gate_up_proj.device)  # fmt: skip
    sp.swap(name, new)
    shapes = {key: tuple(getattr(module, key).shape) for key in ClampedGluExperts.WEIGHTS}

    def export(pick, group):
        held = {key: pick(getattr(new, key)) for key in ClampedGluExperts.WEIGHTS}
        return {key: gather(t, 0, new.expert_group) for key, t in held.items() if t is not None}

    def load(full):
        for key in ClampedGluExperts.WEIGHTS:
            copy_in(getattr(new, key), new.own(full[key]))

    def layout():
        return [pieces.block(key, getattr(new, key), shape, (new.first_expert,) + (0,) * (len(shape) - 1))
                for key, shape in shapes.items()]  # fmt: skip

    sp.exports.append(ExportRecord(name, export, load, layout))


def dbrx_experts(sp: ShardingPass, name, module):
    """DBRX's experts whole over the expert group (`StackedExperts`), their features over TP,
    under HF's names (`mlp.w1`, `mlp.v1`, `mlp.w2`, each (E F, H))."""
    from transformers.models.dbrx.modeling_dbrx import DbrxExpertGLU, DbrxExperts

    theirs = ((module, DbrxExperts), (module.mlp, DbrxExpertGLU))
    if not all(same_forward(mine, cls) for mine, cls in theirs):
        refuse(name, module, "its forward is not transformers' DBRX experts forward, which the dispatch computes")
    new = StackedExperts.from_hf(module, expert_group=sp.expert_group, group=sp.group, sequence_parallel=sp.sp)
    new = on_device(new, module.mlp.w1.device)
    sp.swap(name, new)
    total = module.num_experts * module.ffn_hidden_size

    def export(pick, group):
        out = {}
        for key in StackedExperts.WEIGHTS:
            local = pick(getattr(new.mlp, key))
            if local is not None:  # (E_r, f, H) -> every TP rank's features -> every expert -> (E F, H)
                full = gather(local.view(new.local_experts, -1, new.hidden_size), 1, group)
                out[f"mlp.{key}"] = gather(full, 0, new.expert_group).reshape(total, new.hidden_size)
        return out

    def rows():
        return new.own_rows(torch.arange(total)[:, None]).flatten()

    def load(full):
        for key in StackedExperts.WEIGHTS:
            copy_in(getattr(new.mlp, key), new.own_rows(full[f"mlp.{key}"]))

    def layout():
        return [pieces.rows(f"mlp.{key}", getattr(new.mlp, key), rows(), total) for key in StackedExperts.WEIGHTS]

    sp.exports.append(ExportRecord(name, export, load, layout))
