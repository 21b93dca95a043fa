"""`parallelize(model)`: shard a HuggingFace causal LM (or any model, given a plan) in place,
and `gather_state_dict(model)`: the full state dict under the original names.

The model's own forward keeps running (so `generate()` and its KV cache keep working); only
its projections are swapped for tensor-parallel layers holding this rank's shard:

    attention with q/k/v/o_proj (Llama, Mistral, Qwen2, ...): q, k, v column-parallel split by
        heads, o row-parallel; HF attention reshapes with -1 heads, so local heads just work
    GPT-2 attention (Conv1D c_attn holding [q; k; v], c_proj): c_attn column-parallel with rank
        r holding [q_r; k_r; v_r], c_proj row-parallel, `split_size` set to the local width
    gated MLP (gate/up/down_proj): SiLU -> ParallelMLP (one fused gate|up GEMM + SwiGLU kernel);
        any other activation -> gate, up column-parallel, down row-parallel
    GPT-2 MLP (Conv1D c_fc, c_proj): c_fc column-parallel, c_proj row-parallel
    input embeddings -> VocabParallelEmbedding; output embeddings (LM head) -> column-parallel
        over the vocabulary, gathered to full logits (or left vocab-sharded for
        `vocab_parallel_cross_entropy`); tied embeddings stay tied: both hold one Parameter.

Anything else takes `plan={module name: "colwise" | "rowwise" | "vocab" | "replicate"}`; a
projection that neither is recognised nor in the plan is an error naming it.

With sequence_parallel=True the residual stream between the projections is sharded along the
sequence: the hidden states are split along dim 1 as they enter the first block, each column
layer all-gathers its input inside its GEMM, each row layer reduce-scatters its output, and
the replicated weights applied to sequence shards (norms) get their gradients summed over the
group, so every `.grad` is complete.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate

from tplayers.nn.attention import ReplicatedLinear
from tplayers.distributed import resolve_group
from tplayers.nn.embedding import VocabParallelEmbedding
from tplayers.functional import comm
from tplayers.functional.collectives import (
    all_gather_dim,
    all_gather_sequence,
    copy_to_tp_region,
    gather_from_tp_region,
    own_slice,
    scatter_to_tp_region,
)
from tplayers.functional.linear import column_parallel_linear
from tplayers.nn.linear import ColumnParallelLinear, RowParallelLinear, _divide
from tplayers.nn.mlp import ParallelMLP, fuse_gate_up, unfuse_gate_up
from tplayers.placement import get_placement, set_placement

PLAN_KINDS = ("colwise", "rowwise", "vocab", "replicate")
_EXPORTS = "_tplayers_exports"  # [(prefix, export)] on the model, read by gather_state_dict
_ORIGINAL_KEYS = "_tplayers_original_keys"
_TIED = "_tplayers_tied"  # {LM head name: embedding name} where they share one Parameter

# export(pick, group) -> {name relative to the module: full tensor}; pick(param) -> param or its grad
Export = Callable[[Callable, dist.ProcessGroup], dict]
# load({name relative to the module: full tensor}) copies this rank's shards in; no communication
Load = Callable[[dict], None]


def _is_silu(act) -> bool:
    """Whether an activation module computes SiLU (HF has its own classes for it)."""
    if not isinstance(act, nn.Module):
        return False
    probe = torch.linspace(-4, 4, 17)
    try:
        return torch.equal(act(probe), nn.functional.silu(probe))
    except Exception:  # an activation that does not take a plain tensor is not SiLU
        return False


def _is_conv1d(module) -> bool:
    """HF's Conv1D (GPT-2): a linear layer with its weight stored (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


def _as_linear(module) -> nn.Linear:
    """An nn.Linear (on the meta device, then given the weights) equal to an nn.Linear or Conv1D."""
    if isinstance(module, nn.Linear):
        return module
    weight = module.weight.detach().t()
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if module.bias is not None:
        linear.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
    return linear


def _gather(t, dim, group):
    return all_gather_dim(t.contiguous(), dim, group) if t is not None else None


