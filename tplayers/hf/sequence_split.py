"""Sequence parallelism's split of an HF model's residual stream (`parallelize(sequence_parallel=True)`).

The residual stream is sharded along the sequence between the first block's entry and the last
block's exit: the model's masks and positions are built from the whole sequence before, its final
norm and LM head see the whole sequence after. Rank r holds `even_sizes(S, n)[r]` of the S tokens
(9 over 4: 3, 2, 2, 2), so any length splits; only one shorter than the group, which would leave a
rank no token, is refused.

Every block opens the split it runs in (tplayers.functional.sequence) at its entry and closes it at
its exit, also when it raises, so the sequence collectives inside it know every rank's part. The
first block learns the length from the whole sequence it is given, the others from the first (a
pipeline stage past the first opens the split around its blocks). Backward opens each block's
split again from its output's gradient to its input's, so a block recomputed there (activation
checkpointing: HF checkpoints a block's forward inside its hooks) runs its collectives in the split
it ran in, whatever micro-batches of other lengths ran since (pipeline schedules).
"""

import inspect

import torch
import torch.distributed as dist

from tplayers.functional.collectives import gather_from_tp_region, scatter_to_tp_region
from tplayers.functional.rng import enter_sequence_region, leave_sequence_region
from tplayers.functional.sequence import close_split, forget_reopened, open_length, open_split
from tplayers.hf.mlp import STACKED_STREAMS
from tplayers.hf.shard import replace_hidden
from tplayers.hf.summed_grads import summed_grads
from tplayers.placement import even_sizes, placement_or_none


def split_sequence(model, group, blocks):
    """Shard the residual stream of `blocks` (the model's nn.ModuleList of blocks) along the sequence
    over `group`. Replicated weights inside the blocks (norms) see only this rank's part of the
    sequence: their gradients are summed over the group, so every rank holds the whole gradient.
    """
    n, dim = dist.get_world_size(group), STACKED_STREAMS.get(type(blocks[0]).__name__, 1)
    split_blocks(blocks, group, dim)
    summed_grads([p for block in blocks for p in block.parameters() if placement_or_none(p) is None], group)
    blocks_name = next(name for name, m in model.named_modules() if m is blocks)
    base = model.get_submodule(blocks_name.rpartition(".")[0])
    base.register_forward_hook(_whole_sequence_outputs(group, n, dim), with_kwargs=True)
    ends = sorted({0, len(blocks) - 1} & set(getattr(base, "cross_attention_layers", ())))
    if ends:  # Mllama's loop skips its cross-attention layers without images: the split would not open or close
        base.register_forward_pre_hook(_images_for_the_ends(f"{blocks_name}.{ends[0]}"), with_kwargs=True)


def _check_length(hidden, n, dim):
    """A residual stream of (batch, sequence, ...): (batch, sequence, hidden), or with hyper-connections
    (batch, sequence, streams, hidden); Gemma 3n's AltUp: (streams, batch, sequence, hidden), dim 2."""
    if hidden.dim() < dim + 2 or hidden.shape[dim] < n:
        raise ValueError(
            f"parallelize(sequence_parallel=True): the residual stream {tuple(hidden.shape)} has no sequence "
            f"(dimension {dim}) of at least {n} tokens, one for each rank of the tensor-parallel group: "
            "parallelize without sequence_parallel for such short inputs (generate() too: its steps add one "
            "token at a time)"
        )
    return hidden.shape[dim]


def split_blocks(blocks, group, dim=1, features=None):
    """The hooks opening and closing each block's split over `group` along `dim`: the first block
    keeps this rank's part of the sequence (backward all-gathers the parts: the embeddings are
    replicated), the last gathers the whole sequence on every rank (backward keeps this rank's part
    of the replicated gradient). `features`: (split, gather) of the features too, after the sequence's
    split and before its gather (a grid's tp_c: tplayers.hf.grid)."""
    latest = {}  # the length the first block last split: the other blocks' in the same forward
    for index, block in enumerate(blocks):
        _block_hooks(block, index, len(blocks), latest, group, dim, features or (_same, _same))


