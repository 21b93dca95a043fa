"""`parallelize(model)`: shard a HuggingFace causal LM (or any model, given a plan) in place.

The model's own forward keeps running (so `generate()` and its KV cache keep working); only
its projections are swapped for tensor-parallel layers holding this rank's shard. Which
modules are recognised, and how each is sharded, is `tplayers.hf.families`; the walk over the
modules is `tplayers.hf.shard`; this file wires the pass into the model's forward:

    input embeddings -> VocabParallelEmbedding; output embeddings (LM head) -> column-parallel
        over the vocabulary, gathered to full logits (or left vocab-sharded for
        `vocab_parallel_cross_entropy`); tied embeddings stay tied: both hold one Parameter.

Anything else takes `plan={module name: "colwise" | "rowwise" | "vocab" | "replicate"}`; a
projection that neither is recognised nor in the plan is an error naming it.

With sequence_parallel=True the residual stream between the projections is sharded along the
sequence (any length: tplayers.hf.sequence_split): the hidden states are split along dim 1 as
they enter the first block, each column layer all-gathers its input inside its GEMM, each row
layer reduce-scatters its output, and the replicated weights applied to sequence shards (norms)
get their gradients summed over the group, so every `.grad` is complete.
"""

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate

from tplayers.data_parallel import guards
from tplayers.distributed import is_grid, resolve_group
from tplayers.functional.auto_overlap import check_overlap
from tplayers.functional.collectives import (
    all_gather_sequence,
    copy_to_tp_region,
)
from tplayers.functional.rng import leave_sharded_region
from tplayers.hf import families, lora, model_methods, peft_tuners, vision
from tplayers.hf import fused_loss as fused
from tplayers.hf import verify as verification
from tplayers.hf.attached import hooked_modules
from tplayers.hf.attention_weights import gather_attention_weights
from tplayers.hf.context import apply_context, context_state
from tplayers.hf.finish import finish
from tplayers.hf.frozen import split_where_mixed, trainable_flags
from tplayers.hf.grid import parallelize_grid
from tplayers.hf.norms import fuse_rms_norms
from tplayers.hf.rollback import restored_if_refused
from tplayers.hf.same_inputs import check_same_inputs
from tplayers.hf.sequence_split import split_sequence
from tplayers.hf.shard import ShardingPass, replace_hidden
from tplayers.hf.state_dict import Records
from tplayers.hf.summed_grads import rehook_summed, summed_grads
from tplayers.nn.linear import ColumnParallelLinear, RowParallelLinear, splits_checked_together
from tplayers.placement import placement_or_none, set_placement


def _shared_input_hooks(modules, group, sequence_parallel):
    """Before each module whose column projections share one input: copy_to_tp_region (forward
    identity, backward one all-reduce of the summed partial input gradients), or under sequence
    parallelism all_gather_sequence (forward one all-gather, backward one reduce-scatter); a
    cross-attention's other input, whole on every rank, copy_to_tp_region in either case. HF
    attention reshapes with its input's sequence length, so it must see the whole sequence; a
    flattened (tokens, H) input is gathered along its tokens, which the row layer after it
    reduce-scatters back in the same order."""
    if dist.get_world_size(group) == 1:  # both are the identity on a group of one: no hook to run each step
        return
    if sequence_parallel:  # a (tokens, H) input (an MoE block's shared expert): gathered along its tokens

        def prepare(h, group):
            return all_gather_sequence(h, group, 1 if h.dim() >= 3 else 0)

    else:
        prepare = copy_to_tp_region
    for module in modules:
        hook = replace_hidden(lambda h: prepare(h, group), cross=lambda h: copy_to_tp_region(h, group))
        module.register_forward_pre_hook(hook, with_kwargs=True)


