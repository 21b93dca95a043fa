"""MLP adapters: the first projection(s) column-parallel, the last row-parallel.

gated MLP (gate/up/down_proj): SiLU -> ParallelMLP (one fused gate|up GEMM + SwiGLU kernel);
    any other activation -> gate, up column-parallel, down row-parallel
fused gate_up_proj [gate; up] with SiLU (Phi-3, GLM-4): ParallelMLP's fused SwiGLU layout; with any
    elementwise math between the halves (Zamba 2, MiniMax-M3): each rank's [gate_r; up_r] rows
two-layer MLPs with an elementwise activation (fc1/fc2: OPT, Phi; fc_in/fc_out: GPT-J, CodeGen;
    c_fc/c_proj: Starcoder2, GPTBigCode; up_proj/down_proj: MPT; dense_h_to_4h/dense_4h_to_h:
    GPT-NeoX, Bloom, Falcon)
GPT-2's Conv1D c_fc / c_proj
Qwen2-MoE's shared-expert gate (H -> 1, then a sigmoid): kept whole on every rank
"""

import re

import torch
from torch import nn

from tplayers.functional.collectives import own_slice, sum_over_tp_region
from tplayers.hf import pieces
from tplayers.hf.attention import NORMS_BEFORE_PROJECTION, norm_before_row, split_per_head
from tplayers.hf.fused import fused_column, part_rows
from tplayers.hf.shard import ShardingPass, as_linear, copy_in, gather, has_linears, on_device
from tplayers.hf.source import forward_source, same_forward
from tplayers.hf.state_dict import ExportRecord
from tplayers.nn.linear import GatheredWeightLinear
from tplayers.nn.mlp import ParallelMLP, fuse_gate_up, unfuse_gate_up
from tplayers.placement import shard_sizes


def is_silu(act) -> bool:
    """Whether an activation module computes SiLU (HF has its own classes for it)."""
    if not isinstance(act, nn.Module):
        return False
    probe = torch.linspace(-4, 4, 17)
    try:
        return torch.equal(act(probe), nn.functional.silu(probe))
    except Exception:  # an activation that does not take a plain tensor is not SiLU
        return False


def is_w1_w3_w2(mlp) -> bool:
    """LFM2's MLP: w2(silu(w1(x)) * w3(x)), read in its forward."""
    source = forward_source(mlp)
    return has_linears(mlp, ("w1", "w2", "w3")) and "self.w2(F.silu(self.w1(x)) * self.w3(x))" in source


def w1_w3_w2(sp: ShardingPass, name, mlp):
    """LFM2's gated MLP under its own names: w1 (gate) and w3 (up) column-parallel, w2 row-parallel,
    split alike; the model's forward runs."""
    for key in ("w1", "w3"):
        sp.shared_input_column(f"{name}.{key}", getattr(mlp, key))
    sp.row(f"{name}.w2", mlp.w2)
    sp.shared_input.append(mlp)
    sp.done.add(name)


# (the [gate; up] projection, the one after): GraniteMoeShared / GraniteMoeHybrid, ModernBERT-decoder, Moshi
CHUNKED_PAIRS = (("input_linear", "output_linear"), ("Wi", "Wo"), ("fc1", "fc2"))
# the forward's split of the in-projection's features into two halves: chunk(2), or Moshi's view as
# (..., 2, half) read at [..., 0, :] and [..., 1, :]
HALVES = re.compile(
    r"chunk\(2, dim=-1\)|(\w+) = \1\.view\(batch_size, sequence_length, 2, -1\)\s*\n\s*\1 = "
    r"self\.\w+\(\1\[\.\.\., 0, :\]\) \* \1\[\.\.\., 1, :\]"
)


def chunked_pair(module) -> tuple[str, str] | None:
    """The (in, out) names of an MLP whose in-projection holds [gate; up] halves (its forward splits
    them in two, `HALVES`), else None."""
    for first, second in CHUNKED_PAIRS:
        if (
            has_linears(module, (first, second))
            and getattr(module, first).out_features == 2 * getattr(module, second).in_features
            and HALVES.search(forward_source(module)) is not None
        ):
            return first, second
    return None