def _linear_export(layer, dim, transpose) -> Export:
    """weight gathered along `dim` (None: replicated), bias along dim 0 when the weight is split by rows."""

    def export(pick, group):
        full = {"weight": pick(layer.weight)}
        full["weight"] = _gather(full["weight"], dim, group) if dim is not None else full["weight"]
        if full["weight"] is not None and transpose:
            full["weight"] = full["weight"].t()
        if getattr(layer, "bias", None) is not None:
            bias = pick(layer.bias)
            full["bias"] = _gather(bias, 0, group) if dim == 0 else bias
        return full

    return export


def _linear_load(layer, dim, transpose, group) -> Load:
    """The inverse of `_linear_export`: this rank's slice of the full weight / bias, copied in."""

    def load(full):
        weight = full["weight"].t() if transpose else full["weight"]
        _copy_in(layer.weight, own_slice(weight, dim, group) if dim is not None else weight)
        if getattr(layer, "bias", None) is not None:
            _copy_in(layer.bias, own_slice(full["bias"], 0, group) if dim == 0 else full["bias"])

    return load


def _copy_in(param, value):
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"shape {tuple(value.shape)} does not give this rank's shard {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value)


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


def interleave_shards(parts, n):
    """Unsharded (F, ...) parts [q, k, v] -> the (sum F, ...) tensor whose r-th contiguous slice is
    [q_r; k_r; v_r]: a fused projection whose shards stay local."""
    return torch.cat([t for shards in zip(*(p.chunk(n, 0) for p in parts), strict=True) for t in shards], 0)


