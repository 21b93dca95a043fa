"""The generic sharding pass: walks a model's modules, hands each one a family adapter
recognises to that adapter, applies a user's plan, swaps linear layers for their column- /
row-parallel forms, and records for every swapped module how to export (gather) and load its
full weights. It knows no model family: `tplayers.hf.families` does.

HF models hold linear layers as `nn.Linear` or, in GPT-2 and its relatives, as `Conv1D` (the
same map with its weight stored (in, out)); both are handled here.
"""

import fnmatch
import weakref
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from tplayers.functional.collectives import all_gather_any, own_slice
from tplayers.hf import pieces
from tplayers.hf.attached import move_attached
from tplayers.hf.source import same_forward
from tplayers.hf.state_dict import ExportRecord
from tplayers.nn.linear import ColumnParallelLinear, RowParallelLinear, _ParallelLinear, refuse_own_forward
from tplayers.nn.lm_head import ParallelLMHead, ScaledLogitsHead
from tplayers.nn.mlp import ParallelMLP
from tplayers.placement import SharesGroups, copy_into

PLAN_KINDS = ("colwise", "rowwise", "vocab", "replicate")

# export(pick, group) -> {name relative to the module: full tensor}; pick(param) -> param or its grad
Export = Callable[[Callable, dist.ProcessGroup], dict]
# load({name relative to the module: full tensor}) copies this rank's shards in; no communication
Load = Callable[[dict], None]


def is_conv1d(module) -> bool:
    """HF's Conv1D (GPT-2): a linear layer with its weight stored (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


def has_linears(module, names) -> bool:
    return all(isinstance(getattr(module, p, None), nn.Linear) for p in names)


def has_conv1ds(module, names) -> bool:
    return all(is_conv1d(getattr(module, p, None)) for p in names)


def as_linear(module, name="") -> nn.Linear:
    """An nn.Linear (on the meta device, then given the weights) equal to an nn.Linear or Conv1D.
    A subclass of nn.Linear with its own forward is refused, naming the module."""
    if isinstance(module, nn.Linear):
        refuse_own_forward(module, nn.Linear, f"parallelize: {name}")
        return module
    weight = module.weight.detach().t()
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if module.bias is not None:
        linear.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
    return linear


def gather(t, dim, group):
    """`t` all-gathered along `dim` over `group`, whatever each rank holds of it (None stays
    None: a parameter without a gradient); exports only, which are not hot."""
    return all_gather_any(t.contiguous(), dim, group) if t is not None else None


def on_device(module, device):
    """`module` moved to `device`, except to meta (a model built under tplayers.parameters_on_meta,
    whose parameters already are): its buffers (rotary frequencies, scales) stay real."""
    return module if device.type == "meta" else module.to(device)


def copy_in(param, value):
    """Copy this rank's TP shard into a parameter (or its data-parallel shard of it, under ZeRO
    2-3), refusing a shape that is not this rank's shard."""
    copy_into(param, value)


def _codebook_heads(head) -> bool:
    """One LM head per codebook (MusicGen's `lm_heads`): an nn.ModuleList of plain nn.Linear."""
    return isinstance(head, nn.ModuleList) and len(head) > 0 and all(type(h) is nn.Linear for h in head)


def _scales_logits(head) -> bool:
    """Dory's LM head (`linear(x).float() * (logit_scale.float() * logit_scale_factor)`), with
    transformers' forward line for line."""
    if type(head).__name__ != "DoryLMHead":
        return False
    from transformers.models.dory.modeling_dory import DoryLMHead

    return same_forward(head, DoryLMHead)


def _bias_held_twice(model, name, head) -> tuple[nn.Module, str] | None:
    """(the parent, its name for the bias) of an LM head whose bias its parent also holds as a
    parameter of its own (BERT's prediction head: `self.decoder.bias = self.bias`), else None."""
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    held = [k for k, p in parent._parameters.items() if p is not None and head.bias is not None and p is head.bias]
    return (parent, held[0]) if held else None