def chunked_gate_up(sp: ShardingPass, name, mlp):
    """An in-projection holding [gate; up] halves (its forward chunks them in two and gates
    elementwise), the out-projection after: this rank's rows of each half, and the out-projection
    row-parallel by the same features; the model's forward runs."""
    first, second = chunked_pair(mlp)
    ffn = getattr(mlp, second).in_features
    rows = part_rows([ffn, ffn], sp.n, split=shard_sizes(ffn, sp.n))
    fused_column(sp, f"{name}.{first}", getattr(mlp, first), rows)
    sp.row(f"{name}.{second}", getattr(mlp, second))
    sp.shared_input.append(mlp)
    sp.done.add(name)


def fused_gate_up(sp: ShardingPass, name, mlp):
    """gate_up_proj holding [gate; up] halves, then down_proj. With SiLU as its activation module and
    nothing else holding weights (Phi-3, GLM-4): ParallelMLP (one fused gate|up GEMM with the SwiGLU
    epilogue), exported back to [gate; up]. Else, where the forward chunks [gate; up] in two and
    only acts on them elementwise (any activation, a function in the forward included: Zamba 2,
    MiniMax-M3's clamped SwiGLU): `gate_up_halves`. Anything else is refused by name."""
    act = getattr(mlp, "activation_fn", None)
    extras = _gate_up_extras(mlp)
    halves = extras != ([], []) or mlp.gate_up_proj.bias is not None or sp.keeps(name, ("gate_up_proj", "down_proj"))
    if act is None or not is_silu(act) or halves:
        if extras is None or not elementwise_halves(mlp):
            raise ValueError(
                f"parallelize: {name} ({type(mlp).__name__}) holds a fused gate_up_proj, and its forward is not "
                "[gate; up] chunked in two and acted on elementwise before down_proj, so tplayers cannot tell "
                "what it applies between them; pass a plan"
            )
        gate_up_halves(sp, name, mlp, extras)
        return
    fused = as_linear(mlp.gate_up_proj, f"{name}.gate_up_proj")
    halves = []
    for part in fused.weight.detach().chunk(2, 0):
        half = nn.Linear(part.shape[1], part.shape[0], bias=False, device="meta")
        half.weight = nn.Parameter(part, requires_grad=False)
        halves.append(half)
    layer = ParallelMLP.from_modules(
        *halves, as_linear(mlp.down_proj, f"{name}.down_proj"), group=sp.group, sequence_parallel=sp.sp
    )
    layer = on_device(layer, mlp.down_proj.weight.device)
    sp.swap(name, layer)

    def export(pick, group):
        w = pick(layer.in_proj.weight)
        out = {}
        if w is not None:
            out["gate_up_proj.weight"] = torch.cat(unfuse_gate_up(gather(w, 0, group)), 0)
        down = pick(layer.out_proj.weight)
        if down is not None:
            out["down_proj.weight"] = gather(down, 1, group)
        return out

    def load(full):
        gate, up = full["gate_up_proj.weight"].chunk(2, 0)
        copy_in(layer.in_proj.weight, own_slice(fuse_gate_up(gate, up), 0, sp.group, unit=2))
        copy_in(layer.out_proj.weight, own_slice(full["down_proj.weight"], 1, sp.group))

    def layout():  # in_proj's rows alternate gate, up over this rank's rows of each half of [gate; up]
        halves = pieces.interleaved(
            ("gate_up_proj.weight",) * 2, layer.in_proj.weight, sp.group, layer.ffn_hidden_size, stacked=True
        )
        down = pieces.split("down_proj.weight", layer.out_proj.weight, 1, sp.group, total=layer.ffn_hidden_size)
        return [*halves, down]

    sp.exports.append(ExportRecord(name, export, load, layout))


