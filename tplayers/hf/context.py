"""Context parallelism for HF models: `parallelize(model, context_group=..., context=...)`.

Every rank of the context-parallel (CP) group is given the same whole batch. A pre-hook on the
model keeps this rank's tokens (`tplayers.functional.context_layout`: head-tail per document,
padded to one length) before anything runs: the embeddings, every block, the final norm and the LM
head then see only L ~ S / cp tokens, the activations shrink by cp. position_ids go in whole-row
values (HF's rotary embeddings read them as they are); the attention mask and the packed
documents HF reads from position_ids (without a mask, with use_cache=False, as HF's masks do)
become per-token metadata. Attention runs through
HF's attention interface (`tplayers_context`, registered here), so each model's own scaling,
sliding window and softcap arrive as it passes them; it attends over every rank's keys
(`tplayers.functional.context`). HF builds no mask for it.

Labels are shifted over the whole row before the split (no label crosses a rank), the loss is the
sum over this rank's tokens divided by the whole batch's count of valid labels (or the
`num_items_in_batch` given), summed over the group: the unsharded model's loss on every rank.
Logits come back whole, in the row's order (all-gathered; backward keeps this rank's part), or
with `context_logits="split"` as this rank's only, in the order `local_tokens(model)` gives.

Weights are replicated over the group, each rank's gradient covering its own tokens: summed over
the group by a hook on each parameter, or, once `tplayers.data_parallel` wraps the model, reduced
with the data-parallel ones over dp x cp in its buckets (a mean: the loss's and logits' gradients
are then scaled by cp, as Megatron scales its loss).
"""

import inspect
import re
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tplayers.functional import comm
from tplayers.functional.context import METHODS, AttentionOptions, context_attention, ulysses_fits
from tplayers.functional.context_layout import balanced_layout
from tplayers.functional.cost_model import default_costs
from tplayers.hf.source import forward_source
from tplayers.nn.lm_head import ParallelLMHead, is_deferred
from tplayers.state import set_state, state_of

ATTENTION = "tplayers_context"
CHOICES = ("auto", *METHODS)
# what the layers of other kinds would need to see across ranks (a recurrence, a convolution)
_SEQUENTIAL = ("Mamba", "DeltaNet", "LinearAttention", "ShortConv", "Lightning", "Mixer", "Recurrent", "Rwkv")


@dataclass
class ContextState:
    """What one context-parallel model shares with its attention calls and hooks."""

    group: dist.ProcessGroup
    method: str
    multiple: int = 1  # the local length is a multiple of this (the TP size under sequence parallelism)
    layout: object = None  # this forward's ContextLayout
    seq_len: int = 0
    labels: tuple | None = None  # (this rank's shifted labels, the denominator)
    reduced_by_data_parallel: bool = False  # data_parallel averages over dp x cp: scale by cp instead
    replica_group: object = None  # data_parallel's own group (dp, without cp): ranks with other batches
    split_logits: bool = False  # logits stay this rank's (context_logits="split")
    packed: bool | None = True  # the model's masks read packed documents from position_ids (None: unknown)
    tokens: object = None  # the last forward's (B, L) indices of this rank's tokens in the row (-1: padding)
    hooked: "weakref.WeakValueDictionary" = field(default_factory=weakref.WeakValueDictionary)
    plain_layouts: dict = field(default_factory=dict)  # (B, S, device) -> layout (pipeline stages)

    def __deepcopy__(self, memo):
        """A deep copy of the model shares it (its hooks, copied by reference, already do): the
        process group cannot be copied, and the copy's parameters get their own CP hooks."""
        return self

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def factor(self) -> float:
        return float(self.size) if self.reduced_by_data_parallel else 1.0


def context_state(model) -> ContextState | None:
    return state_of(model).context


# -- autograd pieces ------------------------------------------------------------------------------


class _SumOverContext(torch.autograd.Function):
    """Forward: the sum over the group (the loss of every rank's tokens). Backward: the gradient
    as it is (each rank's part of the loss is its own), times `factor`."""

    @staticmethod
    def forward(ctx, x, group, factor):
        y = x.clone()
        comm.all_reduce(y, group, axis="cp")
        ctx.factor = factor
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None, None


