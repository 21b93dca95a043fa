"""What tplayers knows about each HuggingFace model family: one adapter per module pattern,
recognised by the module's children, next to each other in `ADAPTERS`.

    attention with q/k/v/o_proj (Llama, Mistral, Qwen2, ...): q, k, v column-parallel split by
        heads, o row-parallel; HF attention reshapes with -1 heads, so local heads just work
    GPT-2 attention (Conv1D c_attn holding [q; k; v], c_proj): c_attn column-parallel with rank
        r holding [q_r; k_r; v_r], c_proj row-parallel, `split_size` set to the local width
    gated MLP (gate/up/down_proj): SiLU -> ParallelMLP (one fused gate|up GEMM + SwiGLU kernel);
        any other activation -> gate, up column-parallel, down row-parallel
    GPT-2 MLP (Conv1D c_fc, c_proj): c_fc column-parallel, c_proj row-parallel

An adapter shards a module through the `ShardingPass` it is given (`tplayers.hf.shard`) and
records how to export / load anything it lays out in its own way.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tplayers.functional.collectives import copy_to_tp_region, own_slice
from tplayers.functional.linear import column_parallel_linear
from tplayers.hf.shard import ShardingPass, as_linear, copy_in, gather, is_conv1d
from tplayers.nn.attention import ReplicatedLinear
from tplayers.nn.linear import ColumnParallelLinear, _divide
from tplayers.nn.mlp import ParallelMLP, fuse_gate_up, unfuse_gate_up


@dataclass(frozen=True)
class Adapter:
    """A module pattern tplayers knows exactly: `matches(module)` recognises it by its children,
    `apply(sharding_pass, name, module)` shards it in place."""

    name: str
    matches: Callable[[nn.Module], bool]
    apply: Callable[[ShardingPass, str, nn.Module], None]


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


# -- attention ------------------------------------------------------------------------------
def qkvo_attention(sp: ShardingPass, name, attn):
    head_dim = getattr(attn, "head_dim", None) or attn.o_proj.in_features // sp.config("num_attention_heads")
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
    sp.row(f"{name}.o_proj", attn.o_proj)
    _per_head_weights(sp, name, attn, head_dim)
    sp.shared_input.append(attn)
    sp.done.add(name)


def _per_head_weights(sp: ShardingPass, name, attn, head_dim):
    """Other weights inside the attention (Qwen3's q_norm / k_norm) act on each head alike:
    replicated, but each rank's heads give only part of their gradient, so it is summed.
    A weight spanning all heads cannot be split by this pass: an error naming it."""
    projections = {"q_proj", "k_proj", "v_proj", "o_proj"}
    for child_name, child in attn.named_children():
        if child_name in projections:
            continue
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
    full = as_linear(attn.c_attn)
    fused = nn.Linear(full.in_features, full.out_features, bias=full.bias is not None, device="meta")
    fused.weight = nn.Parameter(interleave_shards(full.weight.split(width, 0), sp.n), requires_grad=False)
    if full.bias is not None:
        fused.bias = nn.Parameter(interleave_shards(full.bias.split(width, 0), sp.n), requires_grad=False)
    layer = ColumnParallelLinear.from_linear(fused, group=sp.group, reduce_input_grad=False).to(
        attn.c_attn.weight.device
    )
    sp.swap(f"{name}.c_attn", layer)
    keys = ("weight", "bias") if layer.bias is not None else ("weight",)

    def export(pick, group):
        out = {}
        for key in keys:
            t = gather(pick(getattr(layer, key)), 0, group)
            if t is not None:
                t = torch.cat(deinterleave_shards(t, sp.n, [width] * 3), 0)
                out[key] = t.t() if key == "weight" else t
        return out

    def load(full):
        for key in keys:
            t = full[key].t() if key == "weight" else full[key]
            copy_in(getattr(layer, key), own_slice(interleave_shards(t.split(width, 0), sp.n), 0, sp.group))

    sp.exports.append((f"{name}.c_attn", export, load))
    attn.split_size = width // sp.n  # HF splits c_attn's output into q, k, v of this width
    sp.row(f"{name}.c_proj", attn.c_proj)
    sp.shared_input.append(attn)
    sp.done.add(name)


# -- MLP ------------------------------------------------------------------------------------
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


def gpt2_mlp(sp: ShardingPass, name, mlp):
    sp.column(f"{name}.c_fc", mlp.c_fc)
    sp.row(f"{name}.c_proj", mlp.c_proj)
    sp.done.add(name)


ADAPTERS = (
    Adapter("q/k/v/o attention", lambda m: _has_linears(m, ("q_proj", "k_proj", "v_proj", "o_proj")), qkvo_attention),
    Adapter("GPT-2 attention", lambda m: _has_conv1ds(m, ("c_attn", "c_proj")), gpt2_attention),
    Adapter("gated MLP", lambda m: _has_linears(m, ("gate_proj", "up_proj", "down_proj")), gated_mlp),
    Adapter("GPT-2 MLP", lambda m: _has_conv1ds(m, ("c_fc", "c_proj")), gpt2_mlp),
)
