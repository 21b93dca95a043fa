"""What tplayers knows about each HuggingFace model family: one adapter per module pattern,
recognised by the module's children (or, for a fused layout that only the forward code reveals,
by the class that reads it), side by side in `ADAPTERS`. The adapters themselves live by kind:

    tplayers.hf.attention   attention layouts split by heads (q/k/v/o, fused [q; k; v], per-head
                            and grouped query_key_value, multi-query, CodeGen's blocks, ALiBi)
    tplayers.hf.mla         multi-head latent attention (DeepSeek-V2 / V3, MiniCPM3, ...)
    tplayers.hf.mixers      state-space and linear-attention mixers split by heads (Gated DeltaNet,
                            Mamba 1 and 2)
    tplayers.hf.mlp         gated (-> ParallelMLP's fused SwiGLU), fused gate|up, two-layer MLPs;
                            modules on the residual stream kept whole (Gemma 3n / 4)
    tplayers.hf.moe         experts in transformers 5's fused 3-D layouts (and DBRX's), sharded
                            like MLPs; routers found by what they are

    input embeddings: nn.Embedding -> VocabParallelEmbedding; Gemma's scaled embedding (times
        sqrt(hidden)) -> the same with its scale kept; any other nn.Embedding subclass is refused
    nn.Linear subclasses: those whose forward is nn.Linear's math (`LINEAR_EQUIVALENTS`, read in
        their source: Falcon's) become plain nn.Linear; any other is refused

A new family is an adapter here (and its function in the module of its kind) plus a test row.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tplayers.hf import (
    attention,
    attention_code_models,
    attention_convolved,
    attention_experts,
    attention_falcon,
    attention_pairs,
    attention_variants,
    encoder_layers,
    mixers,
    mla,
    mlp,
    moe,
    recurrent,
    vision,
)
from tplayers.hf.shard import ShardingPass, has_conv1ds, has_linears
from tplayers.hf.source import same_forward
from tplayers.nn.embedding import VocabParallelEmbedding


@dataclass(frozen=True)
class Adapter:
    """A module pattern tplayers knows exactly: `matches(module)` recognises it by its children,
    `apply(sharding_pass, name, module)` shards it in place."""

    name: str
    matches: Callable[[nn.Module], bool]
    apply: Callable[[ShardingPass, str, nn.Module], None]
    passes_on: bool = False  # it places part of the module: the next adapter that matches it places the rest


@dataclass(frozen=True)
class EmbeddingAdapter:
    """An input embedding whose forward tplayers knows exactly: `build(embedding, group)` gives
    its vocabulary-parallel form."""

    name: str
    matches: Callable[[nn.Embedding], bool]
    build: Callable[[nn.Embedding, dist.ProcessGroup], VocabParallelEmbedding]


def _plain_embedding(m) -> bool:
    return type(m).forward is nn.Embedding.forward


def _as_plain_embedding(m) -> nn.Embedding:
    """An nn.Embedding (on the meta device, then given the weight) with `m`'s weight and options."""
    plain = nn.Embedding(m.num_embeddings, m.embedding_dim, m.padding_idx, device="meta")
    plain.weight = nn.Parameter(m.weight.detach(), requires_grad=False)
    plain.max_norm, plain.scale_grad_by_freq, plain.sparse = m.max_norm, m.scale_grad_by_freq, m.sparse
    return plain


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding times a constant `embed_scale`, applied as the model applies it after
    the lookup: a tensor cast to the weight's dtype first (Gemma's sqrt(hidden)), or a Python number
    (BioGPT's and XGLM's)."""

    def forward(self, ids):
        scale = self.embed_scale
        return super().forward(ids) * (scale.to(self.weight.dtype) if isinstance(scale, torch.Tensor) else scale)


def _scale_of(m):
    """The scale of a *ScaledWordEmbedding: a one-element tensor or a number; None if neither."""
    scale = getattr(m, "embed_scale", None)
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        return scale
    if isinstance(scale, int | float) and not isinstance(scale, bool):
        return scale
    return None


def _scaled_embedding(m) -> bool:
    """*ScaledWordEmbedding (Gemma, BioGPT, XGLM): embedding(ids) * embed_scale; checked on a probe
    where the weights are materialised, so a look-alike with other math is refused."""
    scale = _scale_of(m)
    if not (type(m).__name__.endswith("ScaledWordEmbedding") and scale is not None):
        return False
    if m.weight.is_meta:
        return True
    ids = torch.arange(min(8, m.num_embeddings), device=m.weight.device)
    factor = scale.to(m.weight.dtype) if isinstance(scale, torch.Tensor) else scale
    with torch.no_grad():
        return torch.equal(m(ids), nn.functional.embedding(ids, m.weight) * factor)


class NormedVocabParallelEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding, then the model's own norm (`embed_norm`, whole on every rank) over the
    whole looked-up vectors, as the model applies it (Inkling's normed embeddings)."""

    def forward(self, ids):
        return self.embed_norm(super().forward(ids))