def linear_export(layer, dim, transpose) -> Export:
    """weight gathered along `dim` (None: replicated), bias along dim 0 when the weight is split by rows."""

    def export(pick, group):
        full = {"weight": pick(layer.weight)}
        full["weight"] = gather(full["weight"], dim, group) if dim is not None else full["weight"]
        if full["weight"] is not None and transpose:
            full["weight"] = full["weight"].t()
        if getattr(layer, "bias", None) is not None:
            bias = pick(layer.bias)
            full["bias"] = gather(bias, 0, group) if dim == 0 else bias
        return full

    return export


def linear_load(layer, dim, transpose, group) -> Load:
    """The inverse of `linear_export`: this rank's slice of the full weight / bias, copied in."""

    unit, sizes = getattr(layer, "split_unit", 1), getattr(layer, "split_sizes", None)

    def load(full):
        weight = full["weight"].t() if transpose else full["weight"]
        copy_in(layer.weight, own_slice(weight, dim, group, unit, sizes) if dim is not None else weight)
        if getattr(layer, "bias", None) is not None:
            bias = full["bias"]
            copy_in(layer.bias, own_slice(bias, 0, group, unit, sizes) if dim == 0 else bias)

    return load


def hf_plan_hint(model, names) -> str:
    """What the model's own `config.base_model_tp_plan` says about `names`, if anything: a hint
    for the user writing a plan, not a placement tplayers takes unchecked (HF's plan gathers the
    outputs of fused projections, and its kinds are not all exact layouts)."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    said = {n: kind for n in names for pattern, kind in plan.items() if fnmatch.fnmatchcase(n, "*" + pattern)}
    if not said:
        return ""
    return f" (HF's base_model_tp_plan, a hint tplayers has not checked, says {said})"


# A cross-attention's other input, by keyword (Kosmos-2's image latents, Mllama's vision states): whole on
# every rank, under sequence parallelism too, and read by the same key / value columns as the hidden states
CROSS_INPUTS = ("encoder_hidden_states", "key_value_states", "cross_attention_states")


def model_embedding(model, getter):
    """model.get_input_embeddings() / get_output_embeddings() / get_decoder(), None where it has none
    (transformers' default raises NotImplementedError where it cannot find one: PP-FormulaNet)."""
    try:
        return getattr(model, getter)() if hasattr(model, getter) else None
    except NotImplementedError:
        return None


# A module's hidden states by keyword: by that name, or a perceiver's latents and the context they attend to
# (Idefics 2's resampler: both read by its columns)
HIDDEN_INPUTS = ("hidden_states", "latents", "context")


def replace_hidden(fn, cross=None):
    """A forward pre-hook applying `fn` to a module's hidden states, passed first or by keyword
    (HIDDEN_INPUTS), and `cross` to a cross-attention input passed by keyword (CROSS_INPUTS)."""

    def hook(module, args, kwargs):
        if cross is not None and any(kwargs.get(k) is not None for k in CROSS_INPUTS):
            kwargs = {k: cross(v) if k in CROSS_INPUTS and v is not None else v for k, v in kwargs.items()}
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        named = [k for k in HIDDEN_INPUTS if kwargs.get(k) is not None]
        if not named:
            raise ValueError(f"parallelize: {type(module).__name__} was called without its hidden states")
        return args, {**kwargs, **{k: fn(kwargs[k]) for k in named}}

    return hook


def _under(name, done) -> bool:
    return any(name == d or name.startswith(d + ".") for d in done)


class ShardingPass(SharesGroups):
    """One pass over the model: each module an adapter recognises is swapped for its
    tensor-parallel form; what the adapters need (column / row swaps, export records, inputs
    shared by several column layers, weights whose gradient each rank holds only part of) is here."""

    def __init__(
        self, model, group, *, sequence_parallel=False, plan=None, vocab_parallel_logits=False, overlap="auto",
        keep=frozenset(), expert_group=None, towers=(),
    ):  # fmt: skip
        self.model, self.group, self.sp, self.overlap = model, group, sequence_parallel, overlap
        self.sequence_parallel = sequence_parallel  # the user's; `sp` is off inside towers (see run)
        self.towers = set(towers)  # modules beside the language model (tplayers.hf.vision): never split by sequence
        self.expert_group = expert_group  # MoE experts placed whole over it (tplayers.hf.expert_parallel)
        self.keep = keep  # modules that must stay one layer each (they carry LoRA adapters)
        self.n = dist.get_world_size(group)
        self.plan = dict(plan or {})
        self.vocab_parallel_logits = vocab_parallel_logits
        # (prefix, export, load, pieces): see tplayers.hf.state_dict.EXPORTS
        self.exports: list[ExportRecord] = []
        # Modules whose column projections share one input: it is prepared once for all of them (summed
        # gradient, or gathered along the sequence under SP) instead of once per projection.
        self.shared_input: list[nn.Module] = []
        self.partial_grads: list[nn.Parameter] = []  # replicated, each rank holding part of the gradient
        self.tied: dict[str, str] = {}  # {LM head name: embedding name} sharing one Parameter
        self.done: set[str] = set()  # names of modules handled, with everything below them
        self.whole: set[str] = set()  # of those, modules kept whole on every rank (replicated)
        unknown = {k: v for k, v in self.plan.items() if v not in PLAN_KINDS}
        if unknown:
            raise ValueError(f"parallelize: plan values must be one of {PLAN_KINDS}, got {unknown}")
        self.plan_used: set[str] = set()  # plan keys that named a module
        self.swapped_out: dict[int, tuple] = {}  # {id: (name, weakref)} of the swapped-out modules' parameters
        self.wrapped: dict[str, nn.Module] = {}  # {name: wrapper} given way to its linear child (unwrap_linears)

    def planned(self, name) -> str | None:
        """The plan's kind for module `name`: its own entry, else the one kind of the patterns
        (fnmatch: `"*.mlp.router"`, `"model.layers.*.mlp.gate.wg"`) that match its full name; two
        patterns giving it different kinds are refused, naming both."""
        if name is None:
            return None
        if name in self.plan:
            self.plan_used.add(name)
            return self.plan[name]
        hits = {k: v for k, v in self.plan.items() if any(c in k for c in "*?[") and fnmatch.fnmatchcase(name, k)}
        if len(set(hits.values())) > 1:
            raise ValueError(f"parallelize: plan patterns {sorted(hits)} give {name} different kinds {hits}")
        self.plan_used.update(hits)
        return next(iter(hits.values()), None)

    def shared_inputs_by_sequence(self) -> tuple[list, list]:
        """`shared_input` split in two: the language model's modules, and the towers' (whose input
        sequence parallelism never splits)."""
        names = {id(m): n for n, m in self.model.named_modules()}
        tower = [m for m in self.shared_input if _under(names.get(id(m), ""), self.towers)]
        return [m for m in self.shared_input if all(m is not t for t in tower)], tower

    def check_plan_used(self):
        """A plan entry that named no module (a typo, another model's name) is refused, naming it:
        the module the user meant would otherwise be placed by the adapters, or not at all."""
        unused = sorted(set(self.plan) - self.plan_used)
        if not unused:
            return
        names = [n for n, _ in self.model.named_modules()]
        inside = {(k, next(d for d in sorted(self.done) if _under(n, {d})))
                  for k in unused for n in names if fnmatch.fnmatchcase(n, k) and _under(n, self.done)}  # fmt: skip
        if inside:
            raise ValueError(
                f"parallelize: plan entries {sorted({k for k, _ in inside})} name modules inside "
                f"{sorted({d for _, d in inside})}, which "
                "tplayers placed as a whole (an attention or MLP layout); plan the enclosing module instead"
            )
        raise ValueError(f"parallelize: plan entries {unused} name no module of {type(self.model).__name__}")

    def check_no_tie_broken(self):
        """A Parameter the model holds under two names (tied: T5Gemma 2's encoder and decoder
        embeddings) whose module was swapped under one name and left as it was under the other
        would be two tensors from then on, trained apart: refused, naming both."""
        for name, p in self.model.named_parameters(remove_duplicate=False):
            other, ref = self.swapped_out.get(id(p), (None, lambda: None))
            if ref() is p:
                raise ValueError(
                    f"parallelize: {name} is the same Parameter as {other} (tied), which tplayers "
                    f"sharded while {name} was left whole: the two would be trained apart. Pass a plan placing "
                    f"{name.rpartition('.')[0]!r} like the other, or untie them"
                )

    def release(self):
        """Drop the pass's references to the model and its modules, which the export records
        (closures over this pass) would otherwise keep alive: pipeline stages hold only their own
        records, and the layers of the other stages must be freed with the model."""
        self.model, self.shared_input, self.partial_grads, self.done, self.whole = None, [], [], set(), set()
        self.swapped_out = {}

    # -- what adapters call -----------------------------------------------------------------
    def keeps(self, name, children) -> bool:
        """Whether any of `name`'s `children` must stay a layer of its own (no fused layout)."""
        return any(f"{name}.{child}" in self.keep for child in children)

    def swap(self, name, new, whole_output=None):
        """Put `new` in the place of module `name`; the hooks on it move to `new` where its output
        is the replaced module's (`whole_output`; default: an MLP's or a row-parallel layer's),
        else they are refused, as parametrizations are (`tplayers.hf.attached`)."""
        for layer in new.modules():  # every tensor-parallel linear the adapter built, however nested
            if isinstance(layer, _ParallelLinear):
                layer.overlap = self.overlap
        parent_name, _, child = name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        kept = {id(p) for p in new.parameters()}
        for key, p in getattr(parent, child).named_parameters():  # what the new module does not hold on to
            held = self.swapped_out.get(id(p))
            if id(p) not in kept and (held is None or held[1]() is None):  # weakly: freed, its id is reused
                self.swapped_out[id(p)] = (f"{name}.{key}", weakref.ref(p))
        old = getattr(parent, child)
        whole = isinstance(new, RowParallelLinear | ParallelMLP) if whole_output is None else whole_output
        move_attached(name, old, new, whole)
        new.train(old.training)  # in the mode of the module it replaces
        setattr(parent, child, new)
        self.done.add(name)

    def column(self, name, module, sequence_parallel=None, layer_class=ColumnParallelLinear, **kwargs):
        sp = self.sp if sequence_parallel is None else sequence_parallel
        layer = layer_class.from_linear(as_linear(module, name), group=self.group, sequence_parallel=sp, **kwargs)
        layer = on_device(layer, module.weight.device)
        self.swap(name, layer)
        self.record(name, layer, dim=0, transpose=is_conv1d(module))
        return layer

    def shared_input_column(self, name, module, **kwargs):
        """A column layer of a module in `shared_input`: its input gradient is summed (or reduce-
        scattered) once for the module, by the hook parallelize puts before it."""
        return self.column(name, module, sequence_parallel=False, reduce_input_grad=False, **kwargs)

    def row(self, name, module, **kwargs):
        layer = RowParallelLinear.from_linear(
            as_linear(module, name), group=self.group, sequence_parallel=self.sp, **kwargs
        )
        layer = on_device(layer, module.weight.device)
        self.swap(name, layer)
        self.record(name, layer, dim=1, transpose=is_conv1d(module))
        return layer

    def record(self, name, layer, *, dim, transpose=False):
        """The export record of a column (`dim` 0) / row (1) layer swapped in for the HF linear
        `name` (`transpose`: a GPT-2 Conv1D, its weight stored (in, out))."""
        self.exports.append(
            ExportRecord(
                name,
                linear_export(layer, dim, transpose),
                linear_load(layer, dim, transpose, self.group),
                lambda: pieces.linear(layer, dim, transpose, self.group),
            )
        )

    def config(self, key):
        return getattr(getattr(self.model, "config", None), key)

    # -- generic parts ----------------------------------------------------------------------
    def vocab_parallel(self, name, embedding):
        """The vocabulary-parallel form of an input embedding: from the first embedding adapter
        that knows its forward exactly; anything else is refused, naming it."""
        adapter = next((a for a in self.embedding_adapters if a.matches(embedding)), None)
        if adapter is None:
            raise ValueError(
                f"parallelize: {name} is a {type(embedding).__name__} whose forward tplayers does not know; "
                f"it is not replaced. Pass plan={{{name!r}: 'replicate'}} to keep it whole on every rank"
            )
        new = on_device(adapter.build(embedding, self.group), embedding.weight.device)
        self.swap(name, new, whole_output=True)
        whole = {f"{c}.{k}": p for c, m in new.named_children() for k, p in m.named_parameters()}
        if not whole:
            self.record(name, new, dim=0)
            return new
        # the model's own modules after the lookup (a norm), whole on every rank, exported with it
        self.whole.update(f"{name}.{child}" for child, _ in new.named_children())
        export, load = linear_export(new, 0, False), linear_load(new, 0, False, self.group)

        def export_all(pick, group):
            return {**export(pick, group), **{key: pick(p) for key, p in whole.items()}}

        def load_all(full):
            load(full)
            for key, p in whole.items():
                copy_in(p, full[key])

        def layout():
            return [*pieces.linear(new, 0, False, self.group), *(pieces.whole(k, p) for k, p in whole.items())]

        self.exports.append(ExportRecord(name, export_all, load_all, layout))
        return new

    def embeddings(self):
        emb = model_embedding(self.model, "get_input_embeddings")
        head = model_embedding(self.model, "get_output_embeddings")
        decoder = model_embedding(self.model, "get_decoder")
        if head is None and isinstance(decoder, nn.Module):  # its decoder scores (Nemotron-H Omni, BLIP)
            head = model_embedding(decoder, "get_output_embeddings")
        names = {id(m): n for n, m in self.model.named_modules()}
        if _codebook_heads(head) and self.planned(names.get(id(head))) is None:
            for i, each in enumerate(head):  # MusicGen: the model stacks their logits and scores them itself
                self.column(f"{names[id(head)]}.{i}", each, sequence_parallel=False, gather_output=True)
            head = None  # placed
        new_emb = None
        if isinstance(emb, nn.Embedding) and self.planned(names.get(id(emb))) is None:
            new_emb = self.vocab_parallel(names[id(emb)], emb)
            self._tied_embeddings(emb, new_emb, names[id(emb)])
        tied = head is not None and emb is not None and getattr(head, "weight", None) is getattr(emb, "weight", None)
        if not isinstance(head, nn.Linear) or id(head) not in names or self.planned(names[id(head)]) is not None:
            return
        if tied and new_emb is None:  # its embedding is placed by the plan: the head follows it there, or is refused
            return
        if _scales_logits(head):
            self._scaled_logits_head(names[id(head)], head, new_emb if tied else None)
            return
        bias_held_twice = _bias_held_twice(self.model, names[id(head)], head)
        # the LM head sees the whole sequence: sequence parallelism ends after the last block
        new_head = (
            self.column(names[id(head)], head, sequence_parallel=False, gather_output=False)
            if self.vocab_parallel_logits
            else self.column(names[id(head)], head, sequence_parallel=False, layer_class=ParallelLMHead)
        )
        if tied:  # one Parameter, one placement: still tied after sharding
            new_head.weight = new_emb.weight
            self.tied[names[id(head)]] = names[id(emb)]
        else:  # an embedding holding the head's Parameter (a BERT decoder's beside a BERT encoder, T5Gemma's decoder's)
            self._tied_embeddings(head, new_head, names[id(head)])
        if bias_held_twice:
            self._bias_held_twice(names[id(head)], new_head, *bias_held_twice)

    def _tied_embeddings(self, emb, new_emb, emb_name):
        """The other embeddings holding `emb`'s (an embedding's or an LM head's) Parameter (BART's
        encoder and decoder `embed_tokens` beside its `shared`, T5Gemma 2's): each in its own
        vocabulary-parallel form (a scaled one keeps its scale), all holding the one split Parameter
        (`new_emb`'s, its rows split alike), still tied."""
        for name, module in list(self.model.named_modules()):
            if isinstance(module, nn.Embedding) and module.weight is emb.weight and self.planned(name) is None:
                self.vocab_parallel(name, module).weight = new_emb.weight
                self.tied[name] = emb_name

    def _scaled_logits_head(self, name, head, tied_embedding):
        """Dory's LM head: its logits scaled per vocabulary entry (`ScaledLogitsHead`), the scale
        split with the vocabulary and exported under its own name."""
        plain = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
        plain.weight, plain.bias = head.weight, head.bias
        new = ScaledLogitsHead.from_linear(plain, group=self.group, factor=head.logit_scale_factor)
        new = on_device(new, head.weight.device)
        new.logit_scale = nn.Parameter(own_slice(head.logit_scale.detach(), 0, self.group).clone(),
                                       requires_grad=head.logit_scale.requires_grad)  # fmt: skip
        new._keep_placements()
        self.swap(name, new)
        self.record(name, new, dim=0)
        if tied_embedding is not None:
            new.weight = tied_embedding.weight
            self.tied[name] = next(n for n, m in self.model.named_modules() if m is tied_embedding)
        self._vocabulary_vector(f"{name}.logit_scale", new, "logit_scale", new.out_features)

    def _bias_held_twice(self, name, head, parent, key):
        """The parent of the LM head `name` holds the head's bias as `key` too: it holds the split
        bias, the same Parameter, exported (and loaded) under its own name as well."""
        parent_name = name.rpartition(".")[0]
        setattr(parent, key, head.bias)
        self._vocabulary_vector(f"{parent_name}.{key}" if parent_name else key, head, "bias", head.out_features)

    def _vocabulary_vector(self, record_name, owner, key, total):
        """The export record, under `record_name`, of `owner.<key>`: a vector split with the
        vocabulary as the LM head's rows are (read at each call: a load may replace it)."""

        def export(pick, group):
            value = pick(getattr(owner, key))
            return {"": gather(value, 0, group)} if value is not None else {}

        def load(full):
            copy_in(getattr(owner, key), own_slice(full[""], 0, self.group))

        def layout():
            return [pieces.split("", getattr(owner, key), 0, self.group, total=total)]

        self.exports.append(ExportRecord(record_name, export, load, layout))

    def apply_plan(self, name, module, kind):
        if kind == "colwise":
            self.column(name, module)
        elif kind == "rowwise":
            self.row(name, module)
        elif kind == "vocab":
            self.vocab_parallel(name, module)
        else:
            self.done.add(name)
            self.whole.add(name)

    def plain_linears(self, equivalents):
        """nn.Linear subclasses named in `equivalents` (qualified class names whose forward is
        nn.Linear's math) become plain nn.Linear holding the same Parameters."""
        for name, module in list(self.model.named_modules()):
            cls = type(module)
            if isinstance(module, nn.Linear) and f"{cls.__module__}.{cls.__qualname__}" in equivalents:
                plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
                plain.weight, plain.bias = module.weight, module.bias
                parent, _, child = name.rpartition(".")
                setattr(self.model.get_submodule(parent) if parent else self.model, child, plain)

    def unwrap_linears(self, wrappers):
        """Modules whose forward is their `linear` child's (`wrappers`: predicates; Moshi's MoshiLinear)
        give way to that child while the adapters run, so they see the plain linear a projection is;
        `rewrap_linears` puts each back around what took the child's place."""
        for name, module in list(self.model.named_modules()):
            if any(is_wrapper(module) for is_wrapper in wrappers):
                self.wrapped[name] = module
                parent, _, child = name.rpartition(".")
                setattr(self.model.get_submodule(parent), child, module.linear)

    def rewrap_linears(self):
        """The wrappers back in their places, each around what replaced its child; every name the pass
        recorded under a wrapper's (export records, swapped-out parameters) moved to the child's."""

        def moved(name):
            return next((f"{w}.linear{name[len(w) :]}" for w in self.wrapped if _under(name, {w})), name)

        for name, wrapper in self.wrapped.items():
            parent, _, child = name.rpartition(".")
            wrapper.linear = self.model.get_submodule(name)
            setattr(self.model.get_submodule(parent), child, wrapper)
        self.exports[:] = [record._replace(prefix=moved(record.prefix)) for record in self.exports]
        self.swapped_out = {k: (moved(name), ref) for k, (name, ref) in self.swapped_out.items()}

    def tower_linears(self):
        """A linear layer of a tower (tplayers.hf.vision) that no adapter or plan placed (a projector's
        single projection, a patch merger's): column-parallel with its output all-gathered, which is
        nn.Linear's math whatever surrounds it, as a tower's activations are whole on every rank."""
        for name, module in list(self.model.named_modules()):
            if _under(name, self.towers) and not _under(name, self.done) and type(module) is nn.Linear:
                self.column(name, module, sequence_parallel=False, gather_output=True)

    def learned_rotaries(self):
        """A rotary embedding with weights (Mistral Large 4's learned frequency scales) is computed whole
        on every rank, and its cos / sin reach the loss only through the attention heads, which the
        ranks split: each rank holds part of its gradient, summed over the group."""
        for module in self.model.modules():
            if type(module).__name__.endswith("RotaryEmbedding"):  # frozen ones too: they may be trained later
                self.partial_grads.extend(module.parameters())

    def run(self, adapters, embedding_adapters, linear_equivalents=(), linear_wrappers=()):
        """Embeddings, then every module top-down: the plan first, else the first adapter that
        matches it; finally an error naming every linear layer left unplaced."""
        self.embedding_adapters = embedding_adapters
        self.plain_linears(linear_equivalents)
        self.unwrap_linears(linear_wrappers)
        try:
            self.embeddings()
            for name, module in list(self.model.named_modules()):
                if not name or _under(name, self.done):
                    continue
                self.sp = self.sequence_parallel and not _under(name, self.towers)
                kind = self.planned(name)
                if kind is not None:
                    self.apply_plan(name, module, kind)
                    continue
                for adapter in adapters:  # the first that matches; one that passes on lets the next see it too
                    if adapter.matches(module):
                        adapter.apply(self, name, module)
                        if not adapter.passes_on:
                            break
        finally:  # a refusal leaves the model's wrappers where they were
            self.rewrap_linears()
        self.sp = self.sequence_parallel
        self.tower_linears()
        self.learned_rotaries()
        self.check_plan_used()
        self.check_no_tie_broken()
        unplaced = [
            name
            for name, module in self.model.named_modules()
            if ((isinstance(module, nn.Linear) and not isinstance(module, ColumnParallelLinear | RowParallelLinear))
                or is_conv1d(module))
            and not _under(name, self.done)
        ]  # fmt: skip
        if unplaced:
            raise ValueError(
                f"parallelize: could not place {unplaced}; pass plan={{name: one of {PLAN_KINDS}}} for them"
                + hf_plan_hint(self.model, unplaced)
            )