class _WholeSequence(torch.autograd.Function):
    """This rank's (B, L, ...) slots -> the whole rows (B, S, ...) in their own order: every rank's
    slots all-gathered, then put back in place through `inv` (B, S). Backward: this rank's slots of
    the gradient (every rank holds the same whole one), times `factor`. Saves only `inv` (torch's
    gather would keep the whole gathered tensor for its backward)."""

    @staticmethod
    def forward(ctx, x, group, factor, inv):
        n = dist.get_world_size(group)
        out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
        comm.all_gather_into(out, x.contiguous(), group, axis="cp")
        flat = out.transpose(0, 1).reshape(x.shape[0], n * x.shape[1], *x.shape[2:])
        index = inv.view(*inv.shape, *[1] * (x.dim() - 2)).expand(*inv.shape, *x.shape[2:])
        ctx.save_for_backward(index)
        ctx.group, ctx.factor, ctx.local = group, factor, x.shape[1]
        return flat.gather(1, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        r, n = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        slots = grad.new_zeros((grad.shape[0], n * ctx.local, *grad.shape[2:])).scatter_(1, index, grad)
        return slots[:, r * ctx.local : (r + 1) * ctx.local] * ctx.factor, None, None, None


def whole_sequence(x, state: ContextState):
    """This rank's (B, L, ...) slots -> the whole rows (B, S, ...) in their own order."""
    return _WholeSequence.apply(x, state.group, state.factor, state.layout.inverse(state.seq_len))


# -- attention ------------------------------------------------------------------------------------


def choose_method(state: ContextState, q, k) -> str:
    """`auto`: the cheapest way by the cost model (tplayers.functional.cost_model): the ring hides
    its cp - 1 hops behind the blocks' attention, the all-gather pays one collective for the same
    bytes, Ulysses (where heads divide) moves q, k, v and o once each at (cp - 1) / cp."""
    if state.method != "auto":
        return state.method
    n = state.size
    B, H, L, D = q.shape
    KH, size = k.shape[1], q.element_size()
    costs = default_costs(dist.get_backend(state.group), "cuda" if q.is_cuda else "cpu",
                          torch.cuda.get_device_capability(q.device) if q.is_cuda else None)  # fmt: skip
    block_s = costs.gemm_s(B * H * L, D, 2 * L, {2: "bfloat16", 4: "float32"}.get(size, "float32"))  # qk^T and pv
    kv = 2 * B * KH * L * D * size
    priced = {
        "ring": (n - 1) * max(block_s, costs.send_s(kv)) + block_s,
        "allgather": costs.collective_s("all_gather", (n - 1) * kv) + n * block_s,
    }
    if ulysses_fits(H, KH, n):
        moved = (2 * B * H * L * D + kv) * size * (n - 1) // n
        priced["ulysses"] = 2 * costs.send_s(moved) + n * block_s
    return min(priced, key=priced.get)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, **kwargs):  # fmt: skip
    """HF's attention interface under context parallelism: query (B, H, L, D), key / value
    (B, KH, L, D) of this rank's tokens; returns (B, L, H, D) and no weights."""
    state = state_of(module).context
    if state is None or state.layout is None:
        raise RuntimeError(
            f"{type(module).__name__}: attention '{ATTENTION}' runs only inside the forward of a model parallelized "
            "with context_group (tplayers.parallelize)"
        )
    if dropout:
        raise ValueError(f"context parallelism: attention dropout ({dropout}) is not supported; set it to 0")
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"context parallelism: {type(module).__name__} passes position_bias, which it does not take")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    opts = AttentionOptions(scale=scaling if scaling is not None else query.shape[-1] ** -0.5, causal=bool(causal),
                            window=sliding_window, softcap=softcap)  # fmt: skip
    out = context_attention(
        query, key, value, state.layout, state.group, opts, choose_method(state, query, key), sinks=kwargs.get("s_aux")
    )  # attention sinks (gpt-oss): per head, in every softmax
    return out.transpose(1, 2).contiguous(), None