def _normed_embedding(m) -> bool:
    """*NormedEmbedding (Inkling): embed_norm(embedding(ids)); checked on a probe where the weights
    are materialised, so a look-alike with other math is refused."""
    if not (type(m).__name__.endswith("NormedEmbedding") and isinstance(getattr(m, "embed_norm", None), nn.Module)):
        return False
    if m.weight.is_meta:
        return True
    ids = torch.arange(min(8, m.num_embeddings), device=m.weight.device)
    with torch.no_grad():
        return torch.equal(m(ids), m.embed_norm(nn.functional.embedding(ids, m.weight, m.padding_idx)))


def _build_normed_embedding(m, group):
    layer = NormedVocabParallelEmbedding.from_embedding(_as_plain_embedding(m), group=group)
    layer.embed_norm = m.embed_norm
    return layer


def _build_scaled_embedding(m, group):
    layer = ScaledVocabParallelEmbedding.from_embedding(_as_plain_embedding(m), group=group)
    if isinstance(m.embed_scale, torch.Tensor):
        layer.register_buffer("embed_scale", m.embed_scale.detach().clone(), persistent=False)
    else:
        layer.embed_scale = m.embed_scale
    return layer


EMBEDDINGS = (
    EmbeddingAdapter("nn.Embedding", _plain_embedding, lambda m, g: VocabParallelEmbedding.from_embedding(m, group=g)),
    EmbeddingAdapter("scaled embedding (Gemma, BioGPT, XGLM)", _scaled_embedding, _build_scaled_embedding),
    EmbeddingAdapter("normed embedding (Inkling)", _normed_embedding, _build_normed_embedding),
)

# nn.Linear subclasses whose forward is nn.Linear's math (read in their source): made plain
# nn.Linear (the same Parameters) before the pass. FalconLinear: input @ weight.T + bias.
LINEAR_EQUIVALENTS = ("transformers.models.falcon.modeling_falcon.FalconLinear",)


def _moshi_linear(module) -> bool:
    """Moshi's MoshiLinear without per-codebook weights: its forward is its `linear` child's."""
    if type(module).__name__ != "MoshiLinear" or module.use_flexible_linear:
        return False
    from transformers.models.moshi.modeling_moshi import MoshiLinear

    return same_forward(module, MoshiLinear) and type(module.linear) is nn.Linear


# Modules whose forward is their `linear` child's: the adapters see that child in their place
# (`ShardingPass.unwrap_linears`), and it is sharded under its own name
LINEAR_WRAPPERS = (_moshi_linear,)

