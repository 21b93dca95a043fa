"""`parallelize(model, group=mesh)` with a 2-D tensor-parallel mesh (`init_mesh(tp=(r, c))
["tp_r", "tp_c"]`): a Llama-style decoder over a tp_r x tp_c grid (`tplayers.nn.grid`).

Between the blocks' entry and exit the residual stream is split along the hidden features over
tp_c (whole over tp_r), which is what a column-type GridLinear takes and a row-type one gives:

    attention  q / k / v column-type (heads over tp_r, the input features over tp_c; their input
               gradient summed over tp_r once, by a hook before the attention), o_proj
               row-type; each rank computes its heads' attention over the whole sequence, the
               c ranks of a row the same heads (no bytes; c times the attention core's compute:
               splitting the batch over tp_c instead would need a re-layout each way)
    MLP        ParallelMLP on the grid (gate / up column-type, down row-type)
    norms      ParallelRMSNorm over tp_c (each rank its features, the sum of squares summed)
    entry      the embedding output split along the features over tp_c (backward: gathered)
    exit       the last block's output gathered over tp_c: the final norm (whole on every
               rank) and the LM head see the whole hidden state
    edges      the word embedding and the LM head vocabulary-parallel over every rank of the
               grid (the grid flattened into one group of r x c), exactly as `parallelize`
               shards them over a 1-D group: the embedding's output all-reduced, the logits
               gathered (or left split with `vocab_parallel_logits=True`, for
               `tplayers.vocab_parallel_cross_entropy(..., group=mesh)`, the grid as its group)

sequence_parallel=True shards the residual stream's sequence over tp_r as well, (B, S/r, H/c)
between the blocks' entry and exit (`tplayers.nn.grid`): the attention's input is all-gathered
along the sequence over tp_r once (backward reduce-scattered), o_proj and down_proj
reduce-scatter their outputs there, gate|up gathers its input, and the norms' weight gradients
are summed over tp_r; the entry splits the sequence over tp_r too, the exit gathers it.

Heads (and key/value heads) split over tp_r in whole heads, as torch.chunk splits them: a rank
holding none is refused. What is not this layout (fused projections, other MLPs and norms, a
plan) is refused, naming it. Every record lists its pieces as blocks of
the unsharded HF tensors (`tplayers.hf.pieces.block`), so `gather_state_dict`,
`load_full_state_dict`, `save_pretrained` and sharded checkpoints read and write it, and a
checkpoint saved on a grid loads at any 1-D layout and back.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate

from tplayers.distributed import grid_groups, resolve_group
from tplayers.functional.collectives import (
    all_gather_any,
    all_gather_sequence,
    copy_to_tp_region,
    gather_from_tp_region,
    own_slice,
    scatter_to_tp_region,
)
from tplayers.hf import families, pieces, vision
from tplayers.hf import fused_loss as fused
from tplayers.hf import verify as verification
from tplayers.hf.attached import move_attached
from tplayers.hf.attention import HEAD_COUNTS, HIDDEN_WIDTHS, KV_HEAD_COUNTS, localize_attributes
from tplayers.hf.finish import finish
from tplayers.hf.frozen import trainable_flags
from tplayers.hf.mlp import is_silu
from tplayers.hf.norms import fuse_rms_norms, rms_norm_eps
from tplayers.hf.sequence_split import split_blocks
from tplayers.hf.shard import ShardingPass, copy_in, replace_hidden
from tplayers.hf.state_dict import ExportRecord, Records
from tplayers.nn.grid import GridLinear
from tplayers.nn.grid_attention import grid_head_split
from tplayers.nn.mlp import ParallelMLP, fuse_gate_up, unfuse_gate_up
from tplayers.nn.norm import ParallelRMSNorm
from tplayers.placement import placement_or_none, set_placement, shard_range, update_placement


def _refuse(name, why):
    raise ValueError(f"parallelize on a 2-D tensor-parallel mesh: {name}: {why}")


# Dropout rates a grid takes: the attention probabilities', drawn over a rank's heads inside the attention
ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def _refuse_residual_dropout(model, blocks_name, blocks):
    """On a grid the residual stream is split over tp_c (unevenly where the width does not divide):
    dropout on it would draw unequal counts on the ranks, parting their generators, and the ranks that
    hold the same heads would then drop them apart. Refused by name where the model has any (a
    dropout module in a block outside its attention probabilities, a residual or hidden rate in its
    config), before any collective."""
    config = getattr(model, "config", None)
    rates = {k: v for k, v in vars(config or {}).items() if type(v) is float and v > 0 and k not in ATTENTION_DROPOUT
             and any(n in k for n in ("dropout", "pdrop")) and "embd" not in k}  # fmt: skip
    for i, block in enumerate(blocks):
        for child, module in block.named_modules():
            if isinstance(module, nn.Dropout) and module.p > 0 and not child.startswith(("self_attn", "attn")):
                rates[f"{blocks_name}.{i}.{child}"] = module.p
    if rates:
        _refuse(type(model).__name__, f"dropout on the residual stream ({rates}) is not supported on a 2-D grid: "
                "set it to 0 for training on a grid, or parallelize over a 1-D tensor-parallel group")  # fmt: skip


def _blocks(model):
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        _refuse(type(model).__name__, "no decoder blocks (an nn.ModuleList) found")
    return max(lists, key=lambda item: len(item[1]))


def _grid_export(layer: GridLinear, keys=("weight", "bias")):
    """export / load of a GridLinear under the HF linear's names: gathered over the input axis
    (dim 1), then the output axis (dim 0)."""

    def export(pick, _group):
        out = {}
        for key in keys:
            t = getattr(layer, key, None)
            t = pick(t) if t is not None else None
            if t is None:
                continue
            if key == "weight":
                t = all_gather_any(t.contiguous(), 1, layer.in_group)
            out[key] = all_gather_any(t.contiguous(), 0, layer.out_group)
        return out

    def load(full):
        for key in keys:
            if getattr(layer, key, None) is None:
                continue
            t = own_slice(full[key], 0, layer.out_group, layer.out_unit)
            copy_in(getattr(layer, key), own_slice(t, 1, layer.in_group, layer.in_unit) if key == "weight" else t)

    return export, load


def _start(layer: GridLinear, axis: str) -> int:
    """Where this rank's block of `layer`'s weight starts along its output ("out") or input ("in")
    features."""
    group, total, unit = ((layer.out_group, layer.out_features, layer.out_unit) if axis == "out"
                          else (layer.in_group, layer.in_features, layer.in_unit))  # fmt: skip
    return unit * shard_range(total // unit, dist.get_world_size(group), dist.get_rank(group))[0]


def _grid_layout(layer: GridLinear, prefix=""):
    """The pieces of a GridLinear: its weight a block of the (out, in) weight, its bias of (out,)."""

    def layout():
        out = [pieces.block(f"{prefix}weight", layer.weight, (layer.out_features, layer.in_features),
                            (_start(layer, "out"), _start(layer, "in")))]  # fmt: skip
        if layer.bias is not None:
            out.append(pieces.block(f"{prefix}bias", layer.bias, (layer.out_features,), (_start(layer, "out"),)))
        return out

    return layout


def _mlp_layout(layer: ParallelMLP):
    """in_proj's rows alternate gate, up over this rank's rows of each (over tp_r), its columns
    a block over tp_c; out_proj a block of down_proj."""

    def layout():
        proj, ffn = layer.in_proj, layer.ffn_hidden_size
        f = proj.weight.shape[0] // 2
        first, column = _start(proj, "out") // 2, _start(proj, "in")
        rows = torch.arange(f) * 2
        shape, own = (ffn, proj.in_features), torch.arange(first, first + f)
        keys = ("gate_proj.weight", "up_proj.weight")
        out = [pieces.block(key, proj.weight, shape, (0, column), 0, rows + i, own) for i, key in enumerate(keys)]
        return out + _grid_layout(layer.out_proj, "down_proj.")()

    return layout


class _GridPass:
    def __init__(self, model, mesh, overlap, sequence_parallel):
        self.model, self.mesh, self.overlap, self.sp = model, mesh, overlap, sequence_parallel
        self.groups = grid_groups(mesh)
        self.r, self.c = (dist.get_world_size(self.groups[a]) for a in ("tp_r", "tp_c"))
        self.records = []

    def swap(self, name, module):
        parent, _, child = name.rpartition(".")
        owner = self.model.get_submodule(parent) if parent else self.model
        move_attached(name, getattr(owner, child), module, whole_output=False)  # a grid layer's output is a block
        module.train(getattr(owner, child).training)  # in the mode of the module it replaces
        setattr(owner, child, module)

    def linear(self, name, module, out_axis, unit, **kwargs):
        if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
            _refuse(name, f"{type(module).__name__} is not an nn.Linear")
        units = dict(out_unit=unit) if out_axis == "tp_r" else dict(in_unit=unit)
        layer = GridLinear.from_linear(module, mesh=self.mesh, out_axis=out_axis, overlap=self.overlap, **units,
                                       **kwargs)  # fmt: skip
        self.swap(name, layer)
        self.records.append(ExportRecord(name, *_grid_export(layer), _grid_layout(layer)))

    def attention(self, name, attn):
        config = self.model.config
        heads, kv = (
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        )
        head_dim = getattr(attn, "head_dim", None) or config.hidden_size // heads
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(attn, proj, None), nn.Linear):
                _refuse(f"{name}.{proj}", "the 2-D layout takes attention with separate q / k / v / o projections")
        if heads % kv:
            _refuse(name, f"{heads} heads are not in whole groups of {kv} key/value heads")
        split = grid_head_split(heads, kv, self.r, f"parallelize on a 2-D tensor-parallel mesh: {name}")
        rank = dist.get_rank(self.groups["tp_r"])
        local, local_kv = split[0][rank], split[1][rank]
        for proj in ("q_proj", "k_proj", "v_proj"):  # one input: its gradient summed once, by the hook below
            self.linear(f"{name}.{proj}", getattr(attn, proj), "tp_r", head_dim, reduce_input_grad=False)
        # one input for q / k / v: copy_to_tp_region over tp_r sums their input gradients once (under
        # sequence parallelism the sequence gathered once, the gradient reduce-scattered)
        group, prepare = self.groups["tp_r"], all_gather_sequence if self.sp else copy_to_tp_region
        attn.register_forward_pre_hook(replace_hidden(lambda h: prepare(h, group)), with_kwargs=True)
        self.linear(f"{name}.o_proj", attn.o_proj, "tp_c", head_dim, sequence_parallel=self.sp)
        widths = {w: local * head_dim for w in HIDDEN_WIDTHS if getattr(attn, w, None) == heads * head_dim}
        localize_attributes(
            name, attn, {**dict.fromkeys(HEAD_COUNTS, local), **dict.fromkeys(KV_HEAD_COUNTS, local_kv), **widths}
        )

    def mlp(self, name, mlp):
        parts = [getattr(mlp, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, nn.Linear) for p in parts) or not is_silu(getattr(mlp, "act_fn", None)):
            _refuse(name, "the 2-D layout takes a gated SiLU MLP (gate_proj, up_proj, down_proj)")
        layer = ParallelMLP.from_modules(*parts, group=self.mesh, overlap=self.overlap, sequence_parallel=self.sp)
        self.swap(name, layer)

        def export(pick, _group):
            fused = all_gather_any(all_gather_any(pick(layer.in_proj.weight).contiguous(), 1, layer.in_proj.in_group),
                                   0, layer.in_proj.out_group)  # fmt: skip
            gate, up = unfuse_gate_up(fused)
            down = all_gather_any(pick(layer.out_proj.weight).contiguous(), 1, layer.out_proj.in_group)
            return {"gate_proj.weight": gate, "up_proj.weight": up,
                    "down_proj.weight": all_gather_any(down, 0, layer.out_proj.out_group)}  # fmt: skip

        def load(full):
            fused = fuse_gate_up(full["gate_proj.weight"], full["up_proj.weight"])
            for proj, t in ((layer.in_proj, fused), (layer.out_proj, full["down_proj.weight"])):
                t = own_slice(own_slice(t, 0, proj.out_group, proj.out_unit), 1, proj.in_group, proj.in_unit)
                copy_in(proj.weight, t)

        if any(p.bias is not None for p in parts):
            _refuse(name, "the 2-D layout's gated MLP has no biases")
        self.records.append(ExportRecord(name, export, load, _mlp_layout(layer)))

    def norm(self, name, norm):
        eps = rms_norm_eps(norm)
        if eps is None:
            _refuse(name, f"{type(norm).__name__} is not an RMSNorm tplayers knows")
        layer = ParallelRMSNorm.from_weight(norm.weight, eps, group=self.mesh, sequence_parallel=self.sp)
        self.swap(name, layer)
        group = self.groups["tp_c"]

        def export(pick, _group):
            return {"weight": all_gather_any(pick(layer.weight).contiguous(), 0, group)}

        def load(full):
            copy_in(layer.weight, own_slice(full["weight"], 0, group, layer.split_unit, layer.split_sizes))

        self.records.append(
            ExportRecord(
                name, export, load, lambda: [pieces.split("weight", layer.weight, 0, group, total=layer.hidden_size)]
            )
        )


def _edge_hooks(blocks, groups, hidden, sequence_parallel):
    """The residual stream split between the first block's entry and the last block's exit: the
    hidden features over tp_c, and under sequence parallelism the sequence over tp_r (the model's
    masks and positions are built from the whole sequence before, its final norm and LM head see
    the whole hidden state after)."""
    row, col = groups["tp_r"], groups["tp_c"]

    def enter(h):
        return scatter_to_tp_region(h, col, dim=-1)

    def leave(h):
        return gather_from_tp_region(h, col, dim=-1, total=hidden)

    if sequence_parallel:  # the sequence over tp_r, any length, as on a 1-D group; the features inside it
        split_blocks(blocks, row, 1, features=(enter, leave))
        return

    blocks[0].register_forward_pre_hook(replace_hidden(enter), with_kwargs=True)
    blocks[-1].register_forward_hook(
        lambda module, args, out: (leave(out[0]), *out[1:]) if isinstance(out, tuple) else leave(out)
    )


def parallelize_grid(model, mesh, *, sequence_parallel=False, plan=None, vocab_parallel_logits=False, verify=None,
                     overlap="auto", fused_loss=True):  # fmt: skip
    """`parallelize` over a 2-D mesh (module docstring)."""
    if plan:
        _refuse(type(model).__name__, "plan= is not supported on a grid yet")
    beside = vision.towers(model)
    if beside:  # before any collective: every rank holds the same model
        _refuse(type(model).__name__, f"its towers beside the language model ({', '.join(beside)}) are not part of the "
                "2-D layout; parallelize it over a 1-D tensor-parallel group")  # fmt: skip
    _refuse_residual_dropout(model, *_blocks(model))
    groups = grid_groups(mesh)
    whole = resolve_group(mesh)  # every tensor-parallel rank: the records' one TP group
    probe = verification.before(model, verify, dist.get_world_size(whole), vocab_parallel=vocab_parallel_logits)
    keys, trainable = list(model.state_dict().keys()), trainable_flags(model)
    grid = _GridPass(model, mesh, overlap, sequence_parallel)
    # the edges as a 1-D pass over the flattened grid shards them: vocabulary-parallel
    edges = ShardingPass(model, whole, vocab_parallel_logits=vocab_parallel_logits, overlap=overlap)
    edges.embedding_adapters = families.EMBEDDINGS
    edges.embeddings()
    blocks_name, blocks = _blocks(model)
    hidden = model.config.hidden_size
    for i, block in enumerate(blocks):
        name = f"{blocks_name}.{i}"
        for child, module in block.named_children():
            if child in ("self_attn", "attention", "attn"):
                grid.attention(f"{name}.{child}", module)
            elif child == "mlp":
                grid.mlp(f"{name}.{child}", module)
            elif isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.shape == (hidden,):
                grid.norm(f"{name}.{child}", module)
            elif any(True for _ in module.parameters()):
                _refuse(f"{name}.{child}", f"{type(module).__name__} is not part of the 2-D layout")
    _edge_hooks(blocks, groups, hidden, sequence_parallel)
    fuse_rms_norms(model)  # the final norm, whole on every rank
    for p in model.parameters():
        if placement_or_none(p) is None:  # embeddings, final norm, LM head: whole on every rank
            set_placement(p, whole, Replicate())
        else:
            update_placement(p, tp_all=whole)
    exports, tied = Records(edges.exports + grid.records), edges.tied
    edges.release()
    if fused_loss and not vocab_parallel_logits:  # the loss without logits, over the flattened grid
        fused.install(model)
    sequence_group = groups["tp_r"] if sequence_parallel else None
    return finish(model, probe, group=whole, exports=exports, original_keys=keys, tied=tied,
                  sequence_group=sequence_group, vocab_parallel=vocab_parallel_logits, trainable=trainable)  # fmt: skip
