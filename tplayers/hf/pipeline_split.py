"""`pipeline_split(model, group=...)`: a HuggingFace causal LM (parallelized or not) as pipeline
stages, the decoder layers divided over them, the embeddings on the first, the final norm and
the LM head on the last.

Each stage computes what the model's own forward computes for its layers: positions, rotary
embeddings and the causal mask are built on every stage from the sequence length (under
sequence parallelism the hidden states travel between stages as each rank's part of the sequence,
so a stage past the first sums the parts of its TP group for the length, and opens the split for
its blocks). Tied input / output
embeddings stay tied: the first and last stages hold the one Parameter, their gradients are
summed after each step (as Megatron does) and the norm counts it once.

Known layout: models whose decoder (`model.model`) holds `embed_tokens`, `layers`, `norm` and
`rotary_emb`, and whose layers take (hidden, attention_mask=, position_ids=,
position_embeddings=) (Llama, Mistral, Qwen2/3, SmolLM3, OLMo/OLMo2, the hybrids Qwen3-Next and
Qwen3.5, whose linear-attention layers (config.layer_types) get no mask: their padding mask is
None without padding); any other is
refused, naming what is missing. Having the parts is not proof of the same computation, so
before splitting, every rank checks on a probe sequence that the stages chained on it give the
model's own logits (a model that scales its embeddings or logits, as Gemma, Granite and Cohere
do, is refused with the difference named), and sliding-window attention, which a short probe
cannot see, is refused from the config.

A context-parallel model (`parallelize(context_group=...)`) splits the same way: the batch is split
once, by the first stage, which keeps this rank's tokens of the whole rows it is given (as the
model's own pre-hook does); every stage attends over every CP rank's keys with the layout of the
micro-batch's (B, S), which the schedule tells the stages past the first (they receive only this
rank's share of each row); the last stage gathers the whole rows' logits, so the schedule's
`loss_fn` is the one the unsharded model takes (with `context_logits="split"` it keeps this rank's
logits, and `tplayers.next_token_loss(model)` is the loss_fn that reads them). No mask
is built, the attention reads windows from the model's layers, so sliding windows are not refused
there. The schedule's first step checks that the CP ranks were given the same rows.

The loss without logits: with `loss_fn=tplayers.next_token_loss(model)` the schedules also give the
last stage each micro-batch's labels, and on a model whose training loss is fused
(tplayers.hf.fused_loss, the default) that stage returns HF's causal-LM loss from the fused LM-head
cross-entropy inside its forward (where ZeRO-3 has the head's weight gathered): no micro-batch holds
its logits. A loss_fn of your own gets the logits.
"""

import contextlib
import functools
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tplayers.distributed import resolve_group
from tplayers.functional.sequence import sequence_split
from tplayers.hf.context import (
    context_state,
    rows_loss_of_rank,
    shifted_labels,
    stage_positions,
    summed_over_context,
    whole_sequence,
)
from tplayers.hf.fused_loss import installed
from tplayers.hf.same_inputs import compare_inputs
from tplayers.hf.state_dict import export_records
from tplayers.hf.vision import towers
from tplayers.nn.lm_head import ParallelLMHead
from tplayers.pipeline import PipelineStage
from tplayers.placement import refuse_overlap
from tplayers.state import set_state, state_of

DECODER_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


@functools.cache
def _cache_argument() -> str:
    """create_causal_mask's name for the KV cache: `cache` from transformers 5.2x, `past_key_values` before."""
    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


