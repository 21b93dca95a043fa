"""`ParallelExperts`: the experts of one MoE layer placed whole over an expert-parallel group,
the tokens moved to them (`tplayers.functional.dispatch`), each expert's features optionally
split over the tensor-parallel group too (Megatron's expert tensor parallelism).

E experts over n expert-parallel ranks: rank r holds `even_sizes(E, n)[r]` consecutive experts
(6 over 4: 2, 2, 1, 1; 2 over 4: 1, 1, 0, 0), in transformers 5's layout:

    gate_up_proj   (E_r, 2 f, H): each expert's [gate; up] rows, f = this TP rank's share of F
    down_proj      (E_r, H, f)

f splits F over the TP group in 16-byte-aligned blocks as evenly as they go (as the
tensor-parallel experts of `tplayers.hf.moe` do); one TP rank: f = F.

Forward(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H), HF's experts
call. The ranks of the expert group feed different tokens (expert parallelism folds over the
data-parallel ranks); within a TP group:

    no sequence parallelism   every TP rank holds the same tokens and dispatches them to its
                              peers of the same TP index; each computes its features' partial
                              sum, and the TP group sums the combined outputs (one all-reduce,
                              as a dense MLP); the tokens' and weights' gradients are summed too
    sequence parallelism      each TP rank holds its own tokens and dispatches only those; the
                              rows its TP group received are gathered over the group, and the
                              partial outputs reduce-scattered back to the rank that received each

The weights' gradients: an expert's gradient sums the pairs of every rank of the expert group
that sent it tokens. The mean over all data-parallel replicas is the mean over the expert's own
replicas (the expert-data-parallel group, over which `tplayers.data_parallel` reduces it) divided
by the expert group's size: `data_parallel` sets `grad_divisor` so, and the weights' gradient is
divided by it as it is computed.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from tplayers.distributed import resolve_group
from tplayers.functional import dispatch
from tplayers.functional.collectives import copy_to_tp_region, own_slice, reduce_from_tp_region
from tplayers.functional.experts import expert_mlp, scale_grad
from tplayers.placement import PlacedModule, even_sizes, shard_range, update_placement


def aligned_unit(f, n) -> int:
    """The unit F splits in over n TP ranks: HF's grouped GEMM over the experts needs the rows of
    down_proj (E, H, F) 16-byte aligned, so F splits in whole blocks of up to 16 entries (16 bytes
    in any dtype from fp8 to fp32), the largest that divides F and leaves every rank a block."""
    return next(u for u in (16, 8, 4, 2, 1) if f % u == 0 and f // u >= n or u == 1)


class ParallelExperts(PlacedModule):
    """`num_experts` SwiGLU-style experts (act(gate) * up -> down) of width `ffn_size` over
    `hidden_size`, whole over `expert_group`, each split over `group` (see the module docstring).
    `act_fn`: the activation of the gate (SiLU by default; SiLU runs fused in the grouped GEMM)."""

    def __init__(
        self, num_experts, hidden_size, ffn_size, *, expert_group=None, group=None, sequence_parallel=False,
        act_fn=None, device=None, dtype=None,
    ):  # fmt: skip
        super().__init__()
        # None: no expert parallelism, every expert here (its features split over `group`)
        self.expert_group = resolve_group(expert_group) if expert_group is not None else None
        self.group = resolve_group(group)
        self.num_experts, self.hidden_size, self.ffn_size = num_experts, hidden_size, ffn_size
        self.sequence_parallel = sequence_parallel
        self.act_fn = act_fn if act_fn is not None else nn.SiLU()
        n_tp = dist.get_world_size(self.group)
        n_ep, r_ep = (
            (dist.get_world_size(self.expert_group), dist.get_rank(self.expert_group)) if expert_group else (1, 0)
        )
        self.expert_sizes = even_sizes(num_experts, n_ep)
        self.first_expert, self.local_experts = shard_range(num_experts, n_ep, r_ep, self.expert_sizes)
        self.unit = aligned_unit(ffn_size, n_tp)
        self.ffn_blocks = even_sizes(ffn_size // self.unit, n_tp)
        f = self.local_ffn = self.unit * self.ffn_blocks[dist.get_rank(self.group)]
        kw = dict(device=device, dtype=dtype)
        self.gate_up_proj = nn.Parameter(torch.empty(self.local_experts, 2 * f, hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(self.local_experts, hidden_size, f, **kw))
        self._placements = {"gate_up_proj": Shard(1), "down_proj": Shard(2)}
        self._keep_placements()
        # the weights' gradients are divided by it (`tplayers.data_parallel`: the replicas' mean)
        self.grad_divisor = 1

    FEATURE_DIMS = (1, 2)  # the F axis of gate_up_proj, of down_proj (2, 1: Llama 4's transposed layout)

    def _tag_parameters(self, *_):
        for name in self._placements:  # before the records are sealed into the module's table
            param = self._placed(name)
            if param is not None:
                update_placement(param, ep_group=self.expert_group)
        super()._tag_parameters()

    # -- this rank's slice of the unsharded (E, 2F, H) / (E, H, F) tensors ----------------------
    def own_ffn(self, t, dim):
        return own_slice(t, dim, self.group, self.unit, self.ffn_blocks)

    def own_gate_up(self, full):
        """This rank's [gate_r; up_r] of its experts, from the unsharded (E, 2F, H)."""
        gate, up = full[self.first_expert : self.first_expert + self.local_experts].chunk(2, 1)
        return torch.cat([self.own_ffn(gate, 1), self.own_ffn(up, 1)], 1)

    def own_down(self, full):
        return self.own_ffn(full[self.first_expert : self.first_expert + self.local_experts], 2)

    @classmethod
    def from_weights(cls, gate_up, down, **kwargs):
        """The layer holding this rank's slice of the unsharded gate_up (E, 2F, H) and down (E, H, F)
        (in the class's layout: `FEATURE_DIMS`)."""
        fa = cls.FEATURE_DIMS[0]
        experts, two_f, hidden = gate_up.shape[0], gate_up.shape[fa], gate_up.shape[3 - fa]
        layer = cls(experts, hidden, two_f // 2, device="meta", dtype=gate_up.dtype, **kwargs)
        fresh = dict(memory_format=torch.contiguous_format)
        with torch.no_grad():
            layer.gate_up_proj = nn.Parameter(layer.own_gate_up(gate_up.detach()).clone(**fresh), gate_up.requires_grad)
            layer.down_proj = nn.Parameter(layer.own_down(down.detach()).clone(**fresh), down.requires_grad)
        layer._tag_parameters()
        return layer

    def extra_repr(self):
        return (
            f"experts {self.first_expert}..{self.first_expert + self.local_experts - 1} of {self.num_experts}, "
            f"hidden {self.hidden_size}, ffn {self.ffn_size} (local {self.local_ffn}), "
            f"sequence_parallel={self.sequence_parallel}"
        )

    def experts_mlp(self, x, p, k, scale):
        """Each received row's sum over its pairs `p` (`dispatch.Pairs`) of scale * its expert's MLP."""
        gate_up, down = (scale_grad(t, 1 / self.grad_divisor) for t in (self.gate_up_proj, self.down_proj))
        return expert_mlp(x, p, k, gate_up, down, scale, self.act_fn)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if hidden_states.dim() != 2 or top_k_index.shape != top_k_weights.shape:
            raise ValueError(
                f"ParallelExperts: hidden_states (tokens, H) and top_k_index / top_k_weights (tokens, k), got "
                f"{tuple(hidden_states.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}"
            )
        tp_split = dist.get_world_size(self.group) > 1
        if tp_split and not self.sequence_parallel:  # every TP rank the same tokens: gradients summed
            hidden_states = copy_to_tp_region(hidden_states, self.group)
            top_k_weights = copy_to_tp_region(top_k_weights, self.group)
        if self.expert_group is not None:
            r = dispatch.route(top_k_index, self.expert_sizes, self.num_experts, self.expert_group)
            x, local, w = dispatch.dispatch(hidden_states, top_k_weights, r, self.expert_group)
        else:  # every expert here: HF's padding index (num_experts) picks none
            x, w = hidden_states, top_k_weights
            local = torch.where((top_k_index >= 0) & (top_k_index < self.num_experts), top_k_index, -1)
        sizes = [x.shape[0]]
        if tp_split and self.sequence_parallel:  # the TP group's received rows, each rank its features
            sizes = dispatch.row_counts(x.shape[0], self.group, x.device)
            x, w = dispatch.gather_rows(x, sizes, self.group), dispatch.gather_rows(w, sizes, self.group)
            local = dispatch.gather_rows(local, sizes, self.group)
        p = dispatch.pairs(local, self.local_experts)
        out = self.experts_mlp(x, p, local.shape[1], w[p.gather, p.pick])
        if len(sizes) > 1:
            out = dispatch.reduce_scatter_rows(out, sizes, self.group)
        if self.expert_group is not None:
            out = dispatch.combine(out, r, hidden_states.shape[0], self.expert_group)
        if tp_split and not self.sequence_parallel:
            out = reduce_from_tp_region(out, self.group)
        return out.to(hidden_states.dtype)


class ClampedGluExperts(ParallelExperts):
    """gpt-oss's experts, whole over `expert_group` (features not split: one TP rank), in its own
    layout and math: gate_up_proj (E_r, H, 2F) with gate / up interleaved in pairs and its bias
    (E_r, 2F), down_proj (E_r, F, H) and its bias (E_r, H);
    h = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit).
    Its grouped GEMMs run the pure-torch reference (no fused epilogue for this activation)."""

    def __init__(self, num_experts, hidden_size, ffn_size, *, alpha, limit, device=None, dtype=None, **kwargs):
        super().__init__(num_experts, hidden_size, ffn_size, device="meta", dtype=dtype, **kwargs)
        if dist.get_world_size(self.group) != 1:
            raise ValueError("ClampedGluExperts: gpt-oss's experts are placed whole, over one tensor-parallel rank")
        self.alpha, self.limit = alpha, limit
        e, kw = self.local_experts, dict(device=device, dtype=dtype)
        self.gate_up_proj = nn.Parameter(torch.empty(e, hidden_size, 2 * ffn_size, **kw))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * ffn_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(e, ffn_size, hidden_size, **kw))
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden_size, **kw))
        self._placements = {name: Shard(0) for name in self.WEIGHTS}  # whole experts: only the expert dim splits
        self._tag_parameters()  # the load hook the base registered re-tags these too

    WEIGHTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")

    def own(self, full):
        return full[self.first_expert : self.first_expert + self.local_experts]

    @classmethod
    def from_hf(cls, module, **kwargs):
        """The layer holding this rank's experts of HF's gpt-oss experts `module`."""
        experts, hidden, two_f = module.gate_up_proj.shape
        layer = cls(experts, hidden, two_f // 2, alpha=module.alpha, limit=module.limit, device="meta",
                    dtype=module.gate_up_proj.dtype, **kwargs)  # fmt: skip
        with torch.no_grad():
            for name in cls.WEIGHTS:
                full = getattr(module, name)
                setattr(layer, name, nn.Parameter(layer.own(full.detach()).clone(), full.requires_grad))
        layer._tag_parameters()
        return layer

    def experts_mlp(self, x, p, k, scale):
        from tplayers.kernels.grouped_matmul_ref import grouped_matmul_ref

        weights = [scale_grad(getattr(self, n), 1 / self.grad_divisor) for n in self.WEIGHTS]
        gate_up, gate_up_bias, down, down_bias = weights
        expert = torch.repeat_interleave(torch.arange(self.local_experts, device=x.device), p.counts)
        y = grouped_matmul_ref(x, gate_up.transpose(1, 2), p.counts, gather=p.gather) + gate_up_bias[expert]
        gate, up = y[:, ::2].clamp(max=self.limit), y[:, 1::2].clamp(-self.limit, self.limit)
        h = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        out = (grouped_matmul_ref(h, down.transpose(1, 2), p.counts) + down_bias[expert]) * scale[:, None]
        cells = out.new_zeros(x.shape[0] * k, out.shape[1]).index_copy(0, p.scatter, out.to(x.dtype))
        return cells.view(x.shape[0], k, out.shape[1]).sum(1)