def _register():
    """HF's attention interface learns `tplayers_context` (transformers imported here, not with tplayers:
    it imports triton, which must come after TRITON_INTERPRET is set)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention_forward)


# -- the model's hooks ----------------------------------------------------------------------------


def shifted_labels(labels):
    """HF's causal-LM shift over the whole row: position t is scored on token t + 1."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def _split_inputs(state: ContextState, signature):
    def hook(module, args, kwargs):
        kwargs = dict(signature.bind_partial(*args, **kwargs).arguments)
        kwargs.update(kwargs.pop("kwargs", None) or {})
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            raise ValueError("context parallelism: a KV cache is not supported (generate with a model parallelized "
                             "without context_group)")  # fmt: skip
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        x = ids if ids is not None else embeds
        if x is None:
            raise ValueError("context parallelism: the model needs input_ids or inputs_embeds")
        B, S = x.shape[:2]
        position_ids, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
        use_cache = kwargs.get("use_cache")
        use_cache = getattr(module.config, "use_cache", False) if use_cache is None else use_cache
        # HF reads packed documents from position_ids only without a mask and without a cache (which
        # `use_cache` makes even in training): the same rule here
        packed = position_ids if mask is None and not use_cache else None
        if packed is not None and not state.packed:  # a model whose masks do not read them attends across
            if state.packed is None and bool((torch.diff(packed, dim=-1) != 1).any()):
                raise ValueError(
                    f"context parallelism: position_ids that restart (packed documents), but whether "
                    f"{type(module).__name__}'s masks read them is not known; pass an attention_mask or "
                    "position_ids that do not restart"
                )
            packed = None
        layout = balanced_layout(B, S, state.size, dist.get_rank(state.group), position_ids=packed,
                                 attention_mask=mask, multiple=state.multiple, device=x.device)  # fmt: skip
        if position_ids is None:
            position_ids = torch.arange(S, device=x.device).expand(B, S)
        split = {"input_ids", "inputs_embeds", "position_ids", "attention_mask", "labels"}
        unsplit = [k for k, t in kwargs.items() if k not in split and isinstance(t, torch.Tensor) and t.dim() >= 2
                   and tuple(t.shape[:2]) == (B, S)]  # fmt: skip
        if unsplit:  # per-token inputs this hook does not know how to split: not passed on whole, silently
            shape = tuple(kwargs[unsplit[0]].shape)
            raise ValueError(f"context parallelism: {unsplit[0]} {shape} is per token; only input_ids / "
                             "inputs_embeds, position_ids, attention_mask and labels are split")  # fmt: skip
        kwargs["input_ids" if ids is not None else "inputs_embeds"] = layout.take(x)
        kwargs.update(position_ids=layout.take(position_ids), attention_mask=None, use_cache=False)
        labels = kwargs.pop("labels", None)
        state.labels = None
        if labels is not None:
            shifted = shifted_labels(labels)
            denominator = kwargs.pop("num_items_in_batch", None)
            if denominator is None:
                denominator = (shifted != -100).sum()
            state.labels = (layout.take(shifted, fill=-100), denominator)
        state.layout, state.seq_len = layout, S
        return (), kwargs

    return hook


def _whole_outputs(state: ContextState):
    def hook(module, args, kwargs, out):
        logits = out["logits"]
        if state.labels is not None:
            labels, denominator = state.labels
            if is_deferred(logits):  # the loss without logits (tplayers.hf.fused_loss): this rank's tokens
                mine = ParallelLMHead.loss(logits, labels, divisor=denominator)
            else:
                local = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                        reduction="sum")  # fmt: skip
                mine = local / denominator
            out["loss"] = _SumOverContext.apply(mine, state.group, state.factor)
        state.tokens = state.layout.index[:, dist.get_rank(state.group)]
        if is_deferred(logits):
            out["logits"] = None
        elif not state.split_logits:
            out["logits"] = whole_sequence(logits, state)
        state.layout = state.labels = None
        return out

    return hook


def summed_over_context(state: ContextState):
    """Every parameter's gradient summed over the group as it is computed (each rank's covers its
    own tokens); skipped once data_parallel reduces over dp x cp. Run before each forward, so a
    tensor assigned in or a deep copy's gets its hook too."""

    def summed(grad):
        if state.reduced_by_data_parallel:
            return grad
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, state.group, axis="cp")
        return grad

    def hook(module, *_):
        if state.reduced_by_data_parallel:  # FSDP2 swaps its sharded / unsharded parameters in: leave them be
            return
        for p in module.parameters():
            if state.hooked.get(id(p)) is not p:
                trainable = p.requires_grad  # a frozen weight (an inactive adapter) may train later:
                p.requires_grad_(True)  # its hook goes on now, and stays through requires_grad_ toggles
                p.register_hook(summed)
                p.requires_grad_(trainable)
                state.hooked[id(p)] = p

    return hook