class DecoderStage(nn.Module):
    """Layers `layers` of a HF decoder, with the embedding (first stage) or the final norm and LM
    head (last stage). Input: token ids (first) or hidden states; output: hidden states, logits,
    or (the last stage of a model whose loss is fused, given `labels=`) the loss itself."""

    def __init__(self, model, layers, *, first: bool, last: bool, layer_indices=()):
        super().__init__()
        self.layer_indices = tuple(layer_indices)  # the decoder layers' indices in the model
        decoder = model.model
        self.config = decoder.config
        self.first, self.last = first, last
        self.embed_tokens = decoder.embed_tokens if first else None
        self.layers = nn.ModuleList(layers)
        self.norm = decoder.norm if last else None
        self.lm_head = model.get_output_embeddings() if last else None
        self.rotary_emb = decoder.rotary_emb
        self.sequence_group = state_of(model).sequence_group  # set by parallelize(sequence_parallel=True)
        # the model's training loss is fused (tplayers.hf.fused_loss): so is this stage's, given labels
        self.scores_labels = last and installed(model)
        self.context = state_of(model).context
        if self.context is not None:  # data_parallel(stage.module) reduces over dp x cp, as for the model
            set_state(self, context=self.context)
            self.sum_over_context = summed_over_context(self.context)
            self.pipeline_batch, self.check_inputs = None, first
        # The model's names for this stage's parts, and its export records for them: what a
        # checkpoint of the stage alone needs once the model itself is gone.
        names = {id(m): name for name, m in model.named_modules()}
        parts = dict(embed_tokens=self.embed_tokens, norm=self.norm, lm_head=self.lm_head, layers=decoder.layers)
        self.hf_prefixes = {part: names[id(m)] for part, m in parts.items() if m is not None and id(m) in names}
        own = [self.hf_prefixes[p] for p in ("embed_tokens", "norm", "lm_head") if p in self.hf_prefixes]
        own += [f"{self.hf_prefixes['layers']}.{i}" for i in self.layer_indices]
        self.hf_records = [r for r in export_records(model) if any(r[0] == p or r[0].startswith(p + ".") for p in own)]

    def hf_name(self, name: str) -> str:
        """The model's name for `name` of this stage's state dict."""
        part, _, rest = name.partition(".")
        if part == "layers":
            index, _, rest = rest.partition(".")
            return f"{self.hf_prefixes['layers']}.{self.layer_indices[int(index)]}.{rest}"
        return f"{self.hf_prefixes[part]}.{rest}"

    def set_pipeline_batch(self, shape):
        """The shape of the micro-batch entering the first stage (told by the schedule on every rank)."""
        self.pipeline_batch = tuple(shape)

    def check_pipeline_batch(self, x) -> str | None:
        """The first stage under context parallelism, at the schedule's first step: every CP rank was
        given the same rows (the message if not), as the model's own first forward checks."""
        if self.context is None or not self.check_inputs:
            return None
        self.check_inputs = False
        try:
            compare_inputs({"input_ids": x} if x is not None else {}, self.context.group, "context-parallel")
        except ValueError as e:
            return str(e)
        return None

    def forward(self, x, labels=None):
        """Hidden states (or the last stage's logits); the last stage of a model whose loss is fused,
        given `labels` (B, S) in a training forward, returns HF's causal-LM loss of its rows instead,
        from the fused LM-head cross-entropy: no logits held (`next_token_loss` passes them)."""
        from transformers.masking_utils import create_causal_mask

        scoring = labels is not None and self.scores_labels and self.training and torch.is_grad_enabled()
        if self.context is not None:
            return self._forward_in_context(x, labels if scoring else None)
        hidden = self.embed_tokens(x) if self.first else x
        length, split = hidden.shape[1], self.sequence_group is not None and not self.first
        if split:  # this rank's part of the sequence arrived (parts may differ: tplayers.hf.sequence_split)
            length = _whole_length(hidden, self.sequence_group)
        shape_of = hidden[:, :1].expand(hidden.shape[0], length, hidden.shape[-1])  # no copy
        position_ids = torch.arange(length, device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=shape_of, attention_mask=None, position_ids=position_ids,
            **{_cache_argument(): None},
        )  # fmt: skip
        position_embeddings = self.rotary_emb(shape_of, position_ids=position_ids)
        types = getattr(self.config, "layer_types", None) or ()
        with self._split_for_blocks(length if split else None):
            for index, layer in zip(self.layer_indices or range(len(self.layers)), self.layers, strict=True):
                # linear-attention / state-space layers take the 2-D padding mask, None without padding
                linear = index < len(types) and types[index] == "linear_attention"
                hidden = layer(
                    hidden, attention_mask=None if linear else mask, position_ids=position_ids,
                    position_embeddings=position_embeddings,
                )  # fmt: skip
                hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if self.last:
            if scoring:
                return ParallelLMHead.loss(self._deferred_logits(hidden), shifted_labels(labels))
            hidden = self.lm_head(self.norm(hidden))
        return hidden

    def _split_for_blocks(self, length):
        """The sequence split over the TP group opened around this stage's blocks, whose collectives read
        it (`length`: the whole length of the parts, None where the blocks open it themselves)."""
        return sequence_split(length, self.sequence_group) if length is not None else contextlib.nullcontext()

    def _deferred_logits(self, hidden):
        """The head's placeholder for the logits of `hidden` (tplayers.nn.lm_head): nothing computed."""
        self.lm_head.defer_logits = True
        try:
            return self.lm_head(self.norm(hidden))
        finally:
            self.lm_head.defer_logits = False

    def _forward_in_context(self, x, labels=None):
        """Under context parallelism: the first stage keeps this rank's tokens of the whole rows it
        is given (as the model's own pre-hook does); every stage attends over every rank's keys with
        the layout of the micro-batch's (B, S), which stages past the first learn from the schedule
        (`set_pipeline_batch`); the last gathers the whole rows' logits (backward keeps this rank's
        part), so the schedule's loss_fn sees what the unsharded model gives, or keeps its own
        (context_logits="split")."""
        state = self.context
        if self.first:
            batch, seq_len = x.shape[:2]
        elif self.pipeline_batch is None or self.pipeline_batch[0] != x.shape[0]:
            raise ValueError(
                f"pipeline stage of layers {self.layer_indices}: a context-parallel stage past the first needs the "
                f"shape of the micro-batch entering the first stage (told {self.pipeline_batch}, received "
                f"{tuple(x.shape)}); run it through a tplayers schedule, or call set_pipeline_batch(shape)"
            )
        else:
            batch, seq_len = self.pipeline_batch[:2]
        self.sum_over_context(self)
        positions = stage_positions(state, batch, seq_len, x.device)
        try:
            hidden = self.embed_tokens(state.layout.take(x)) if self.first else x
            position_embeddings = self.rotary_emb(hidden, position_ids=positions)
            split = self.sequence_group is not None and not self.first  # this rank's part of its CP share
            with self._split_for_blocks(_whole_length(hidden, self.sequence_group) if split else None):
                for layer in self.layers:  # no mask: the attention reads the layout
                    hidden = layer(hidden, attention_mask=None, position_ids=positions,
                                   position_embeddings=position_embeddings)  # fmt: skip
                    hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            if self.last and labels is not None:  # the whole rows' loss from this rank's tokens, no logits
                placeholder = self._deferred_logits(hidden)
                return rows_loss_of_rank(state, labels, lambda mine, count: ParallelLMHead.loss(
                    placeholder, mine, divisor=count))  # fmt: skip
            if self.last:
                logits = self.lm_head(self.norm(hidden))
                hidden = logits if state.split_logits else whole_sequence(logits, state)
                if hidden._is_view():  # TP's gather at tp = 1 returns its input: a view, whose pre-backward
                    hidden = hidden.clone()  # hook (FSDP2's) an in-place op in the user's loss_fn would drop
        finally:
            state.layout = None
        return hidden