class PreScaledExperts(ParallelExperts):
    """Llama 4's experts: each pair's routing weight scales the token before its expert,
    h = act((s x) W_gate) * ((s x) W_up) -> W_down, in Llama 4's transposed layout: gate_up_proj
    (E_r, H, 2f) with [gate | up] along the last dim, down_proj (E_r, f, H). The features split over
    TP as ParallelExperts' do. Its grouped GEMMs run the pure-torch reference (the kernel's epilogue
    scales a pair's output, not its input)."""

    FEATURE_DIMS = (2, 1)  # the F axis of gate_up_proj, of down_proj

    def __init__(self, num_experts, hidden_size, ffn_size, *, device=None, dtype=None, **kwargs):
        super().__init__(num_experts, hidden_size, ffn_size, device="meta", dtype=dtype, **kwargs)
        e, f, kw = self.local_experts, self.local_ffn, dict(device=device, dtype=dtype)
        self.gate_up_proj = nn.Parameter(torch.empty(e, hidden_size, 2 * f, **kw))
        self.down_proj = nn.Parameter(torch.empty(e, f, hidden_size, **kw))
        self._placements = {"gate_up_proj": Shard(2), "down_proj": Shard(1)}
        self._tag_parameters()

    def own_gate_up(self, full):
        """This rank's [gate_r | up_r] of its experts, from the unsharded (E, H, 2F)."""
        return super().own_gate_up(full.transpose(1, 2)).transpose(1, 2)

    def own_down(self, full):
        return super().own_down(full.transpose(1, 2)).transpose(1, 2)

    def experts_mlp(self, x, p, k, scale):
        from tplayers.kernels.grouped_matmul_ref import grouped_matmul_ref

        gate_up, down = (
            scale_grad(t, 1 / self.grad_divisor).transpose(1, 2) for t in (self.gate_up_proj, self.down_proj)
        )
        scaled = x[p.gather] * scale[:, None].to(x.dtype)  # as Llama 4 scales its tokens, before the GEMM
        gate, up = grouped_matmul_ref(scaled, gate_up, p.counts).chunk(2, dim=-1)
        cells = grouped_matmul_ref(self.act_fn(gate) * up, down, p.counts, scatter=p.scatter, out_rows=x.shape[0] * k)
        return cells.view(x.shape[0], k, self.hidden_size).sum(1)