def _refuse_convolutions_across_the_split(model, blocks, gathered):
    """Under sequence parallelism a block sees its rank's part of the sequence, except inside the
    modules whose input is gathered along it (`gathered`: attention, the mixers). A convolution left
    whole elsewhere in a block (Inkling's of its residual stream) would read the tokens before each
    token across the split, and at random init its small weights hide that from the self-check:
    refused by name, on every rank alike."""
    inside = {id(m) for owner in gathered for m in owner.modules()}
    names = {id(m): n for n, m in model.named_modules()}
    for block in blocks:
        for module in block.modules():
            if isinstance(module, nn.modules.conv._ConvNd) and id(module) not in inside:
                raise ValueError(
                    f"parallelize: {names[id(module)]} ({type(module).__name__}) convolves along the sequence, "
                    "where sequence parallelism gives each rank its part of it: each token would read the tokens "
                    "before it across the split. Use sequence_parallel=False for this model"
                )


def _inside_sharded_modules(model, done, whole, group):
    """Parameters left inside a module an adapter sharded (between its column and row layers, or
    held by an attention module itself), which no adapter placed. A scalar (xIELU's alpha_p /
    alpha_n: a parameter of an elementwise function) acts alike on every feature, so each rank's
    gradient is the part from its own features: summed over the group, it is the whole one.
    Anything larger acts on features that are split here, in a way tplayers was not told: refused
    by name (replicating it would leave each rank a different, partial gradient)."""
    for prefix in sorted(done - whole):
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            continue
        for name, p in module.named_parameters():
            if placement_or_none(p) is not None or any(f"{prefix}.{name}".startswith(f"{w}.") for w in whole):
                continue
            if p.numel() == 1:
                summed_grads([p], group)
                continue
            raise ValueError(
                f"parallelize: {prefix}.{name} {tuple(p.shape)} is a parameter of {type(module).__name__} that "
                "tplayers shards, and acts on features split across the ranks in a way tplayers does not know "
                "(only per-head values a q/k/v/o attention holds itself are cut to each rank's heads); it is not "
                "replicated, which would leave each rank part of its gradient. Pass plan={...: 'replicate'} for "
                f"{prefix!r} to keep that module whole"
            )


def _back_to_shared_generator(module, args, output):
    """A sharded region (tplayers.functional.rng) no reduction closed, such as a column layer's
    output the model reads whole, ends with the forward."""
    leave_sharded_region()


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


# Models whose blocks run (sequence, batch, features)-major (XLNet transposes its ids first): sequence
# parallelism splits dim 1 of a block's input, there the batch.
SEQUENCE_FIRST = ("XLNetModel",)


def _refuse_sequence_first(model):
    first = next((m for m in model.modules() if type(m).__name__ in SEQUENCE_FIRST), None)
    if first is not None:
        raise ValueError(
            f"parallelize: sequence_parallel=True: {type(first).__name__} runs its blocks sequence-first "
            "(sequence, batch, features), where tplayers would split dim 1, the batch. Use sequence_parallel=False "
            "for this model"
        )


def _decoder_blocks(model, placed, towers=()):
    """The transformer blocks: the nn.ModuleList whose items hold the placed attention / MLP modules
    (or tensor-parallel layers: Nemotron-H's blocks hold an attention, a mixer or an MLP each), outside
    the `towers` beside the language model (a vision tower's encoder layers); not the LM heads (MusicGen
    holds one per codebook in a list)."""
    placed_ids = {id(m) for m in placed}
    inside_towers = {id(m) for t in towers for m in model.get_submodule(t).modules()}

    def holds_placed(item):
        return any(
            id(m) in placed_ids or isinstance(m, ColumnParallelLinear | RowParallelLinear) for m in item.modules()
        )

    names = {id(m): name for name, m in model.named_modules()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None  # MusicGen's list
    lists = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) and id(m) not in inside_towers and all(map(holds_placed, m))
        and m is not head
    ]  # fmt: skip
    outer = [m for m in lists if not any(m is not o and any(m is x for x in o.modules()) for o in lists)]
    if len(outer) > 1:  # HRM's H and L modules: the sequence between the lists is the model's own business
        raise ValueError(
            f"parallelize: sequence_parallel=True: {type(model).__name__}'s blocks are in {len(outer)} lists "
            f"({', '.join(names[id(m)] for m in outer)}); tplayers splits the sequence around one list of blocks"
        )
    return outer[0] if outer else None