# A reduction over the intermediate features: with each rank holding a slice, it would see only its own.
REDUCTIONS = re.compile(r"\b(mean|std|var|sum|norm|softmax|log_softmax|topk|sort|cumsum|amax|amin|max|min|logsumexp)\(")


def elementwise_halves(mlp) -> bool:
    """Whether the MLP's forward chunks gate_up_proj's output in two along its features, calls
    down_proj, and reduces nothing over the features (read in its source): any elementwise math
    between them then runs on each rank's slice of both halves as on the whole."""
    source = forward_source(mlp)
    return (
        re.search(r"chunk\(\s*(\w+,\s*)?2,\s*(dim=)?-1\)", source) is not None
        and "self.down_proj(" in source
        and not REDUCTIONS.search(source.replace("clamp(max=", "clamp(upper="))
    )


def _gate_up_extras(mlp) -> tuple[list, list] | None:
    """What else the MLP holds: low-rank adapters added to gate_up_proj's output (Zamba 2's per-layer
    `down -> up` pairs, or Identity) as [(down, up)], and norms of its input before gate_up_proj
    (Phi-4-multimodal's audio MLP) as [norm]; None where it holds anything else with weights."""
    rows, source, adapters, norms = mlp.gate_up_proj.out_features, forward_source(mlp), [], []
    for child, module in mlp.named_children():
        if child in ("gate_up_proj", "down_proj") or next(module.parameters(), None) is None:
            continue
        call = source.find(f"self.{child}(")
        if "Norm" in type(module).__name__ and -1 < call < source.find("self.gate_up_proj("):
            norms.append(module)
            continue
        for part in module.children() if isinstance(module, nn.ModuleList) else [module]:
            if isinstance(part, nn.Identity):
                continue
            pair = list(part.children()) if isinstance(part, nn.Sequential) else []
            if not (len(pair) == 2 and all(type(m) is nn.Linear for m in pair) and pair[1].out_features == rows
                    and pair[0].out_features == pair[1].in_features and pair[1].bias is None):  # fmt: skip
                return None
            adapters.append(pair)
    return adapters, norms


def gate_up_halves(sp: ShardingPass, name, mlp, extras=((), ())):
    """The model's own forward on this rank's features: gate_up_proj column-parallel holding this
    rank's rows of each half ([gate_r; up_r], so the forward's chunk in two gives this rank's gate and
    up), down_proj row-parallel by the same features. An adapter added to gate_up_proj's output splits
    its up projection alike; its down projection, and a norm of the input, are whole on every rank,
    each rank's features giving part of their gradients, summed over the group."""
    adapters, norms = extras
    ffn = mlp.gate_up_proj.out_features // 2
    rows = part_rows([ffn, ffn], sp.n, split=shard_sizes(ffn, sp.n))
    fused_column(sp, f"{name}.gate_up_proj", mlp.gate_up_proj, rows)
    for down, up in adapters:
        adapter = next(n for n, m in mlp.named_modules() if m is up)
        fused_column(sp, f"{name}.{adapter}", up, rows)  # its input gradient partial, as gate_up_proj's
        sp.partial_grads.extend(down.parameters())
    for norm in norms:
        sp.partial_grads.extend(norm.parameters())
    sp.row(f"{name}.down_proj", mlp.down_proj)
    sp.shared_input.append(mlp)
    sp.done.add(name)


# Per-feature scales of the gate / up outputs an MLP holds itself (Dory's), split with its features
FEATURE_SCALES = ("suv_gate", "suv_up")


def _scales_features(mlp) -> bool:
    """Dory's MLP (gate and up outputs scaled per feature, an L2 norm before down), with transformers'
    forward line for line."""
    if type(mlp).__name__ != "DoryMLP":
        return False
    from transformers.models.dory.modeling_dory import DoryMLP

    return same_forward(mlp, DoryMLP)