def reads_packed_documents(model) -> bool | None:
    """Whether the model's masks read packed documents from position_ids: HF's mask functions do when
    passed them, and most decoders pass them; some do not (gpt-oss in transformers 5.24), and attend
    across the documents. None where the decoder's source does not show its mask call."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    source = forward_source(decoder)
    found = re.search(r"mask_kwargs\s*=\s*\{(.*?)\}", source, re.S) or re.search(
        r"(?:create_\w*mask|mask_function)\((.*?)\)", source, re.S
    )
    return None if found is None else "position_ids" in found.group(1)


def _check_model(model):
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ValueError("parallelize(context_group=...): a HuggingFace model (with a config) is needed")
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"parallelize(context_group=...): layer types {sorted(kinds)}: context parallelism through "
            "linear-attention / state-space layers is not supported (their recurrence runs along the sequence)"
        )
    sequential = [n for n, m in model.named_modules() if any(s in type(m).__name__ for s in _SEQUENTIAL)]
    if sequential:
        kind = type(model.get_submodule(sequential[0])).__name__
        raise ValueError(f"parallelize(context_group=...): {sequential[0]} ({kind}) runs along the sequence; "
                         "context parallelism does not split it")  # fmt: skip
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            "parallelize(context_group=...): the router's auxiliary loss (output_router_logits) is not supported "
            "under context parallelism yet; set it False"
        )
    attention = [(n, m) for n, m in model.named_modules() if "attention_interface" in forward_source(m)
                 or "ALL_ATTENTION_FUNCTIONS" in forward_source(m)]  # fmt: skip
    through = {id(m) for _, m in attention}
    own = [n for n, m in model.named_modules() if type(m).__name__.endswith("Attention") and id(m) not in through]
    if own or not attention:
        raise ValueError(
            "parallelize(context_group=...): every attention must go through HF's attention interface; "
            f"{own[0] if own else type(model).__name__} computes its own"
        )
    return [m for _, m in attention]


def _check_ulysses(config, ways):
    """Ulysses splits every rank's heads over the group: the heads and key/value heads must divide
    by cp x tp (checked here for every rank at once, before any collective)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads or heads % ways or kv_heads % ways:
        raise ValueError(
            f"parallelize(context='ulysses'): the {heads} heads and {kv_heads} key/value heads must divide by "
            f"cp x tp = {ways}; use context='ring' or 'allgather' (any head count), or 'auto'"
        )


def local_tokens(model) -> torch.Tensor:
    """(B, L): where in the row each of this rank's tokens sits (-1: padding), for the model's last
    forward; what `context_logits="split"` logits are in the order of."""
    state = context_state(model)
    if state is None or state.tokens is None:
        raise ValueError("local_tokens: the model is not context-parallel, or has not run a forward yet")
    return state.tokens


def plain_layout(state: ContextState, batch: int, seq_len: int, device):
    """The layout of rows neither packed nor masked (what pipeline stages take), made once per shape:
    every stage and the loss of every micro-batch ask for the same one."""
    key = (batch, seq_len, str(device))
    if key not in state.plain_layouts:
        state.plain_layouts[key] = balanced_layout(batch, seq_len, state.size, dist.get_rank(state.group),
                                                   multiple=state.multiple, device=device)  # fmt: skip
    return state.plain_layouts[key]


def stage_positions(state: ContextState, batch: int, seq_len: int, device) -> torch.Tensor:
    """A pipeline stage's forward (`tplayers.pipeline_split`) on rows of `seq_len` tokens, neither
    packed nor masked (a stage takes token ids only): the layout set for its attention calls; returns
    this rank's tokens' positions in the row (B, L), what rotary embeddings read."""
    layout = plain_layout(state, batch, seq_len, device)
    state.layout, state.seq_len = layout, seq_len
    state.tokens = layout.index[:, layout.rank]
    return layout.take(torch.arange(seq_len, device=device).expand(batch, seq_len))


def rows_loss_of_rank(state: ContextState, labels, score):
    """HF's causal-LM loss of the whole rows `labels` (B, S) from this rank's tokens of them (a
    pipeline stage's, `plain_layout`): `score(local_labels, count)` is this rank's tokens' loss
    summed over `count` (the valid labels of the whole batch), and the group's are summed, as the
    model's own loss is."""
    shifted = shifted_labels(labels)
    B, S = labels.shape[:2]
    local = plain_layout(state, B, S, labels.device).take(shifted, fill=-100)
    return _SumOverContext.apply(score(local, (shifted != -100).sum()), state.group, state.factor)


LOGITS = ("whole", "split")


def apply_context(model, group, method="auto", logits="whole", *, multiple=1, tp=1):
    """Split `model`'s sequence over `group` (module docstring); in place. logits: "whole" (every
    rank gets the whole rows' logits) or "split" (this rank's tokens only, in the order
    `local_tokens(model)` gives: no all-gather of (B, S, V))."""
    if method not in CHOICES:
        raise ValueError(f"parallelize: context must be one of {CHOICES}, got {method!r}")
    if logits not in LOGITS:
        raise ValueError(f"parallelize: context_logits must be one of {LOGITS}, got {logits!r}")
    if state_of(model).context is not None:
        raise ValueError("parallelize: the model is already context-parallel")
    attention = _check_model(model)
    if method == "ulysses":
        _check_ulysses(model.config, dist.get_world_size(group) * tp)
    state = ContextState(group, method, multiple)  # split logits once parallelize's self-check is done
    state.packed = reads_packed_documents(model)
    for module in attention:
        set_state(module, context=state)
    _register()
    model.set_attn_implementation(ATTENTION)
    signature = inspect.signature(model.forward)
    model.register_forward_pre_hook(summed_over_context(state))
    model.register_forward_pre_hook(_split_inputs(state, signature), with_kwargs=True)
    model.register_forward_hook(_whole_outputs(state), with_kwargs=True)
    set_state(model, context=state)
    return model