class StackedExperts(ParallelExperts):
    """DBRX's experts: each expert's gate (w1), up (v1) and down (w2, applied as (F, H)) rows
    stacked (E_r f, H) in `mlp`, under HF's names `mlp.w1`, `mlp.v1`, `mlp.w2`; its features split
    over TP as ParallelExperts' (its rows e f .. e f + f - 1 of each of its experts). Forward takes
    DBRX's (batch, tokens, H) hidden states; the grouped GEMMs read [w1_e; v1_e] and w2_e^T."""

    WEIGHTS = ("w1", "v1", "w2")

    def __init__(self, num_experts, hidden_size, ffn_size, *, device=None, dtype=None, **kwargs):
        super().__init__(num_experts, hidden_size, ffn_size, device="meta", dtype=dtype, **kwargs)
        rows, kw = self.local_experts * self.local_ffn, dict(device=device, dtype=dtype)
        del self.gate_up_proj, self.down_proj
        self.mlp = nn.Module()
        for key in self.WEIGHTS:
            setattr(self.mlp, key, nn.Parameter(torch.empty(rows, hidden_size, **kw)))
        self._placements = {f"mlp.{key}": Shard(0) for key in self.WEIGHTS}  # dotted: `_placed` reads them
        self._tag_parameters()

    def own_rows(self, full):
        """This rank's rows of the unsharded (E F, H): each of its experts' features."""
        f = self.ffn_size
        own = self.own_ffn(torch.arange(f, device=full.device), 0)
        experts = torch.arange(self.first_expert, self.first_expert + self.local_experts, device=full.device)
        return full.index_select(0, (experts[:, None] * f + own[None, :]).flatten())

    @classmethod
    def from_hf(cls, module, **kwargs):
        """The layer holding this rank's experts of HF's DBRX experts `module`."""
        glu = module.mlp
        layer = cls(module.num_experts, module.hidden_size, module.ffn_hidden_size, device="meta",
                    dtype=glu.w1.dtype, act_fn=glu.activation_fn, **kwargs)  # fmt: skip
        with torch.no_grad():
            for key in cls.WEIGHTS:
                full = getattr(glu, key)
                setattr(layer.mlp, key, nn.Parameter(layer.own_rows(full.detach()).clone(), full.requires_grad))
        layer._tag_parameters()
        return layer

    def experts_mlp(self, x, p, k, scale):
        w1, v1, w2 = (scale_grad(getattr(self.mlp, n), 1 / self.grad_divisor).view(self.local_experts, -1,
                      self.hidden_size) for n in self.WEIGHTS)  # fmt: skip
        return expert_mlp(x, p, k, torch.cat([w1, v1], 1), w2.transpose(1, 2), scale, self.act_fn)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = super().forward(hidden_states.reshape(-1, self.hidden_size), top_k_index, top_k_weights)
        return out.view(hidden_states.shape[0], -1, self.hidden_size)