def gated_mlp(sp: ShardingPass, name, mlp):
    """down(act(gate(x)) * up(x)): with SiLU and nothing else in the module, ParallelMLP (one fused
    gate|up GEMM with the SwiGLU epilogue); else the module's own forward with gate, up
    column-parallel and down row-parallel, BitNet's ffn_sub_norm before down a ParallelRMSNorm over
    the same split (Dory's a ParallelL2Norm, its per-feature scales split with the features)."""
    others = [c for c in mlp._modules if c not in ("gate_proj", "up_proj", "down_proj", "act_fn")]
    plain = not others and not mlp._parameters and is_silu(getattr(mlp, "act_fn", None))
    if not plain or sp.keeps(name, ("gate_proj", "up_proj", "down_proj")):  # HF's forward on the split
        sp.shared_input_column(f"{name}.gate_proj", mlp.gate_proj)
        sp.shared_input_column(f"{name}.up_proj", mlp.up_proj)
        down = sp.row(f"{name}.down_proj", mlp.down_proj)
        for child in others:
            if child in NORMS_BEFORE_PROJECTION:  # over every feature: over the group
                norm_before_row(sp, f"{name}.{child}", getattr(mlp, child), down)
        if _scales_features(mlp):
            for key in FEATURE_SCALES:  # split as the columns are (torch.chunk's sizes)
                split_per_head(sp, name, mlp, key)
        if getattr(mlp, "activation_sparsity", 0):  # statistics over the whole width: the group's
            mlp = _gaussian_topk_mlp(sp, name, mlp)
        sp.shared_input.append(mlp)
        sp.done.add(name)
        return
    layer = ParallelMLP.from_modules(mlp.gate_proj, mlp.up_proj, mlp.down_proj, group=sp.group, sequence_parallel=sp.sp)
    layer = on_device(layer, mlp.down_proj.weight.device)
    sp.swap(name, layer)

    def export(pick, group):
        out = {}
        for key in ("weight", "bias"):
            if getattr(layer.in_proj, key) is None:
                continue
            fused = gather(pick(getattr(layer.in_proj, key)), 0, group)
            if fused is not None:  # None: a gradient this rank's pipeline stage did not compute
                out[f"gate_proj.{key}"], out[f"up_proj.{key}"] = unfuse_gate_up(fused)
            down = pick(getattr(layer.out_proj, key))
            out[f"down_proj.{key}"] = gather(down, 1, group) if key == "weight" else down
        return out

    def load(full):
        for key in ("weight", "bias"):
            if getattr(layer.in_proj, key) is None:
                continue
            fused = fuse_gate_up(full[f"gate_proj.{key}"], full[f"up_proj.{key}"])
            copy_in(getattr(layer.in_proj, key), own_slice(fused, 0, sp.group, unit=2))
            down = full[f"down_proj.{key}"]
            copy_in(getattr(layer.out_proj, key), own_slice(down, 1, sp.group) if key == "weight" else down)

    def layout():
        out = []
        for key in ("weight", "bias"):
            if getattr(layer.in_proj, key) is None:
                continue
            keys = (f"gate_proj.{key}", f"up_proj.{key}")
            out += pieces.interleaved(keys, getattr(layer.in_proj, key), sp.group, layer.ffn_hidden_size)
            down = getattr(layer.out_proj, key)
            out.append(
                pieces.split(f"down_proj.{key}", down, 1, sp.group, total=layer.ffn_hidden_size)
                if key == "weight"
                else pieces.whole(f"down_proj.{key}", down)
            )
        return out

    sp.exports.append(ExportRecord(name, export, load, layout))