def _same(hidden):
    return hidden


def _block_hooks(block, index, count, latest, group, dim, features):
    n, rank, running = dist.get_world_size(group), dist.get_rank(group), []

    def enter(hidden):
        if index == 0:
            if torch._C._current_graph_task_id() == -1:  # a forward, not a recompute inside backward
                forget_reopened()
            length = latest["length"] = _check_length(hidden, n, dim)
            hidden = features[0](scatter_to_tp_region(hidden, group, dim=dim, sizes=even_sizes(length, n)))
        else:  # the first block's length, or a pipeline stage's (it opens the split around its blocks)
            length = open_length(n) or latest.get("length")
            mine = even_sizes(length, n)[rank] if length is not None else None
            if mine != hidden.shape[dim]:
                raise ValueError(
                    f"sequence parallelism: block {index} holds {hidden.shape[dim]} tokens (dimension {dim} of "
                    f"{tuple(hidden.shape)}), not this rank's part of the sequence of {length} ({mine}): was the "
                    "model's first block skipped?"
                )
        open_split(length, n)
        # each rank's part draws its own masks, and gives the shared generator back alike (tplayers.functional.rng)
        enter_sequence_region(hidden.device, group)
        running.append(length)
        # even parts are every sequence collective's default: a recompute needs the split reopened only otherwise
        return _SplitInBackward.apply(hidden, length, n, False) if hidden.requires_grad and length % n else hidden

    def out_of_block(module, args, out):
        def whole(hidden):
            if hidden.requires_grad and running[-1] % n:
                hidden = _SplitInBackward.apply(hidden, running[-1], n, True)
            if index == count - 1:
                hidden = gather_from_tp_region(features[1](hidden), group, dim=dim, sizes=even_sizes(running[-1], n))
            return hidden

        if isinstance(out, tuple):
            return (whole(out[0]), *out[1:])
        return [whole(out[0]), *out[1:]] if isinstance(out, list) else whole(out)  # OpenAI GPT's blocks: a list

    def leave(module, args, out):
        if running:
            running.pop()
            close_split()
            leave_sequence_region()

    block.register_forward_pre_hook(replace_hidden(enter), with_kwargs=True)
    block.register_forward_pre_hook(_own_token_ids(block, group, n, running), with_kwargs=True)
    block.register_forward_hook(out_of_block)
    block.register_forward_hook(leave, always_call=True)


class _SplitInBackward(torch.autograd.Function):
    """Identity whose backward opens (on a block's output: before the block's backward runs) or
    closes (on its input: the block's backward done) the split the block ran in: HF checkpoints a
    block's forward inside its hooks, so a recompute runs the block's sequence collectives without
    them, in the split opened here."""

    @staticmethod
    def forward(ctx, hidden, length, n, opens):
        ctx.split, ctx.opens = (length, n), opens
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        if ctx.opens:
            open_split(*ctx.split, reopened=True)
        else:
            close_split(ctx.split)
        return grad, None, None, None


def _images_for_the_ends(block):
    """A forward pre-hook refusing a text-only batch where the first or last block is a cross-attention
    layer (Mllama's), which the model skips without images: sequence parallelism opens the split at
    the first block and closes it after the last."""

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        cached = cache is not None and cache.get_seq_length() > 0
        if kwargs.get("cross_attention_states") is None and not cached:
            raise ValueError(
                f"parallelize(sequence_parallel=True): {block} is a cross-attention layer, which "
                f"{type(module).__name__} skips in a batch without images, and sequence parallelism splits the "
                "sequence at the first block and gathers it after the last; give this model images, or parallelize "
                "it without sequence_parallel for text-only batches"
            )

    return hook


