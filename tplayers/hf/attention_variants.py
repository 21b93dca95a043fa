"""q/k/v/o attentions with more than projections, split by heads like any (`qkvo_attention`), with
what they add placed here; and multi-head attentions whose projections go by other names.

CTRL (`Wq` / `Wk` / `Wv` / `dense`, its forward given values, keys and queries as three inputs) and
XLM (`q_lin` / `k_lin` / `v_lin` / `out_lin`): q / k / v column-parallel by whole heads, the output
row-parallel; each input (one tensor passed three times, in CTRL's layers) has its gradient summed
over the group once (or is gathered along the sequence under sequence parallelism).

Dory (nGPT's unit-norm attention): queries scaled per channel after rope (`sqk`), the output gated
with a per-channel scale (`s_gate`): both cut to this rank's heads' channels; the L2 norm over every
head's output before `o_proj` a `ParallelL2Norm` (its sum of squares summed over the group).

T5's attention (T5, Flan-T5, mT5, UMT5, LongT5, Switch Transformers, UDOP; Pix2Struct's as `query` /
`key` / `value` / `output`): q / k / v column-parallel by whole heads, o row-parallel; its relative
position bias (an embedding of buckets x heads, in the layers that compute it) split by the same
heads, so the bias each rank's layers pass on holds its own heads; `n_heads` / `inner_dim` this
rank's (the zero bias of the layers without one is built from them).

Doge's attention has a dynamic mask computed from the values; the mask's projection is summed over
the ranks' value heads. Doge adds to each key/value head's attention scores exp(A_h * softplus(dt_h)), where
dt = dt_proj(the values of every key/value head): each head's mask reads all heads' values.

    q_proj, k_proj, v_proj, o_proj, q_norm, k_norm   as any q/k/v/o attention (`qkvo_attention`):
                     by heads, evenly or not; key/value heads shared by ranks where fewer than them
    dt_proj          `SummedRowLinear` over the value heads: each key/value head's columns on the
                     first rank holding that head, which reads those channels of its values; the
                     partial products summed forward and backward, so every rank has dt for every
                     head (one all-reduce of (tokens x key/value heads) a layer), its bias added once
                     after the sum, its gradient summed
    A                whole on every rank (one number per key/value head), its gradient summed
    the mask         each rank takes the rows of its own value heads (`prepare_dynamic_mask`, HF's
                     own, given this rank's rows of dt), repeated over its query heads as HF repeats
"""

import types

import torch.distributed as dist
from torch import nn

from tplayers.functional.collectives import all_gather_sequence, copy_to_tp_region
from tplayers.hf.attention import head_split, localize_attributes, qkvo_attention, split_per_head
from tplayers.hf.fused import SharedKVProjection, SummedRowLinear
from tplayers.hf.shard import ShardingPass, has_linears, on_device
from tplayers.hf.source import same_forward, source
from tplayers.placement import even_sizes

# Dory's attention: per-channel scales of every head's query / output gate, {name: per head}
CHANNEL_SCALES = ("sqk", "s_gate")


def is_unit_norm_attention(module) -> bool:
    """Dory's attention, with transformers' forward line for line."""
    if type(module).__name__ != "DoryAttention":
        return False
    from transformers.models.dory.modeling_dory import DoryAttention

    return same_forward(module, DoryAttention)