class GaussianTopKMLP(nn.Module):
    """Gemma 3n's MLP with activation sparsity, gate and up split by columns over the group:
    down(act(topk(gate(x))) * up(x)), where the Gaussian top-k's cutoff, mean + std * icdf(sparsity)
    over the whole intermediate width, takes its mean and (biased) variance as sums over the group
    (each rank holds a slice of the gate's features). The same children, under the same names."""

    def __init__(self, mlp):
        super().__init__()
        self.config = mlp.config
        self.hidden_size, self.intermediate_size = mlp.hidden_size, mlp.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = (
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
            mlp.act_fn,
        )
        self.activation_sparsity = mlp.activation_sparsity

    def forward(self, hidden_states):  # Gemma3nTextMLP.forward
        gate_proj = self.gate_proj(hidden_states)
        if self.activation_sparsity > 0.0:
            gate_proj = self._gaussian_topk(gate_proj)
        return self.down_proj(self.act_fn(gate_proj) * self.up_proj(hidden_states))

    def _gaussian_topk(self, inputs):
        target = torch.tensor(self.activation_sparsity, dtype=torch.float32, device=inputs.device)
        multiplier = torch.distributions.normal.Normal(0, 1).icdf(target).type(inputs.dtype)
        group, width = self.gate_proj.group, self.gate_proj.out_features
        mean = sum_over_tp_region(inputs.sum(-1, keepdim=True), group) / width
        variance = sum_over_tp_region((inputs - mean).square().sum(-1, keepdim=True), group) / width
        return nn.functional.relu(inputs - (mean + variance.sqrt() * multiplier))


def _gaussian_topk_mlp(sp: ShardingPass, name, mlp):
    """Gemma 3n's sparse MLP, its children split, as GaussianTopKMLP; any other MLP reading an
    activation sparsity is refused (its statistics over the width are unknown math)."""
    if type(mlp).__name__ != "Gemma3nTextMLP" or "self._gaussian_topk(gate_proj)" not in forward_source(mlp):
        raise ValueError(
            f"parallelize: {name} ({type(mlp).__name__}) applies an activation sparsity over its whole intermediate "
            "width, which tplayers knows for Gemma 3n's MLP only; pass a plan for this model"
        )
    layer = GaussianTopKMLP(mlp)
    sp.swap(name, layer)
    return layer


MLP_PAIRS = (("fc1", "fc2"), ("fc_in", "fc_out"), ("c_fc", "c_proj"), ("up_proj", "down_proj"),
             ("dense_h_to_4h", "dense_4h_to_h"), ("linear_fc1", "linear_fc2"), ("lin1", "lin2"),
             ("layer_1", "layer_2"), ("wi", "wo"))  # fmt: skip


def two_layer_pair(module):
    """The (in, out) names of a two-layer MLP's linears in `module` (no gate: that is gated_mlp)."""
    if isinstance(getattr(module, "gate_proj", None), nn.Linear):
        return None
    return next((pair for pair in MLP_PAIRS if has_linears(module, pair)), None)


def two_layer_mlp(sp: ShardingPass, name, module):
    """fc_out(act(fc_in(x))) with an elementwise act: fc_in column-, fc_out row-parallel (a norm over
    every feature between them, Kosmos-2's, split with them: `norm_before_row`). The two
    may sit in the MLP module or in the decoder layer itself (OPT, which flattens the tokens first:
    under sequence parallelism the layers then split the tokens), so only they are marked done."""
    first, second = two_layer_pair(module)
    sp.column(f"{name}.{first}", getattr(module, first))
    row = sp.row(f"{name}.{second}", getattr(module, second))
    for child, act in module.named_children():  # the activation between them acts on split features
        if "act" in child and any(True for _ in act.parameters()):
            sp.done.add(f"{name}.{child}")
        elif NORMS_BEFORE_PROJECTION.get(child) == second:  # Kosmos-2's ffn_layernorm: over every feature
            norm_before_row(sp, f"{name}.{child}", act, row)


def is_t5_gated_mlp(module) -> bool:
    """T5 v1.1's (Flan-T5, mT5, UMT5, Pix2Struct): wo(act(wi_0(x)) * wi_1(x)), nothing else with weights."""
    return has_linears(module, ("wi_0", "wi_1", "wo")) and not any(
        next(m.parameters(), None) is not None for c, m in module.named_children() if c not in ("wi_0", "wi_1", "wo")
    )