def parallelize(
    model, *, group=None, sequence_parallel=False, plan=None, vocab_parallel_logits=False, verify=None, overlap="auto",
    expert_group=None, context_group=None, context="auto", context_logits="whole", training_logits=False,
):  # fmt: skip
    """Shard `model` in place over `group` (see the module docstring); returns it.

    A peft model (LoRA adapters made by `peft.get_peft_model`) is sharded with its adapters, each
    like its base layer (`tplayers.hf.lora`); peft's API keeps working on the result. Prompt tuning,
    p-tuning and LN tuning are taken too, other tuners refused (`tplayers.hf.peft_tuners`). What the
    user froze stays frozen (`tplayers.hf.frozen`).

    After it, `model(ids).logits` are the full-vocabulary logits of the unsharded model
    (`vocab_parallel_logits=True` leaves them split along the vocabulary) and `backward()`
    leaves on each rank its slice of the unsharded gradients.

    verify: the self-check (`tplayers.hf.verify`): one training step's forward and backward of the
    full model on a small fixed batch before sharding (train mode, dropout off, its own loss with
    the auxiliary losses its config enables) against the sharded model's after: logits, loss and
    every gradient, raising VerifyError on every rank, naming the parameter, if they differ beyond
    the tolerance table. None (default): on whenever the weights are materialised and the model
    takes token ids; False: off; True / "train": required; "logits": an eval-mode forward's logits
    only (for models too big to check gradients); a tensor: the input to check with. It costs one
    forward and backward of a (2, 4 * TP size) batch each way, and the unsharded gradients twice.

    At its first forward (after the check), the model checks that every rank of the group was
    given the same inputs (`tplayers.hf.same_inputs`).

    overlap: every tensor-parallel layer's overlap mode ("auto": per op and shape, the path the
    cost model expects to be faster; True / False force the ring / the plain collectives).

    expert_group: MoE experts placed whole over this group (ProcessGroup or 1-D DeviceMesh, e.g.
    `init_mesh(dp=4, ep=2)["ep"]`), the tokens dispatched to them by all-to-all
    (`tplayers.hf.expert_parallel`); each expert's features still split over `group`. Its ranks
    feed different batches (it folds over the data-parallel ranks): `tplayers.data_parallel`
    then reduces the expert weights over the expert-data-parallel group.

    context_group: the sequence split over this group (e.g. `init_mesh(cp=2, tp=2)["cp"]`) through
    attention too (`tplayers.hf.context`); every rank of it is given the same whole batch, and the
    loss and logits come back whole. context: "auto" (priced by the cost model per attention
    call), "ring", "allgather" or "ulysses". `tplayers.data_parallel` then reduces gradients over
    dp x cp. context_logits: "whole" (default) or "split": each rank's logits of its own tokens,
    in the order `tplayers.hf.context.local_tokens(model)` gives (no all-gather of the logits).

    training_logits: False (default): a train-mode forward given `labels=` computes its loss with
    the fused LM-head cross-entropy and holds no (tokens x vocabulary) logits (its output's
    `logits` are None; eval mode, or no labels, gives them), where the model's forward only scores
    its logits with HF's causal-LM loss (`tplayers.hf.fused_loss`); True: the logits path always.
    """
    check_overlap(overlap, "parallelize")
    guards.guard_accelerate()  # a plain Trainer / Accelerator handed the result raises (accelerate is loaded by now)
    with restored_if_refused(model):  # a refusal gives the model back as it was given
        peft_tuners.check_tuners(model)
        if not is_grid(group):
            plan = peft_tuners.whole_prompt_encoders(model, plan)
        kwargs = dict(sequence_parallel=sequence_parallel, plan=plan, vocab_parallel_logits=vocab_parallel_logits,
                      overlap=overlap)  # fmt: skip
        kwargs["fused_loss"] = not training_logits
        layers = lora.lora_layers(model)
        if expert_group is not None:
            kwargs["expert_group"] = _expert_group(expert_group, group)
        if context_group is not None:
            kwargs["context"] = (*_context(context_group, context, group, expert_group, vocab_parallel_logits),
                                 context_logits)  # fmt: skip
        if is_grid(group):  # a 2-D tensor-parallel mesh (tplayers.hf.grid)
            if expert_group is not None:
                raise ValueError("parallelize: expert_group with a 2-D tensor-parallel mesh is not supported")
            if layers:
                raise ValueError("parallelize: LoRA adapters on a 2-D tensor-parallel mesh are not supported yet")
            if vocab_parallel_logits:
                model.register_forward_pre_hook(_no_labels, with_kwargs=True)
            model = parallelize_grid(model, group, verify=verify, **kwargs)
        elif layers:
            model = lora.parallelize_peft(
                model, layers, _parallelize, group=resolve_group(group), verify=verify, **kwargs
            )
        else:
            model = _parallelize(model, group=resolve_group(group), verify=verify, **kwargs)
    model_methods.install(model)
    return model