def unit_norm_attention(sp: ShardingPass, name, attn):
    qkvo_attention(sp, name, attn)  # its attn_sub_norm over every head: a ParallelL2Norm there
    sizes = even_sizes(attn.sqk.shape[0] // attn.head_dim, sp.n)  # the query heads' split (`head_split`)
    for key in CHANNEL_SCALES:
        split_per_head(sp, name, attn, key, attn.head_dim, sizes)


def is_dynamic_mask_attention(module) -> bool:
    """Doge's attention, with transformers' forward and mask line for line."""
    if type(module).__name__ != "DogeAttention":
        return False
    from transformers.models.doge.modeling_doge import DogeAttention

    mask = type(module).prepare_dynamic_mask
    return same_forward(module, DogeAttention) and source(mask) == source(DogeAttention.prepare_dynamic_mask)


def _value_heads(attn, kv_heads, head_dim, n) -> list[list[int]]:
    """For every rank, the key/value head of each value head it computes, in its order."""
    v_proj = attn.v_proj
    if isinstance(v_proj, SharedKVProjection):
        return [(rows[::head_dim] // head_dim).tolist() for rows in v_proj.rows_of_ranks]
    per_rank = kv_heads // n  # an even split by whole key/value heads
    return [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(n)]


def dynamic_mask_attention(sp: ShardingPass, name, attn):
    dt_proj, a = attn.dt_proj, attn.A
    kv_heads = a.shape[0]
    head_dim = dt_proj.in_features // kv_heads
    # the q/k/v/o pass would refuse dt_proj (a weight over every head) and cut A by heads (where
    # there are as many key/value heads as query heads): both are placed here
    modules, params = dict(attn._modules), dict(attn._parameters)
    del attn._modules["dt_proj"], attn._parameters["A"]
    try:
        qkvo_attention(sp, name, attn)
    finally:  # back in their places (the state dict's order)
        attn._modules = {k: attn._modules.get(k, m) for k, m in modules.items()}
        attn._parameters = {k: attn._parameters.get(k, p) for k, p in params.items()}
    heads = _value_heads(attn, kv_heads, head_dim, sp.n)
    rank = dist.get_rank(sp.group)
    owner = {}
    for r, held in enumerate(heads):  # each key/value head counted by the first rank holding it
        for h in held:
            owner.setdefault(h, r)
    owned = [sorted(h for h, r in owner.items() if r == rank_) for rank_ in range(sp.n)]
    if sum(owned, []) != list(range(kv_heads)):  # the ranks' columns must be dt_proj's in order
        raise ValueError(f"parallelize: {name}: the key/value heads do not follow the ranks in order: {heads}")
    mine = owned[rank]
    reads = [(p * head_dim, (p + 1) * head_dim) for p in (heads[rank].index(h) for h in mine)]
    layer = SummedRowLinear(dt_proj, group=sp.group, split_sizes=[len(o) * head_dim for o in owned], reads=reads)
    layer = on_device(layer, dt_proj.weight.device)
    sp.swap(f"{name}.dt_proj", layer)
    sp.record(f"{name}.dt_proj", layer, dim=1)
    sp.partial_grads.extend([a] + ([layer.bias] if layer.bias is not None else []))
    local = heads[rank]  # read through a slice where contiguous: an index list copies to the device each step
    contiguous = local == list(range(local[0], local[0] + len(local)))
    attn.value_heads = slice(local[0], local[0] + len(local)) if contiguous else tuple(local)
    attn.prepare_dynamic_mask = types.MethodType(_local_dynamic_mask, attn)  # a deep copy rebinds it


def _local_dynamic_mask(self, hidden_states, dt_states, keep_window_size=2048, attention_mask=None):
    """HF's mask for this rank's value heads: dt_states (batch, key/value heads, keys) whole, its rows
    taken in this rank's order."""
    rows = self.value_heads if isinstance(self.value_heads, slice) else list(self.value_heads)
    return type(self).prepare_dynamic_mask(
        self,
        hidden_states=hidden_states,
        dt_states=dt_states[:, rows],
        keep_window_size=keep_window_size,
        attention_mask=attention_mask,
    )


# {class: ((q, k, v), output, head count attribute, the positional inputs the projections read)}
RENAMED = {
    "transformers.models.ctrl.modeling_ctrl.MultiHeadAttention": (("Wq", "Wk", "Wv"), "dense", "num_heads", 3),
    "transformers.models.xlm.modeling_xlm.MultiHeadAttention": (("q_lin", "k_lin", "v_lin"), "out_lin", "n_heads", 1),
}


def _class_path(module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def is_renamed_attention(module) -> bool:
    """CTRL's or XLM's multi-head attention, with transformers' forward line for line."""
    path = _class_path(module)
    if path not in RENAMED:
        return False
    import importlib

    owner, _, cls = path.rpartition(".")
    return same_forward(module, getattr(importlib.import_module(owner), cls))


def renamed_attention(sp: ShardingPass, name, attn):
    qkv, out, count, inputs = RENAMED[_class_path(attn)]
    heads, head_dim = getattr(attn, count), attn.head_dim
    split = head_split(name, heads, sp.n)
    for proj in qkv:
        sp.shared_input_column(f"{name}.{proj}", getattr(attn, proj), split_unit=head_dim, split_sizes=split)
    sp.row(f"{name}.{out}", getattr(attn, out), split_unit=head_dim, split_sizes=split)
    localize_attributes(name, attn, {count: split[dist.get_rank(sp.group)]})
    _shared_inputs(sp, attn, inputs)
    sp.done.add(name)


def _shared_inputs(sp: ShardingPass, attn, inputs: int):
    """Before the attention: its first `inputs` positional inputs prepared as a shared input is (see
    parallelize's `_shared_input_hooks`), one tensor passed several times prepared once; XLM's
    cross-attention input (`kv`) refused, by name."""
    if sp.n == 1:
        return
    group = sp.group
    prepare = (lambda h: all_gather_sequence(h, group, 1)) if sp.sp else (lambda h: copy_to_tp_region(h, group))

    def hook(module, args, kwargs):
        if kwargs.get("kv") is not None:
            raise ValueError(f"parallelize: {type(module).__name__}'s cross-attention input (kv) is not split")
        done = {}
        for a in args[:inputs]:
            if id(a) not in done:
                done[id(a)] = prepare(a)
        return tuple(done[id(a)] for a in args[:inputs]) + tuple(args[inputs:]), kwargs

    attn.register_forward_pre_hook(hook, with_kwargs=True)


T5_PROJECTIONS = (("q", "k", "v", "o"), ("query", "key", "value", "output"))


def _t5_projections(module):
    return next((names for names in T5_PROJECTIONS if has_linears(module, names)), None)


def is_t5_attention(module) -> bool:
    """T5's attention: its projections (`T5_PROJECTIONS`), `n_heads` heads of `key_value_proj_dim`,
    a relative position bias of one column per head where it has one, nothing else with weights."""
    names, bias = _t5_projections(module), getattr(module, "relative_attention_bias", None)
    heads, width = getattr(module, "n_heads", None), getattr(module, "key_value_proj_dim", None)
    if names is None or type(heads) is not int or type(width) is not int or module.inner_dim != heads * width:
        return False
    others = [c for c, m in module.named_children() if c not in (*names, "relative_attention_bias")]
    return not any(next(module.get_submodule(c).parameters(), None) is not None for c in others) and (
        bias is None or isinstance(bias, nn.Embedding) and bias.embedding_dim == heads
    )


def t5_attention(sp: ShardingPass, name, attn):
    *qkv, out = _t5_projections(attn)
    heads, head_dim = attn.n_heads, attn.key_value_proj_dim
    split = head_split(name, heads, sp.n)
    for proj in qkv:
        sp.shared_input_column(f"{name}.{proj}", getattr(attn, proj), split_unit=head_dim, split_sizes=split)
    sp.row(f"{name}.{out}", getattr(attn, out), split_unit=head_dim, split_sizes=split)
    local = split[dist.get_rank(sp.group)]
    localize_attributes(name, attn, {"n_heads": local, "inner_dim": local * head_dim})
    if getattr(attn, "relative_attention_bias", None) is not None:  # (buckets, heads): by its columns
        split_per_head(
            sp, f"{name}.relative_attention_bias", attn.relative_attention_bias, "weight", sizes=split, dim=1
        )
    sp.shared_input.append(attn)
    sp.done.add(name)