def t5_gated_mlp(sp: ShardingPass, name, mlp):
    """wi_0 and wi_1 column-parallel on one shared input, wo row-parallel; HF's forward on the split."""
    for key in ("wi_0", "wi_1"):
        sp.shared_input_column(f"{name}.{key}", getattr(mlp, key))
    sp.row(f"{name}.wo", mlp.wo)
    sp.shared_input.append(mlp)
    sp.done.add(name)


def shared_expert_gate(sp: ShardingPass, name, module):
    """Qwen2-MoE: sigmoid(shared_expert_gate(x)) scales the shared expert: one output, kept whole
    (under sequence parallelism it sees this rank's tokens, and its gradient is summed)."""
    sp.done.add(f"{name}.shared_expert_gate")
    sp.whole.add(f"{name}.shared_expert_gate")


def gpt2_mlp(sp: ShardingPass, name, mlp):
    sp.column(f"{name}.c_fc", mlp.c_fc)
    sp.row(f"{name}.c_proj", mlp.c_proj)
    sp.done.add(name)


# Modules on the residual stream that act token by token on the whole hidden state (Gemma 3n's
# AltUp and LAuReL; Gemma 3n / 4's per-layer inputs; hyper-connections), by the class holding them: kept whole on
# every rank, read from their source. Their inputs are whole (or, under sequence parallelism,
# this rank's tokens, with their gradients summed like a norm's), so they compute what the
# unsharded model does.
RESIDUAL_STREAM = {
    "Gemma3nTextDecoderLayer": ("altup", "laurel", "per_layer_input_gate", "per_layer_projection"),
    "Gemma3nTextModel": ("per_layer_model_projection", "altup_projections", "altup_unembed_projections"),
    "Gemma4TextDecoderLayer": ("per_layer_input_gate", "per_layer_projection"),
    "Gemma4TextModel": ("per_layer_model_projection",),
    "Zamba2HybridLayer": ("linear",),  # the shared transformer's output, projected before the Mamba layer
    "ZambaHybridLayer": ("linear",),
    # hyper-connections: the mixing of several residual streams into a block's input and back
    "Qwen4ExpTextDecoderLayer": ("attn_hyper_connection", "mlp_hyper_connection"),
    "Qwen4ExpTextModel": ("hyper_connection_mixer",),
}
# Linears inside them too large to hold once per rank (Qwen4-Exp's mixers: 2 x 4H x 640 a connection):
# stored split by rows, all-gathered whole at every forward (`GatheredWeightLinear`), by the class holding them
GATHERED = {"Qwen4ExpTextGatedResidual": ("input_mix_weight_down", "input_mix_weight_up")}
# Of those, the layers whose residual stream stacks several hidden states before the sequence (Gemma 3n's AltUp:
# (streams, batch, sequence, hidden)): {class: the sequence's dimension}, where sequence parallelism splits it
STACKED_STREAMS = {"Gemma3nTextDecoderLayer": 2}


def holds_residual_stream_modules(module) -> bool:
    return type(module).__name__ in RESIDUAL_STREAM


def residual_stream_modules(sp: ShardingPass, name, module):
    # the model holding the blocks runs its own modules outside them, on whole sequences
    holds_blocks = any(isinstance(c, nn.ModuleList) for c in module.children())
    for child in RESIDUAL_STREAM[type(module).__name__]:
        if getattr(module, child, None) is not None:
            full = f"{name}.{child}" if name else child
            sp.done.add(full)
            sp.whole.add(full)
            for key in GATHERED.get(type(getattr(module, child)).__name__, ()):
                sp.column(f"{full}.{key}", getattr(getattr(module, child), key), layer_class=GatheredWeightLinear,
                          sequence_parallel=sp.sp and not holds_blocks)  # fmt: skip