ADAPTERS = (
    # vision-language models: modules beside the language model (tplayers.hf.vision)
    Adapter(
        "nn.MultiheadAttention in a tower, kept whole (it reads its projections' weights)",
        vision.is_kept_whole,
        vision.keep_whole,
    ),
    Adapter("two-layer projector (LLaVA, Mistral 3)", vision.is_two_layer_projector, vision.two_layer_projector),
    Adapter(
        "patch merger: a projection and norm before a gated MLP (GLM-4V)",
        vision.is_projected_gated_merger,
        vision.projected_gated_merger,
    ),  # fmt: skip
    Adapter("Qwen-VL vision attention (qkv by heads)", vision.is_qkv_by_heads_attention, vision.qkv_by_heads_attention),
    Adapter(
        "Sequential(Linear, activation, Linear) (Qwen-VL patch mergers)",
        vision.is_sequential_mlp,
        vision.sequential_mlp,
    ),  # fmt: skip
    # fused layouts, recognised by the class whose forward reads them
    Adapter(
        "per-head query_key_value (GPT-NeoX, Bloom, Persimmon)",
        attention.named("GPTNeoXAttention", "BloomAttention", "GPTNeoXJapaneseAttention", "PersimmonAttention"),
        attention.interleaved_qkv_attention,
    ),
    Adapter("Falcon attention", attention.named("FalconAttention"), attention_falcon.falcon_attention),
    Adapter("GPTBigCode attention", attention.named("GPTBigCodeAttention"), attention_code_models.bigcode_attention),
    Adapter("CodeGen attention", attention.named("CodeGenAttention"), attention_code_models.codegen_attention),
    Adapter("MPT attention", attention.named("MptAttention"), attention_code_models.mpt_attention),
    Adapter(
        "short convolutions on the residual stream (Inkling's decoder layers), whole",
        attention_convolved.holds_residual_convolutions,
        attention_convolved.residual_convolutions,
        passes_on=True,
    ),  # fmt: skip
    Adapter(
        "attention with short convolutions over keys and values (Inkling)",
        attention_convolved.is_convolved_attention,
        attention_convolved.convolved_attention,
    ),  # fmt: skip
    Adapter(
        "differential attention (DiffLlama: heads paired across halves)",
        attention_pairs.is_differential_attention,
        attention_pairs.differential_attention,
    ),  # fmt: skip
    Adapter(
        "multi-head attention with renamed projections (CTRL, XLM)",
        attention_variants.is_renamed_attention,
        attention_variants.renamed_attention,
    ),  # fmt: skip
    Adapter(
        "T5's attention (q / k / v / o, a relative position bias by heads)",
        attention_variants.is_t5_attention,
        attention_variants.t5_attention,
    ),  # fmt: skip
    Adapter(
        "unit-norm attention with per-channel query / gate scales (Dory)",
        attention_variants.is_unit_norm_attention,
        attention_variants.unit_norm_attention,
    ),  # fmt: skip
    Adapter(
        "attention with a dynamic mask from the values (Doge)",
        attention_variants.is_dynamic_mask_attention,
        attention_variants.dynamic_mask_attention,
    ),  # fmt: skip
    Adapter(
        "mixture of attention heads (JetMoE: query experts by key/value heads)",
        attention_experts.is_mixture_of_attention,
        attention_experts.mixture_of_attention,
    ),  # fmt: skip
    Adapter(
        "experts stacked (E, out, in) with their router inside (JetMoE's MLP), by features",
        attention_experts.is_stacked_experts_mlp,
        attention_experts.stacked_experts_mlp,
    ),  # fmt: skip
    Adapter("multi-head latent attention (DeepSeek-V2 / V3, MiniCPM3)", mla.is_mla, mla.mla_attention),
    Adapter(
        "DeepSeek-V4 attention (grouped output, compressor)",
        attention.named("DeepseekV4Attention"),
        mla.deepseek_v4_attention,
    ),  # fmt: skip
    Adapter(
        "token-wise modules on the residual stream (Gemma 3n's AltUp, LAuReL; per-layer inputs)",
        mlp.holds_residual_stream_modules,
        mlp.residual_stream_modules,
        passes_on=True,
    ),
    Adapter(
        "routers of an MoE block (by what they are)",
        lambda m: moe.experts_child(m) is not None,
        moe.routers,
        passes_on=True,
    ),
    Adapter("DBRX experts (w1 / v1 / w2 stacked by expert)", moe.is_dbrx_experts, moe.dbrx_experts),
    Adapter("DBRX attention (fused Wqkv, clip_qkv)", attention.named("DbrxAttention"), attention.dbrx_attention),
    Adapter("experts (MoE, transformers 5's fused 3-D layout)", moe.is_experts, moe.experts),
    Adapter("Gated DeltaNet (Qwen3-Next, Qwen3.5)", mixers.is_gated_deltanet, mixers.gated_deltanet),
    Adapter("lightning attention (MiniMax)", mixers.is_lightning_attention, mixers.lightning_attention),
    Adapter(
        "Kimi Delta Attention (Kimi-Linear, Bailing hybrid)",
        mixers.is_kimi_delta_attention,
        mixers.kimi_delta_attention,
    ),  # fmt: skip
    Adapter("Mamba 1 mixer (Mamba, Falcon-Mamba, Jamba)", mixers.is_mamba1, mixers.mamba1_mixer),
    Adapter("Zamba's multi-head Mamba mixer, by heads", mixers.is_zamba_mixer, mixers.zamba_mixer),
    Adapter("LFM2 short convolution", mixers.is_short_conv, mixers.short_conv),
    Adapter(
        "xLSTM (mLSTM layers by heads, gated feed-forwards)",
        recurrent.is_xlstm_model,
        recurrent.xlstm_model,
        passes_on=True,
    ),  # fmt: skip
    Adapter(
        "RWKV's block (time mixing by channel, channel mixing by features)",
        recurrent.is_rwkv_block,
        recurrent.rwkv_block,
        passes_on=True,
    ),
    Adapter(
        "RecurrentGemma's recurrent block (the RG-LRU by heads)",
        recurrent.is_recurrent_block,
        recurrent.recurrent_block,
    ),  # fmt: skip
    Adapter("gated MLP named w1 / w3 / w2 (LFM2)", mlp.is_w1_w3_w2, mlp.w1_w3_w2),
    Adapter("Mamba 2 mixer (Mamba2, Bamba, Nemotron-H, Granite-4, Falcon-H1)", mixers.is_mamba2, mixers.mamba2_mixer),
    # recognised by their children
    Adapter("q/k/v/o attention", attention.is_qkvo_attention, attention.qkvo_attention),
    Adapter(
        "fused qkv attention (Phi-3)", lambda m: has_linears(m, ("qkv_proj", "o_proj")), attention.fused_qkv_attention
    ),
    Adapter("fused gate|up MLP (Phi-3)", lambda m: has_linears(m, ("gate_up_proj", "down_proj")), mlp.fused_gate_up),
    Adapter(
        "chunked [gate; up] MLP (Granite-MoE shared / hybrid, ModernBERT-decoder)",
        lambda m: mlp.chunked_pair(m) is not None,
        mlp.chunked_gate_up,
    ),
    Adapter("GPT-2 attention", lambda m: has_conv1ds(m, ("c_attn", "c_proj")), attention.gpt2_attention),
    Adapter(
        "a pooler over the first token (BigBird), whole",
        encoder_layers.holds_pooler,
        encoder_layers.pooler,
        passes_on=True,
    ),  # fmt: skip
    Adapter(
        "a projection of the embeddings before the first layer (RemBERT, RoC-BERT), whole",
        encoder_layers.holds_embedding_projection,
        encoder_layers.embedding_projection,
        passes_on=True,
    ),  # fmt: skip
    Adapter(
        "BERT-family LM prediction head (a transform beside the LM head, whole)",
        encoder_layers.is_prediction_head,
        encoder_layers.prediction_head,
    ),  # fmt: skip
    Adapter(
        "BERT-style attention (self: query / key / value, output: dense)",
        encoder_layers.is_self_output_attention,
        encoder_layers.self_output_attention,
    ),  # fmt: skip
    Adapter(
        "BERT-style MLP (intermediate.dense, output.dense)",
        encoder_layers.is_intermediate_output_mlp,
        encoder_layers.intermediate_output_mlp,
    ),  # fmt: skip
    Adapter("gated MLP", lambda m: has_linears(m, ("gate_proj", "up_proj", "down_proj")), mlp.gated_mlp),
    Adapter("T5's gated MLP (wi_0, wi_1, wo)", mlp.is_t5_gated_mlp, mlp.t5_gated_mlp),
    Adapter("GPT-2 MLP", lambda m: has_conv1ds(m, ("c_fc", "c_proj")), mlp.gpt2_mlp),
    Adapter("two-layer MLP", lambda m: mlp.two_layer_pair(m) is not None, mlp.two_layer_mlp),
    Adapter(
        "shared-expert gate (Qwen2-MoE)",
        lambda m: has_linears(m, ("shared_expert_gate",)) and m.shared_expert_gate.out_features == 1,
        mlp.shared_expert_gate,
    ),
)