# Per-token inputs a block reads beside its hidden states, over the whole sequence as the model passes them,
# (dims, the dim of their tokens): DeepSeek-V4's token ids (its hash router), Mllama's row mask (a text row with no
# image before it zeroed after the cross-attention's MLP; its attention mask stays whole: the attention sees the
# whole sequence), Zamba's embeddings (concatenated to the hidden states before its shared transformer's norm),
# Gemma 4's per-layer input (multiplied token by token into the block's gated projection)
PER_TOKEN_INPUTS = {"input_ids": (2, 1), "full_text_row_masked_out_mask": (4, 2), "original_hidden_states": (3, 1),
                    "per_layer_input": (3, 1)}  # fmt: skip


def _own_token_ids(block, group, n, running):
    """A forward pre-hook on `block`: its per-token inputs (PER_TOKEN_INPUTS, by keyword or by their place
    in its forward's signature) cut to this rank's part of the sequence, the part its hidden states hold;
    a float one through scatter_to_tp_region, so its gradient is gathered back whole. `running`: the
    lengths of the block's open splits."""
    rank = dist.get_rank(group)
    places = {k: i for i, k in enumerate(inspect.signature(block.forward).parameters) if k in PER_TOKEN_INPUTS}

    def cut(t, key):
        dims, dim = PER_TOKEN_INPUTS[key]
        if not running or not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[dim] != running[-1]:
            return None
        sizes = even_sizes(running[-1], n)
        if t.is_floating_point():
            return scatter_to_tp_region(t, group, dim=dim, sizes=sizes)
        return t.narrow(dim, sum(sizes[:rank]), sizes[rank])

    def hook(module, args, kwargs):
        args, changed = list(args), False
        for key in PER_TOKEN_INPUTS:
            if key in kwargs and (mine := cut(kwargs[key], key)) is not None:
                kwargs[key], changed = mine, True
            elif places.get(key, len(args)) < len(args) and (mine := cut(args[places[key]], key)) is not None:
                args[places[key]], changed = mine, True
        return (tuple(args), kwargs) if changed else None

    return hook


def _whole_sequence_outputs(group, n, dim=1):
    """A forward hook on the model holding the blocks: under sequence parallelism the router
    logits each MoE block records (and the hidden states each block outputs) cover only this
    rank's part of the sequence. They leave the model whole, as unsharded (all-gathered along the
    sequence; backward keeps this rank's part), so the auxiliary load-balancing loss the causal-LM
    head computes from them (with its attention mask, shaped for the whole batch) is the
    unsharded model's on every rank; the router's gradient is summed over the group like a norm's.
    `dim`: the residual stream's sequence dimension (2 for Gemma 3n's stacked AltUp states)."""
    rank = dist.get_rank(group)

    def whole(t, batch, seq):
        if not isinstance(t, torch.Tensor) or seq < n:
            return t
        sizes = even_sizes(seq, n)
        mine = sizes[rank]
        if t.dim() == 2 and t.shape[0] == batch * mine:  # (tokens, experts): (batch, this rank's part) flattened
            return gather_from_tp_region(t.view(batch, mine, -1), group, dim=1, sizes=sizes).reshape(batch * seq, -1)
        if t.dim() >= 3 and t.shape[0] == batch and t.shape[1] == mine:  # (batch, this rank's part, ...)
            return gather_from_tp_region(t, group, dim=1, sizes=sizes)
        if dim == 2 and t.dim() == 4 and t.shape[1] == batch and t.shape[2] == mine:  # (streams, batch, part, H)
            return gather_from_tp_region(t, group, dim=2, sizes=sizes)
        return t

    def hook(module, args, kwargs, out):
        inputs = kwargs.get("input_ids", args[0] if args else None)
        inputs = kwargs.get("inputs_embeds") if inputs is None else inputs
        if inputs is None or not hasattr(out, "keys"):
            return out
        batch, seq = inputs.shape[0], inputs.shape[1]
        for key in ("router_logits", "hidden_states"):
            values = out.get(key)
            if isinstance(values, tuple | list):
                out[key] = tuple(whole(v, batch, seq) for v in values)
        return out

    return hook