def _whole_length(hidden, group):
    """The sequence length whose parts the ranks of `group` hold (each its own of `hidden`'s dim 1): a
    stage past the first cannot tell it from its own part, nor trust a length told before (a later
    micro-batch may be shorter), so the parts are summed (one tiny all-reduce per micro-batch)."""
    parts = torch.tensor([hidden.shape[1]], device=hidden.device)
    dist.all_reduce(parts, group=group)
    return int(parts.item())


class NextTokenLoss:
    """`next_token_loss(model)`: the loss_fn(output, labels) of the pipeline schedules of
    `model`'s stages (`pipeline_split`): HF's causal-LM loss of the rows `labels` (B, S) (shifted
    over the whole row, the mean over those not -100), what `model(ids, labels=labels).loss` gives.

    The schedules hand a loss_fn that asks for them (`labels_to_last_stage`) the labels inside the
    last stage's forward too: where the model's training loss is fused (tplayers.hf.fused_loss),
    that stage then returns the loss itself, from the fused LM-head cross-entropy, and no micro-batch
    holds its (tokens x vocabulary) logits; this loss_fn passes that scalar on. Otherwise it scores
    the logits: with `context_logits="split"` each CP rank's tokens, summed over the group."""

    labels_to_last_stage = True

    def __init__(self, model):
        self.context = context_state(model)

    def __call__(self, output, labels):
        if output.dim() == 0:  # the last stage's own loss of these labels (logits never are a scalar)
            return output
        if self.context is None or not self.context.split_logits:
            return F.cross_entropy(output.float().flatten(0, 1), shifted_labels(labels).flatten(), ignore_index=-100)

        def score(mine, count):
            logits = output.float().flatten(0, 1)
            return F.cross_entropy(logits, mine.flatten(), ignore_index=-100, reduction="sum") / count

        return rows_loss_of_rank(self.context, labels, score)


def next_token_loss(model) -> NextTokenLoss:
    """The loss_fn for the pipeline schedules of `model`'s stages: HF's causal-LM loss, without
    logits where the model's is fused (`NextTokenLoss`)."""
    return NextTokenLoss(model)