def deinterleave_shards(fused, n, sizes):
    """Inverse of `interleave_shards`: the fused tensor -> the unsharded parts of `sizes` rows."""
    per_rank = [shard.split([s // n for s in sizes], 0) for shard in fused.chunk(n, 0)]
    return [torch.cat([rank_parts[i] for rank_parts in per_rank], 0) for i in range(len(sizes))]


class _Parallelizer:
    """One pass over the model: each recognised module is swapped for its tensor-parallel form."""

    def __init__(self, model, group, sequence_parallel, plan, vocab_parallel_logits):
        self.model, self.group, self.sp = model, group, sequence_parallel
        self.n = dist.get_world_size(group)
        self.plan = dict(plan or {})
        self.vocab_parallel_logits = vocab_parallel_logits
        self.exports: list[tuple[str, Export, Load]] = []
        # Modules whose column projections share one input: it is prepared once for all of them (summed
        # gradient, or gathered along the sequence under SP) instead of once per projection.
        self.shared_input: list[nn.Module] = []
        self.partial_grads: list[nn.Parameter] = []
        self.tied: dict[str, str] = {}  # replicated, each rank holding part of the gradient
        self.done: set[str] = set()  # names of modules handled, with everything below them
        unknown = {k: v for k, v in self.plan.items() if v not in PLAN_KINDS}
        if unknown:
            raise ValueError(f"parallelize: plan values must be one of {PLAN_KINDS}, got {unknown}")

    # -- helpers --------------------------------------------------------------------------
    def _swap(self, name, new):
        parent_name, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent_name) if parent_name else self.model, child, new)
        self.done.add(name)

    def _column(self, name, module, sequence_parallel=None, **kwargs):
        sp = self.sp if sequence_parallel is None else sequence_parallel
        layer = ColumnParallelLinear.from_linear(
            _as_linear(module), group=self.group, sequence_parallel=sp, **kwargs
        ).to(module.weight.device)
        self._swap(name, layer)
        self._record(name, layer, 0, _is_conv1d(module))
        return layer

    def _record(self, name, layer, dim, transpose):
        self.exports.append(
            (name, _linear_export(layer, dim, transpose), _linear_load(layer, dim, transpose, self.group))
        )

    def _shared_input_column(self, name, module):
        """A column layer of a module in `shared_input`: its input gradient is summed (or reduce-
        scattered) once for the module, by the hook _shared_input_hooks puts before it."""
        return self._column(name, module, sequence_parallel=False, reduce_input_grad=False)

    def _row(self, name, module):
        layer = RowParallelLinear.from_linear(_as_linear(module), group=self.group, sequence_parallel=self.sp).to(
            module.weight.device
        )
        self._swap(name, layer)
        self._record(name, layer, 1, _is_conv1d(module))
        return layer

    # -- recognised patterns --------------------------------------------------------------
    def qkvo_attention(self, name, attn):
        head_dim = getattr(attn, "head_dim", None) or attn.o_proj.in_features // self._config("num_attention_heads")
        heads, kv_heads = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
        _divide(heads, self.n, f"{name}: attention heads")
        if kv_heads % self.n and self.n % kv_heads:
            raise ValueError(
                f"{name}: key/value heads ({kv_heads}) and the tensor-parallel size ({self.n}): one must divide "
                "the other (key/value heads split over the ranks, or each replicated on n / heads ranks)"
            )
        self._shared_input_column(f"{name}.q_proj", attn.q_proj)
        if kv_heads % self.n == 0:
            self._shared_input_column(f"{name}.k_proj", attn.k_proj)
            self._shared_input_column(f"{name}.v_proj", attn.v_proj)
        else:  # fewer key/value heads than ranks: each rank computes the one its query heads use
            kv_index = dist.get_rank(self.group) // (self.n // kv_heads)
            for proj in ("k_proj", "v_proj"):
                module = getattr(attn, proj)
                layer = ReplicatedKVProjection.from_linear(module, group=self.group).to(module.weight.device)
                layer.rows = slice(kv_index * head_dim, (kv_index + 1) * head_dim)
                self._swap(f"{name}.{proj}", layer)
                self._record(f"{name}.{proj}", layer, None, False)
            attn.num_key_value_groups = heads // self.n  # local query heads per (one) local kv head
        self._row(f"{name}.o_proj", attn.o_proj)
        self._per_head_weights(name, attn, head_dim)
        self.shared_input.append(attn)
        self.done.add(name)

    def _per_head_weights(self, name, attn, head_dim):
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
                self.partial_grads.append(p)

    def gpt2_attention(self, name, attn):
        width = attn.c_attn.nf // 3
        _divide(attn.num_heads, self.n, f"{name}: attention heads")
        full = _as_linear(attn.c_attn)
        fused = nn.Linear(full.in_features, full.out_features, bias=full.bias is not None, device="meta")
        fused.weight = nn.Parameter(interleave_shards(full.weight.split(width, 0), self.n), requires_grad=False)
        if full.bias is not None:
            fused.bias = nn.Parameter(interleave_shards(full.bias.split(width, 0), self.n), requires_grad=False)
        layer = ColumnParallelLinear.from_linear(fused, group=self.group, reduce_input_grad=False).to(
            attn.c_attn.weight.device
        )
        self._swap(f"{name}.c_attn", layer)

        def export(pick, group):
            out = {}
            for key in ("weight", "bias") if layer.bias is not None else ("weight",):
                t = _gather(pick(getattr(layer, key)), 0, group)
                if t is not None:
                    t = torch.cat(deinterleave_shards(t, self.n, [width] * 3), 0)
                    out[key] = t.t() if key == "weight" else t
            return out

        def load(full):
            for key in ("weight", "bias") if layer.bias is not None else ("weight",):
                t = full[key].t() if key == "weight" else full[key]
                _copy_in(getattr(layer, key), own_slice(interleave_shards(t.split(width, 0), self.n), 0, self.group))

        self.exports.append((f"{name}.c_attn", export, load))
        attn.split_size = width // self.n  # HF splits c_attn's output into q, k, v of this width
        self._row(f"{name}.c_proj", attn.c_proj)
        self.shared_input.append(attn)
        self.done.add(name)

    def gated_mlp(self, name, mlp):
        if _is_silu(getattr(mlp, "act_fn", None)):
            layer = ParallelMLP.from_modules(
                mlp.gate_proj, mlp.up_proj, mlp.down_proj, group=self.group, sequence_parallel=self.sp
            ).to(mlp.down_proj.weight.device)
            self._swap(name, layer)

            def export(pick, group):
                gate_up = layer.in_proj
                out = {}
                for key in ("weight", "bias"):
                    if getattr(gate_up, key) is None:
                        continue
                    gate, up = unfuse_gate_up(_gather(pick(getattr(gate_up, key)), 0, group), self.n)
                    out[f"gate_proj.{key}"], out[f"up_proj.{key}"] = gate, up
                    down = pick(getattr(layer.out_proj, key))
                    out[f"down_proj.{key}"] = _gather(down, 1, group) if key == "weight" else down
                return out

            def load(full):
                for key in ("weight", "bias"):
                    if getattr(layer.in_proj, key) is None:
                        continue
                    fused = fuse_gate_up(full[f"gate_proj.{key}"], full[f"up_proj.{key}"], self.n)
                    _copy_in(getattr(layer.in_proj, key), own_slice(fused, 0, self.group))
                    down = full[f"down_proj.{key}"]
                    _copy_in(getattr(layer.out_proj, key), own_slice(down, 1, self.group) if key == "weight" else down)

            self.exports.append((name, export, load))
            return
        self._shared_input_column(f"{name}.gate_proj", mlp.gate_proj)
        self._shared_input_column(f"{name}.up_proj", mlp.up_proj)
        self._row(f"{name}.down_proj", mlp.down_proj)
        self.shared_input.append(mlp)
        self.done.add(name)

    def gpt2_mlp(self, name, mlp):
        self._column(f"{name}.c_fc", mlp.c_fc)
        self._row(f"{name}.c_proj", mlp.c_proj)
        self.done.add(name)

    def embeddings(self):
        emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        names = {id(m): n for n, m in self.model.named_modules()}
        if isinstance(emb, nn.Embedding) and names.get(id(emb)) not in self.plan:
            tied = head is not None and head.weight is emb.weight
            new_emb = VocabParallelEmbedding.from_embedding(emb, group=self.group).to(emb.weight.device)
            self._swap(names[id(emb)], new_emb)
            self._record(names[id(emb)], new_emb, 0, False)
            if isinstance(head, nn.Linear) and names.get(id(head)) not in self.plan:
                # the LM head sees the whole sequence: sequence parallelism ends after the last block
                new_head = self._column(
                    names[id(head)], head, sequence_parallel=False, gather_output=not self.vocab_parallel_logits
                )
                if tied:  # one Parameter, one placement: still tied after sharding
                    new_head.weight = new_emb.weight
                    self.tied[names[id(head)]] = names[id(emb)]

    def apply_plan(self, name, module, kind):
        if kind == "colwise":
            self._column(name, module)
        elif kind == "rowwise":
            self._row(name, module)
        elif kind == "vocab":
            new = VocabParallelEmbedding.from_embedding(module, group=self.group).to(module.weight.device)
            self._swap(name, new)
            self._record(name, new, 0, False)
        else:
            self.done.add(name)

    def _config(self, key):
        return getattr(getattr(self.model, "config", None), key)

    # -- the pass -------------------------------------------------------------------------
    def run(self):
        self.embeddings()
        for name, module in list(self.model.named_modules()):
            if not name or any(name == d or name.startswith(d + ".") for d in self.done):
                continue
            if name in self.plan:
                self.apply_plan(name, module, self.plan[name])
            elif all(isinstance(getattr(module, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
                self.qkvo_attention(name, module)
            elif _is_conv1d(getattr(module, "c_attn", None)) and _is_conv1d(getattr(module, "c_proj", None)):
                self.gpt2_attention(name, module)
            elif all(isinstance(getattr(module, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")):
                self.gated_mlp(name, module)
            elif _is_conv1d(getattr(module, "c_fc", None)) and _is_conv1d(getattr(module, "c_proj", None)):
                self.gpt2_mlp(name, module)
        unplaced = [
            name
            for name, module in self.model.named_modules()
            if ((isinstance(module, nn.Linear) and not isinstance(module, ColumnParallelLinear | RowParallelLinear))
                or _is_conv1d(module))
            and not any(name == d or name.startswith(d + ".") for d in self.done)
        ]  # fmt: skip
        if unplaced:
            raise ValueError(
                f"parallelize: could not place {unplaced}; pass plan={{name: one of {PLAN_KINDS}}} for them"
            )


def _replace_hidden(fn):
    """A forward pre-hook applying `fn` to a module's hidden states, passed first or by keyword."""

    def hook(module, args, kwargs):
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}

    return hook


def _check_sequence(hidden, n):
    if hidden.dim() != 3 or hidden.shape[1] % n:
        raise ValueError(
            f"parallelize(sequence_parallel=True): sequence length {tuple(hidden.shape)[1:2]} is not divisible "
            f"by the tensor-parallel size ({n}); generate with a model parallelized without sequence_parallel"
        )
    return hidden


def _shared_input_hooks(modules, group, sequence_parallel):
    """Before each module whose column projections share one input: copy_to_tp_region (forward
    identity, backward one all-reduce of the summed partial input gradients), or under sequence
    parallelism all_gather_sequence (forward one all-gather, backward one reduce-scatter). HF
    attention reshapes with its input's sequence length, so it must see the whole sequence."""
    prepare = all_gather_sequence if sequence_parallel else copy_to_tp_region
    for module in modules:
        module.register_forward_pre_hook(_replace_hidden(lambda h: prepare(h, group)), with_kwargs=True)


def _sequence_parallel_hooks(model, group, blocks):
    """Shard the residual stream along the sequence between the first block's entry and the last
    block's exit (the model's masks and positions are built from the whole sequence before,
    its final norm and LM head see the whole sequence after). Replicated weights
    inside the blocks (norms) see only this rank's part of the sequence: their gradients are
    summed over the group, so every rank holds the whole gradient."""
    n = dist.get_world_size(group)
    # Entry: keep this rank's part; backward all-gathers the parts (the embeddings are replicated).
    blocks[0].register_forward_pre_hook(
        _replace_hidden(lambda h: scatter_to_tp_region(_check_sequence(h, n), group, dim=1)), with_kwargs=True
    )
    # Exit: the whole sequence on every rank; backward keeps this rank's part of the (replicated) gradient.
    blocks[-1].register_forward_hook(
        lambda module, args, out: (
            (gather_from_tp_region(out[0], group, dim=1), *out[1:])
            if isinstance(out, tuple)
            else gather_from_tp_region(out, group, dim=1)
        )
    )
    _summed_grads([p for block in blocks for p in block.parameters() if get_placement(p) is None], group)


def _summed_grads(params, group):
    """Replicated parameters whose gradient each rank holds only part of: tagged Replicate and
    summed over the group as the gradient is computed, so every rank holds the whole of it."""
    for p in params:
        if get_placement(p) is None and p.requires_grad:
            set_placement(p, group, Replicate())
            p.register_hook(lambda g: _summed(g, group))


def _length_check(max_positions):
    """A forward pre-hook: inputs (with what the KV cache already holds) longer than the model's
    positions get a clear error on every rank, before any collective."""

    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if ids is None:
            return
        cache = kwargs.get("past_key_values")
        cached = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        length = cached + ids.shape[1]
        if length > max_positions:
            raise ValueError(f"input of {length} positions is longer than the model's {max_positions}")

    return hook


def _no_labels(module, args, kwargs):
    if kwargs.get("labels") is not None:
        raise ValueError(
            "parallelize(vocab_parallel_logits=True): the model's own loss needs full logits; compute it with "
            "tplayers.vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:]) instead of passing labels"
        )


def _summed(grad, group):
    """The gradient summed over `group` (a replicated weight that saw part of the sequence)."""
    grad = grad.contiguous().clone()
    comm.all_reduce(grad, group)
    return grad


def _decoder_blocks(model, placed):
    """The transformer blocks: the nn.ModuleList whose items hold the placed attention / MLP modules."""
    placed_ids = {id(m) for m in placed}
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module)
            and all(any(id(m) in placed_ids for m in item.modules()) for item in module)
        ):
            return module
    return None


def parallelize(model, *, group=None, sequence_parallel=False, plan=None, vocab_parallel_logits=False):
    """Shard `model` in place over `group` (see the module docstring); returns it.

    After it, `model(ids).logits` are the full-vocabulary logits of the unsharded model
    (`vocab_parallel_logits=True` leaves them split along the vocabulary) and `backward()`
    leaves on each rank its slice of the unsharded gradients.
    """
    group = resolve_group(group)
    keys = list(model.state_dict().keys())
    parallelizer = _Parallelizer(model, group, sequence_parallel, plan, vocab_parallel_logits)
    parallelizer.run()
    if sequence_parallel:
        blocks = _decoder_blocks(model, parallelizer.shared_input)
        if not blocks:
            raise ValueError("parallelize: sequence_parallel=True needs the model's blocks in an nn.ModuleList")
    _shared_input_hooks(parallelizer.shared_input, group, sequence_parallel)
    _summed_grads(parallelizer.partial_grads, group)
    if vocab_parallel_logits:
        model.register_forward_pre_hook(_no_labels, with_kwargs=True)
    config = getattr(model, "config", None)
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_positions:
        model.register_forward_pre_hook(_length_check(max_positions), with_kwargs=True)
    if sequence_parallel:
        _sequence_parallel_hooks(model, group, blocks)
    for p in model.parameters():  # everything else is whole on every rank, with its whole gradient
        if get_placement(p) is None:
            set_placement(p, group, Replicate())
    setattr(model, _EXPORTS, parallelizer.exports)
    setattr(model, _ORIGINAL_KEYS, keys)
    setattr(model, _TIED, parallelizer.tied)
    return model


def _gathered(model, group, pick):
    """{original name: full tensor} for every sharded module; a collective on every rank."""
    full = {}
    for prefix, export, _ in getattr(model, _EXPORTS, []):
        for key, tensor in export(pick, group).items():
            full[f"{prefix}.{key}"] = tensor
    return full


def gather_state_dict(model, *, group=None) -> dict:
    """The full, unsharded state dict under the original module names, on every rank."""
    group = resolve_group(group)
    full = _gathered(model, group, lambda p: p.detach())
    sharded_prefixes = tuple(prefix + "." for prefix, _, _ in getattr(model, _EXPORTS, []))
    for key, value in model.state_dict().items():
        if not key.startswith(sharded_prefixes):
            full[key] = value
    order = getattr(model, _ORIGINAL_KEYS, list(full))
    return {key: full[key] for key in order if key in full}


def gather_grads(model, *, group=None) -> dict:
    """The full, unsharded gradient of every parameter under its original name, on every rank."""
    group = resolve_group(group)
    full = _gathered(model, group, lambda p: p.grad)
    sharded_prefixes = tuple(prefix + "." for prefix, _, _ in getattr(model, _EXPORTS, []))
    for key, p in model.named_parameters():
        if not key.startswith(sharded_prefixes):
            full[key] = p.grad
    return {k: v for k, v in full.items() if v is not None}


def load_full_state_dict(model, state_dict, *, group=None) -> None:
    """Load a full, unsharded state dict (original names, what `gather_state_dict` returns) into a
    parallelized model: each rank copies in its shards. No communication; strict like
    `load_state_dict`."""
    records = getattr(model, _EXPORTS, [])
    state_dict = dict(state_dict)
    supplied = set(state_dict)
    for prefix, _, load in records:
        start = prefix + "."
        tied_to = getattr(model, _TIED, {}).get(prefix)
        if tied_to and f"{start}weight" not in supplied and f"{tied_to}.weight" in supplied:
            continue  # HF checkpoints of tied models omit the head: it is the embedding's Parameter
        try:
            load({k[len(start) :]: state_dict.pop(k) for k in list(state_dict) if k.startswith(start)})
        except KeyError as e:
            raise ValueError(f"load_full_state_dict: missing key {start}{e.args[0]}") from None
    sharded_prefixes = tuple(prefix + "." for prefix, _, _ in records)
    own = {k for k in model.state_dict() if not k.startswith(sharded_prefixes)}
    if set(state_dict) != own:
        raise ValueError(
            f"load_full_state_dict: unexpected keys {sorted(set(state_dict) - own)}, "
            f"missing keys {sorted(own - set(state_dict))}"
        )
    model.load_state_dict(state_dict, strict=False)
