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
sequence: the hidden states are split along dim 1 as they enter the first block, each column
layer all-gathers its input inside its GEMM, each row layer reduce-scatters its output, and
the replicated weights applied to sequence shards (norms) get their gradients summed over the
group, so every `.grad` is complete.
"""

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate

from tplayers.distributed import resolve_group
from tplayers.functional import comm
from tplayers.functional.auto_overlap import check_overlap
from tplayers.functional.collectives import (
    all_gather_sequence,
    copy_to_tp_region,
    gather_from_tp_region,
    scatter_to_tp_region,
)
from tplayers.hf import families, lora
from tplayers.hf import verify as verification
from tplayers.hf.grid import parallelize_grid
from tplayers.hf.pipeline_split import SEQUENCE_PARALLEL
from tplayers.hf.shard import ShardingPass, replace_hidden
from tplayers.hf.state_dict import EXPORTS, ORIGINAL_KEYS, TIED
from tplayers.nn.grid import is_grid
from tplayers.placement import placement_or_none, seal, set_placement


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
        module.register_forward_pre_hook(replace_hidden(lambda h: prepare(h, group)), with_kwargs=True)


def _sequence_parallel_hooks(model, group, blocks):
    """Shard the residual stream along the sequence between the first block's entry and the last
    block's exit (the model's masks and positions are built from the whole sequence before,
    its final norm and LM head see the whole sequence after). Replicated weights
    inside the blocks (norms) see only this rank's part of the sequence: their gradients are
    summed over the group, so every rank holds the whole gradient."""
    n = dist.get_world_size(group)
    # Entry: keep this rank's part; backward all-gathers the parts (the embeddings are replicated).
    blocks[0].register_forward_pre_hook(
        replace_hidden(lambda h: scatter_to_tp_region(_check_sequence(h, n), group, dim=1)), with_kwargs=True
    )
    # Exit: the whole sequence on every rank; backward keeps this rank's part of the (replicated) gradient.
    blocks[-1].register_forward_hook(
        lambda module, args, out: (
            (gather_from_tp_region(out[0], group, dim=1), *out[1:])
            if isinstance(out, tuple)
            else gather_from_tp_region(out, group, dim=1)
        )
    )
    _summed_grads([p for block in blocks for p in block.parameters() if placement_or_none(p) is None], group)


def _summed_grads(params, group):
    """Replicated parameters whose gradient each rank holds only part of: tagged Replicate and
    summed over the group as the gradient is computed, so every rank holds the whole of it."""
    for p in params:
        if placement_or_none(p) is None and p.requires_grad:
            set_placement(p, group, Replicate(), grad_summed=True)
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


def parallelize(
    model, *, group=None, sequence_parallel=False, plan=None, vocab_parallel_logits=False, verify=None, overlap="auto"
):
    """Shard `model` in place over `group` (see the module docstring); returns it.

    A peft model (LoRA adapters made by `peft.get_peft_model`) is sharded with its adapters, each
    like its base layer (`tplayers.hf.lora`); peft's API keeps working on the result.

    After it, `model(ids).logits` are the full-vocabulary logits of the unsharded model
    (`vocab_parallel_logits=True` leaves them split along the vocabulary) and `backward()`
    leaves on each rank its slice of the unsharded gradients.

    verify: the self-check (`tplayers.hf.verify`): the full model's logits on a small fixed
    batch before sharding against the sharded model's after, raising VerifyError on every rank
    if they differ beyond the tolerance table. None (default): on whenever the weights are
    materialised and the model takes token ids; False: off; True: required; a tensor: the input
    to check with. It costs one forward of a (2, 4 * TP size) batch each way.

    overlap: every tensor-parallel layer's overlap mode ("auto": per op and shape, the path the
    cost model expects to be faster; True / False force the ring / the plain collectives).
    """
    check_overlap(overlap, "parallelize")
    kwargs = dict(sequence_parallel=sequence_parallel, plan=plan, vocab_parallel_logits=vocab_parallel_logits,
                  overlap=overlap)  # fmt: skip
    layers = lora.lora_layers(model)
    if is_grid(group):  # a 2-D tensor-parallel mesh (tplayers.hf.grid)
        if layers:
            raise ValueError("parallelize: LoRA adapters on a 2-D tensor-parallel mesh are not supported yet")
        if vocab_parallel_logits:
            model.register_forward_pre_hook(_no_labels, with_kwargs=True)
        return parallelize_grid(model, group, verify=verify, **kwargs)
    group = resolve_group(group)
    if layers:
        return lora.parallelize_peft(model, layers, _parallelize, group=group, verify=verify, **kwargs)
    return _parallelize(model, group=group, verify=verify, **kwargs)


def _parallelize(
    model, *, group, sequence_parallel=False, plan=None, vocab_parallel_logits=False, verify=None, overlap="auto",
    keep=frozenset(),
):  # fmt: skip
    """`parallelize` of a model without adapters; `keep`: modules no sharding layout may fuse
    with another (they carry LoRA adapters)."""
    probe = verification.probe_input(model, verify, dist.get_world_size(group))
    reference = verification.logits(model, probe) if probe is not None else None
    keys = list(model.state_dict().keys())
    parallelizer = ShardingPass(model, group, sequence_parallel, plan, vocab_parallel_logits, overlap, keep)
    parallelizer.run(families.ADAPTERS, families.EMBEDDINGS, families.LINEAR_EQUIVALENTS)  # read per call: patchable
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
        if placement_or_none(p) is None:
            set_placement(p, group, Replicate())
    setattr(model, SEQUENCE_PARALLEL, group if sequence_parallel else None)  # for pipeline_split
    setattr(model, EXPORTS, parallelizer.exports)
    setattr(model, ORIGINAL_KEYS, keys)
    setattr(model, TIED, parallelizer.tied)
    lora.record_weight_maps(model, parallelizer.exports)  # what adapters added later follow
    parallelizer.release()  # the export records outlive the pass: they must not hold the model
    seal(model)
    if probe is not None:
        sharded = verification.logits(model, probe)
        verification.check(reference, sharded, group=group, vocab_parallel=vocab_parallel_logits)
    return model