def _layer_counts(total, stages, given):
    if given is not None:
        given = list(given)
        if len(given) != stages or sum(given) != total or min(given) < 1:
            raise ValueError(
                f"pipeline_split: layers_per_stage {given} must be {stages} positive counts adding to {total}"
            )
        return given
    if total < stages:
        raise ValueError(f"pipeline_split: fewer decoder layers ({total}) than pipeline stages ({stages})")
    return [total // stages + (1 if i < total % stages else 0) for i in range(stages)]


def pipeline_split(model, *, group=None, virtual_stages: int = 1, layers_per_stage=None) -> list[PipelineStage]:
    """This rank's stages of `model` (the same model on every rank) over the pipeline `group`
    (ProcessGroup or 1-D DeviceMesh; None: every rank): `virtual_stages` per rank, looped (stage
    i on rank i % n), for the interleaved schedules. `layers_per_stage`: the decoder layers of
    each stage (default: as even as possible)."""
    context = state_of(model).context
    pg = resolve_group(group)
    refuse_overlap(model.parameters(), pg, "pipeline_split", ("tp", "dp"),
                   "the stages are split over ranks that hold the same stage's shards or replicas (use "
                   "init_mesh(pp=..., tp=...) and pass mesh['pp'])", role="the pipeline group")  # fmt: skip
    n, rank = dist.get_world_size(pg), dist.get_rank(pg)
    beside = towers(model)
    if beside:  # the stages would carry hidden states only: the image features never reach them
        raise ValueError(
            f"pipeline_split: {type(model).__name__} has towers beside its language model ({', '.join(beside)}), "
            "whose outputs the model merges into the first stage's input; tplayers splits decoders only. "
            "Split it with tplayers.PipelineStage directly"
        )
    decoder = getattr(model, "model", None)
    missing = [p for p in DECODER_PARTS if not hasattr(decoder, p)]
    if missing or model.get_output_embeddings() is None:
        raise ValueError(
            f"pipeline_split: {type(model).__name__} is not a decoder layout tplayers knows (missing "
            f"{missing or ['an output embedding']}); split it with tplayers.PipelineStage directly"
        )
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"pipeline_split: virtual_stages must be a positive int, got {virtual_stages!r}")
    if context is None:  # under context parallelism the attention takes the window itself, no mask is built
        _refuse_sliding_windows(model)
    num_stages = n * virtual_stages
    counts = _layer_counts(len(decoder.layers), num_stages, layers_per_stage)
    starts = [sum(counts[:i]) for i in range(num_stages)]
    head, embedding = model.get_output_embeddings(), decoder.embed_tokens
    tied = [head.weight] if head.weight is embedding.weight else []

    def stage_module(index):
        return DecoderStage(
            model, list(decoder.layers[starts[index] : starts[index] + counts[index]]),
            first=index == 0, last=index == num_stages - 1,
            layer_indices=range(starts[index], starts[index] + counts[index]),
        )  # fmt: skip

    _check_the_stages_compute_the_model(model, [stage_module(i) for i in range(num_stages)])
    stages = []
    for index in range(rank, num_stages, n):
        module = stage_module(index)
        # every stage names the tied weight, so every rank joins the sum of its gradients
        # the norm counts it on the rank of the first stage (rank 0: the stages are looped)
        stages.append(PipelineStage(module, index, num_stages, group=pg, tied=tied, counted_here=rank == 0))
    return stages


def _refuse_sliding_windows(model):
    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ())
    window = getattr(config, "sliding_window", None)
    used = getattr(config, "use_sliding_window", True)
    if kinds - {"full_attention", "linear_attention"} or (
        window is not None and used and "full_attention" not in kinds
    ):
        raise ValueError(
            f"pipeline_split: {type(model).__name__} uses sliding-window attention or layer types tplayers' stages "
            f"do not build a mask for (sliding_window={window}, layer_types {sorted(kinds) or None}); its stages "
            "would build only the causal mask, so it is refused"
        )


PROBE_LENGTH = 8  # tokens of the probe sequence (a multiple of any TP size up to 8, for SP)


def _check_the_stages_compute_the_model(model, modules):
    """The stages chained on a probe sequence give the model's own logits (eval mode, no grad,
    the RNG left as it was), on every rank alike; otherwise refuse before anything is split."""
    from tplayers.tolerances import tolerance

    device = model.get_output_embeddings().weight.device
    vocab = model.config.vocab_size
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            model.eval()
            ids = torch.randint(0, vocab, (1, PROBE_LENGTH), generator=torch.Generator().manual_seed(0)).to(device)
            expected = model(ids).logits
            got = ids
            for module in modules:
                if getattr(module, "context", None) is not None:
                    module.set_pipeline_batch(ids.shape)
                got = module(got)
    finally:
        for m, training in modes:
            m.training = training
    tol = tolerance(expected.dtype)
    if got.shape != expected.shape or not torch.allclose(got, expected, **tol):
        error = (got - expected).abs().max().item() if got.shape == expected.shape else "shape"
        raise ValueError(
            f"pipeline_split: {type(model).__name__}'s stages do not compute what its forward does (largest "
            f"difference in the logits of a probe sequence: {error}; it may scale its embeddings or logits, or "
            "its layers take other inputs); split it with tplayers.PipelineStage directly"
        )