def _context(context_group, context, group, expert_group, vocab_parallel_logits):
    """(the context-parallel group, the method), refused where it cannot compose (before any collective)."""
    from tplayers.hf.context import CHOICES

    if context not in CHOICES:
        raise ValueError(f"parallelize: context must be one of {CHOICES}, got {context!r}")
    if is_grid(group) or expert_group is not None or vocab_parallel_logits:
        what = "a 2-D tensor-parallel mesh" if is_grid(group) else (
            "expert_group" if expert_group is not None else "vocab_parallel_logits")  # fmt: skip
        raise ValueError(f"parallelize: context_group with {what} is not supported")
    pg, tp = resolve_group(context_group), resolve_group(group)
    shared = sorted(set(dist.get_process_group_ranks(pg)) & set(dist.get_process_group_ranks(tp)))
    if len(shared) > 1:
        raise ValueError(
            f"parallelize: context_group shares ranks {shared} with the tensor-parallel group; use "
            "tplayers.init_mesh(cp=..., tp=...) and pass mesh['cp'] and mesh['tp']"
        )
    return pg, context


def _expert_group(expert_group, group):
    """The expert group as a ProcessGroup; one sharing two ranks with the tensor-parallel group is
    refused (those ranks hold the same tokens: expert parallelism folds over data-parallel ranks)."""
    pg, tp = resolve_group(expert_group), resolve_group(group)
    shared = sorted(set(dist.get_process_group_ranks(pg)) & set(dist.get_process_group_ranks(tp)))
    if len(shared) > 1:
        raise ValueError(
            f"parallelize: expert_group shares ranks {shared} with the tensor-parallel group; the expert group folds "
            "over data-parallel ranks, which feed different batches (tplayers.init_mesh(dp=..., ep=...)['ep'])"
        )
    return pg


