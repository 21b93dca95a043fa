"""BERT-style layers (BERT, RoBERTa, ELECTRA, ERNIE, RemBERT, RoFormer, X-MOD, ...), whose projections
live in sibling submodules: the attention's query / key / value in `attention.self` and its output
projection in `attention.output` (dense, then LayerNorm over it plus the residual), the MLP's up
projection in `intermediate` and its down projection in `output` (the same). Split as Megatron splits
its attention and MLP; the model's own forwards run on each rank's heads and features, the LayerNorms
after the row projections see whole (or, under sequence parallelism, this rank's tokens of) hidden
states and stay whole. Their LM prediction heads: the transform before the (vocabulary-parallel) LM
head whole on every rank."""

from torch import nn

from tplayers.hf.attention import _finish_attention, _local_heads
from tplayers.hf.shard import ShardingPass, has_linears
from tplayers.nn.linear import ColumnParallelLinear


def _holds_weights(module) -> bool:
    return next(module.parameters(), None) is not None


def is_self_output_attention(module) -> bool:
    """An attention module holding `self` (query / key / value) and `output` (dense, LayerNorm)."""
    inner, out = getattr(module, "self", None), getattr(module, "output", None)
    return (
        isinstance(inner, nn.Module)
        and has_linears(inner, ("query", "key", "value"))
        and isinstance(out, nn.Module)
        and has_linears(out, ("dense",))
        and isinstance(getattr(inner, "attention_head_size", None), int)
    )


def self_output_attention(sp: ShardingPass, name, attn):
    """query / key / value column-parallel by whole heads, output.dense row-parallel by the same heads;
    a cross-attention's keys and values read the encoder's states, whole on every rank
    (`replace_hidden`)."""
    inner, out = attn.self, attn.output
    width = inner.attention_head_size
    heads = inner.query.out_features // width
    others = [c for c, m in inner.named_children() if c not in ("query", "key", "value") and _holds_weights(m)]
    if others or any(getattr(inner, k).out_features != heads * width for k in ("key", "value")):
        raise ValueError(
            f"parallelize: {name}.self ({type(inner).__name__}) holds {others or 'keys / values unlike its queries'}, "
            "which tplayers does not know how to split; pass a plan for this model"
        )
    split, _, local = _local_heads(name, heads, sp)
    for key in ("query", "key", "value"):
        sp.shared_input_column(f"{name}.self.{key}", getattr(inner, key), split_unit=width, split_sizes=split)
    sp.row(f"{name}.output.dense", out.dense, split_unit=width, split_sizes=split)
    _finish_attention(sp, f"{name}.self", inner, dict(num_attention_heads=local, all_head_size=local * width))


def _input_norm(module, width) -> bool:
    """A norm over `width` features, the column layer's input (RoBERTa-PreLN's LayerNorm before
    `intermediate.dense`): it sees the layer's whole hidden state, kept whole."""
    params = list(module.parameters())
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) and all(tuple(p.shape) == (width,) for p in params)


def is_intermediate_output_mlp(module) -> bool:
    """A layer holding `intermediate` (a norm of its input or not, dense, an elementwise activation)
    and `output` (dense, then LayerNorm over it plus the residual) as its MLP."""
    inner, out = getattr(module, "intermediate", None), getattr(module, "output", None)
    return (
        isinstance(inner, nn.Module)
        and has_linears(inner, ("dense",))
        and isinstance(out, nn.Module)
        and has_linears(out, ("dense",))
        and inner.dense.out_features == out.dense.in_features
        and not any(
            c != "dense" and _holds_weights(m) and not _input_norm(m, inner.dense.in_features)
            for c, m in inner.named_children()
        )
    )


def intermediate_output_mlp(sp: ShardingPass, name, layer):
    """intermediate.dense column-parallel (its activation acts on each rank's features), output.dense
    row-parallel by the same features."""
    sp.column(f"{name}.intermediate.dense", layer.intermediate.dense)
    sp.row(f"{name}.output.dense", layer.output.dense)
    for child, module in layer.intermediate.named_children():  # a norm of the input: whole
        if child != "dense" and _holds_weights(module):
            sp.done.add(f"{name}.intermediate.{child}")
            sp.whole.add(f"{name}.intermediate.{child}")
    if isinstance(getattr(layer.output, "adapter_modules", None), nn.ModuleDict):
        # X-MOD's per-language bottleneck adapters, token by token on the summed hidden state: whole
        sp.done.add(f"{name}.output.adapter_modules")
        sp.whole.add(f"{name}.output.adapter_modules")
    sp.done.add(f"{name}.intermediate")


# A transform of the last hidden states kept beside the model's LM head, not in the module holding it
PREDICTION_TRANSFORMS = ("ElectraGeneratorPredictions", "ModernBertDecoderPredictionHead")


def is_prediction_head(module) -> bool:
    """A BERT-family LM prediction head: the LM head as `decoder` (already vocabulary-parallel here)
    beside a token-wise transform of the last hidden states (dense, activation, LayerNorm: in a
    `transform` child or held directly); or ELECTRA's generator predictions (the transform alone)."""
    if type(module).__name__ in PREDICTION_TRANSFORMS:
        return True
    others = [child for child, _ in module.named_children() if child != "decoder"]
    return isinstance(getattr(module, "decoder", None), ColumnParallelLinear) and bool(others)


def prediction_head(sp: ShardingPass, name, module):
    """The transform whole on every rank: it sees the whole last hidden states (sequence parallelism
    ends before the LM head), and the LM head sums its input's gradient over the ranks, so each rank's
    gradient of it is the whole one. The LM head itself was placed with the embeddings."""
    for child, _ in module.named_children():
        if child != "decoder":
            sp.done.add(f"{name}.{child}")
            sp.whole.add(f"{name}.{child}")
    sp.done.add(name)


def holds_pooler(module) -> bool:
    """A BERT-family model's pooler, held as `pooler`: a linear layer over the first token's last
    hidden state (BigBird's), or a module whose only weights are such a `dense` (BERT's)."""
    pooler = getattr(module, "pooler", None)
    if isinstance(pooler, nn.Linear):
        return True
    named = type(pooler).__name__.endswith("Pooler") and has_linears(pooler, ("dense",))
    return named and all(n.startswith("dense.") for n, _ in pooler.named_parameters())


def pooler(sp: ShardingPass, name, module):
    """Whole on every rank: it reads the first token of the whole last hidden states (sequence
    parallelism ends after the last block), and its output is whole."""
    key = f"{name}.pooler" if name else "pooler"
    sp.done.add(key)
    sp.whole.add(key)


# Linear layers between the embeddings and the first layer, by the name their models give them (RemBERT's
# projection of its narrow embeddings, RoC-BERT's of its concatenated ones)
EMBEDDING_PROJECTIONS = ("embedding_hidden_mapping_in", "map_inputs_layer")


def holds_embedding_projection(module) -> bool:
    return any(isinstance(getattr(module, key, None), nn.Linear) for key in EMBEDDING_PROJECTIONS)


def embedding_projection(sp: ShardingPass, name, module):
    """The projection whole on every rank: it sees the whole embeddings (sequence parallelism splits
    the sequence at the first layer, after it), and the first layer's input gradient reaches it whole."""
    for key in EMBEDDING_PROJECTIONS:
        if isinstance(getattr(module, key, None), nn.Linear):
            sp.done.add(f"{name}.{key}" if name else key)
            sp.whole.add(f"{name}.{key}" if name else key)