def _parallelize(
    model, *, group, sequence_parallel=False, plan=None, vocab_parallel_logits=False, verify=None, overlap="auto",
    keep=frozenset(), expert_group=None, context=None, fused_loss=True,
):  # fmt: skip
    """`parallelize` of a model without adapters; `keep`: modules no sharding layout may fuse
    with another (they carry LoRA adapters)."""
    towers = vision.towers(model)
    if sequence_parallel:
        _refuse_sequence_first(model)
    if context is not None and towers:
        raise ValueError(
            f"parallelize: context parallelism splits the token ids before {type(model).__name__} merges its image "
            f"features into them, and its towers ({', '.join(towers)}) attend over their own patches; it is not "
            "supported for vision-language models. Use sequence_parallel=True, which splits after the merge"
        )
    probe = verification.before(model, verify, dist.get_world_size(group), vocab_parallel=vocab_parallel_logits)
    keys, trainable = list(model.state_dict().keys()), trainable_flags(model)
    keep = keep | split_where_mixed(model) | hooked_modules(model)  # layers of their own: frozen apart, hooked
    parallelizer = ShardingPass(
        model, group, sequence_parallel=sequence_parallel, plan=plan, vocab_parallel_logits=vocab_parallel_logits,
        overlap=overlap, keep=keep, expert_group=expert_group, towers=towers,
    )  # fmt: skip
    with splits_checked_together():  # one collective for every layer's split, not one each
        # the adapters read per call: patchable
        parallelizer.run(families.ADAPTERS, families.EMBEDDINGS, families.LINEAR_EQUIVALENTS, families.LINEAR_WRAPPERS)
    fuse_rms_norms(model)  # the norms left whole, LlamaRMSNorm's math exactly: the fused kernels
    text_inputs, tower_inputs = parallelizer.shared_inputs_by_sequence()
    if sequence_parallel:
        blocks = _decoder_blocks(model, text_inputs, parallelizer.towers)
        if not blocks:
            raise ValueError("parallelize: sequence_parallel=True needs the model's blocks in an nn.ModuleList")
        _refuse_convolutions_across_the_split(model, blocks, text_inputs)
    _shared_input_hooks(text_inputs, group, sequence_parallel)
    _shared_input_hooks(tower_inputs, group, False)  # a tower's input is never split by sequence
    summed_grads(parallelizer.partial_grads, group)
    if vocab_parallel_logits:
        model.register_forward_pre_hook(_no_labels, with_kwargs=True)
    config = getattr(model, "config", None)
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_positions and max_positions > 0:  # XLNet's -1: relative positions, no limit
        model.register_forward_pre_hook(_length_check(max_positions), with_kwargs=True)
    # before sequence parallelism sums every block weight left
    _inside_sharded_modules(model, parallelizer.done, parallelizer.whole, group)
    gather_attention_weights(model, group, context_parallel=context is not None)
    if sequence_parallel:
        split_sequence(model, group, blocks)
    for p in model.parameters():  # everything else is whole on every rank, with its whole gradient
        if placement_or_none(p) is None:
            set_placement(p, group, Replicate())
    if dist.get_world_size(group) > 1:  # the forward ends on the shared generator, whatever it raised or skipped
        model.register_forward_hook(_back_to_shared_generator, always_call=True)
    if dist.get_world_size(group) > 1:  # a sum over a group of one is the gradient itself: nothing to re-hook
        model.register_load_state_dict_post_hook(rehook_summed)  # a tensor assigned in: its hook again
        model.register_forward_pre_hook(rehook_summed)  # and a deep copy's tensors, before they get a gradient
    lora.record_weight_maps(model, parallelizer.exports)  # what adapters added later follow
    parallelizer.release()  # the export records outlive the pass: they must not hold the model
    if fused_loss and not vocab_parallel_logits:  # the loss without logits, where the forward allows it
        fused.install(model)
    if context is not None:  # the sequence split over the context group too, before the self-check
        tp = dist.get_world_size(group)
        apply_context(model, *context, multiple=tp if sequence_parallel else 1, tp=tp)
    finish(model, probe, group=group, exports=Records(parallelizer.exports), original_keys=keys, tied=parallelizer.tied,
           sequence_group=group if sequence_parallel else None, vocab_parallel=vocab_parallel_logits,
           expert_group=expert_group, trainable=trainable)  # fmt: skip
    if context is not None:
        check_same_inputs(model, context[0], "context-parallel")
        context_state(model).split_logits = context[2] == "split"  # after the self-check's whole ones
    return model
