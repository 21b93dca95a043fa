"""tiny_config(model_type): any transformers model type's default config with every size field
shrunk, for a random model small enough to run on a CPU at several ranks.

A config class names its sizes its own way (`d_model`, `n_embd`, `lru_width`, `kv_lora_rank`,
`index_n_heads`, `linear_num_value_heads`, a vision tower's `hidden_size`), and composite configs
hold others (text, vision, audio). The fields are read from the config's dataclass, sub-configs
included, and each is capped by its kind, found from its name. Shrinking only ever lowers a size,
and sizes of one kind share a cap, so sizes that were equal stay equal (a width that must equal
the hidden size, a rotary width that is the head width). Fields left at None are derived again by
the config from the shrunk ones; per-layer lists are cut to layers that keep every kind of layer
the model has.
"""

import copy
import dataclasses
import re
import warnings

VOCAB = 128
# Token ids the model gives a meaning (image, audio, video, boundaries) go at the top of the
# vocabulary, above every id a test batch draws; the common ones at the bottom, as most configs have them.
LOW_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
           "forced_eos_token_id": 2, "unk_token_id": 0, "sep_token_id": 2, "cls_token_id": 1}  # fmt: skip
MEANINGFUL_IDS = 16  # the top ids of the vocabulary, held for the model's special tokens
# (pattern, cap): the first whose pattern matches a field's whole name caps it. Order matters: the
# specific names come before the generic ones.
CAPS = [
    (r".*(token_id|token_index)|image_patch_id", None),  # ids (Molmo 2 names its image token a patch id): placed below
    (r".*vocab.*|codebook_size|num_buckets|.*_buckets|n_langs", VOCAB),
    (r"(q|o)_lora_rank", 16),
    (r"kv_lora_rank", 12),
    (r".*_rank|hc_lowrank|dt_rank|time_step_rank", 8),
    (r".*(head_?dim|head_size|_d_head|d_head|d_kv|dim_head|d_rel|rotary_dim|query_pre_attn_scalar)", 8),
    (r".*(key_value_heads|kv_heads|kv_n_heads|num_key_heads|key_heads|kv_groups|n_groups|ngroups)", "kv_heads"),
    (r"o_groups", "kv_heads"),  # DeepSeek-V4's groups of heads in its output projection
    (r".*(heads|n_head|attention_heads)", "heads"),
    (r"num_experts_per_tok|moe_k|moe_top_?k|top_?k|num_selected_experts|index_topk.*|cross_attn_k|index_kpool", 2),
    (r".*(shared_experts)", 1),
    (r".*(experts|expert_num)", 4),
    (r"n_group|topk_group", 1),
    (r"first_k_dense_replace|num_dense_layers|n_layers_per_attn_res_block", "dense_layers"),
    (r"num_kv_shared_layers", None),  # set by the layer cut: one layer of each kind shares its cache
    (r"(mamba_)?expand", 1),  # state-space inner width = heads x head width = hidden size
    (r".*(layers|n_layer|_layers|depth|num_blocks)", "layers"),
    (r".*(intermediate.*|ffn.*|d_ff|dff|dim_ff|mlp_dim|feed_forward_size|n_inner|d_inner)", "ffn"),
    (r"mamba_d_ssm", "width"),  # the state-space inner width: heads x head width
    (r".*(state_size|d_state)", 8),
    (r"num_codebooks", 2),
    (r"mm_tokens_per_image", 4),  # Gemma 3: the tower's patches pooled to 2 x 2 tokens
    (r"max_position_embeddings|original_max_position_embeddings|n_positions|n_ctx|max_seq_len|max_.*_positions"
     r"|num_position_embeddings|context_length", 64),
    (r".*(hidden_size.*|d_model|n_embd|embed_dim|embedding_dim|embedding_size|emb_dim|_width|_channels?|"
     r"channels|hidden_dim|_dim|dim|kv_channels|feature_size|num_filters|adapter_.*_size)", "width"),
]  # fmt: skip
CAPPED_TOGETHER = {"num_key_value_heads", "num_kv_heads", "head_dim", "qk_head_dim"}  # see _capped
QSA = dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2)
# Configs whose defaults build no model (fields left None that the modeling code reads, a pattern longer
# than the cut depth) get those fields set, at tiny sizes; a few need more than one layer of a kind.
DIGITS_AS_LETTERS = str.maketrans("0123456789", "ABCDEFGHIJ")
COMPASS_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}  # left None, read per layer type
BLIP_IDS = dict(image_token_index=VOCAB - 1, vision_config=dict(initializer_range=0.02))


def _davit(caps):
    """Florence-2's DaViT tower names its sizes per stage (lists the caps leave alone): four stages as
    wide as the width, one block each, its heads and channel groups the heads."""
    if "width" not in caps or "heads" not in caps:
        return {}
    stages = dict(embed_dim=caps["width"], num_heads=caps["heads"], num_groups=caps["heads"], depths=1)
    return {"vision_config": {k: [v] * 4 for k, v in stages.items()}}


def _sam_neck(caps):
    return {"vision_config": {"sam_config": {"downsample_channels": [caps["width"]] * 2}}} if "width" in caps else {}


QUIRKS = {
    "cohere_compass_text": dict(rope_parameters=COMPASS_ROPE),
    "cohere_compass": dict(text_config=dict(rope_parameters=COMPASS_ROPE)),
    "molmo2": dict(adapter_config=dict(vision_feature_layer=[1, 0])),  # the tower's layers it reads, cut with it
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # Qwen4-Exp's query-sparse attention indexer: transformers' config leaves its sizes None; at the
    # published widths, 8 scoring heads as wide as the attention's (its validation wants the rotary width)
    "qwen4_exp_text": lambda caps: QSA if "width" in caps else dict(QSA, indexer_n_heads=8, indexer_head_dim=256),
    "qwen4_exp": lambda caps: dict(text_config=QSA if "width" in caps else dict(QSA, indexer_head_dim=256)),
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),  # the per-layer pattern, repeated
    "reformer": lambda caps: dict(
        axial_pos_shape=[2, 4],
        axial_pos_embds_dim=[caps["width"] // 2] * 2,
        local_attn_chunk_length=4,
        lsh_attn_chunk_length=4,
    ),  # fmt: skip
    # Llama 4's pixel shuffle (ratio 1/2) makes 4 x the tower's width, its adapter's input
    "llama4": lambda caps: dict(vision_config=dict(intermediate_size=4 * caps["width"])) if "width" in caps else {},
    # Muse's pixel shuffle (merge 2) folds 2 x 2 patches into its adapter's input: 4 x the tower's width
    **dict.fromkeys(
        ("muse_spark", "muse_glimmer"), lambda caps: dict(out_hidden_size=4 * caps["width"]) if "width" in caps else {}
    ),
    # defaults left None that the models read: one dense and one sparse MLP layer; experts of their own
    # (DeepSeek-OCR 2's and Unlimited-OCR's SAM necks downsample into their encoders' width)
    "deepseek_ocr2": lambda caps: dict(
        text_config=dict(mlp_layer_types=["dense", "sparse"], num_experts_per_tok=2), **_sam_neck(caps)
    ),
    "unlimited_ocr": lambda caps: _sam_neck(caps),
    "diffusion_gemma": lambda caps: dict(
        text_config=dict(num_experts=4, top_k_experts=2, moe_intermediate_size=caps.get("ffn"))
    ),
    # image / audio tokens are codebook indices offset into the vocabulary: their ranges packed below its top ids
    "apertus1p5": dict(
        image_token_offset=64,
        audio_token_offset=96,
        vision_config=dict(codebook_size=32),
        audio_config=dict(codebook_size=16),
    ),  # fmt: skip
    # image tokens as codebook indices mapped to vocabulary ids by name (VQ tokenizers): 32 codes at ids 64-95
    "chameleon": dict(
        vq_config=dict(num_embeddings=32),
        vocabulary_map={  # code 12: IMGIMGBCZ (digits as A-J)
            "<image>": 120,
            **{"IMGIMG" + str(c).translate(DIGITS_AS_LETTERS) + "Z": 64 + c for c in range(32)},
        },
    ),
    "emu3": dict(
        vq_config=dict(codebook_size=32),
        vocabulary_map={
            "<image>": 120,
            "<|extra_200|>": 121,
            **{f"<|visual token {c:06d}|>": 64 + c for c in range(32)},
        },
    ),
    # published checkpoints mark the query tokens' places in the text (Salesforce/blip2-opt-2.7b: 50265, an
    # added token); transformers' default leaves it None: the tiny vocabulary's top id. Their towers' default
    # init (std 1e-10) leaves a random model's LayerNorms dividing by ~0 (gradients of 1e17): the usual 0.02
    "blip-2": lambda caps: BLIP_IDS if "width" in caps else {},
    "instructblip": lambda caps: BLIP_IDS if "width" in caps else {},
    "instructblipvideo": lambda caps: (
        dict(BLIP_IDS, image_token_index=None, video_token_index=VOCAB - 1) if "width" in caps else {}
    ),
    # MiniCPM-V / OCR and Nemotron-H Omni merge images only where the config names their token (published
    # checkpoints do; transformers' default leaves it None): the tiny vocabulary's top id
    **dict.fromkeys(
        ("minicpmv4_6", "minicpmv4_7", "minicpm_ocr", "nemotron_h_omni"), lambda caps: dict(image_token_id=VOCAB - 1)
    ),
    # the tower's layers the projector reads (published: -2, -5, -8, -11, 6), within the cut depth
    "vipllava": dict(vision_feature_layer=[-2, -1]),
    # the number of query tokens per count of patches: the tiny image's 4 x 4 patches
    "florence2": lambda caps: _davit(caps),
    "aria": lambda caps: dict(projector_patch_to_query_dict={16: 4}) if "width" in caps else {},
    # Mllama's tower outputs its last and its one kept intermediate layer's states side by side
    "mllama": lambda caps: dict(vision_config=dict(vision_output_dim=2 * caps["width"])) if "width" in caps else {},
    # Step 3.7 builds its sliding-window mask whether or not a layer slides: a window, one layer of each kind
    "step3p7": dict(text_config=dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    # PaddleOCR-VL's and ERNIE 4.5-VL's modeling code falls back to the published heads' mrope sections where
    # their configs name none: sections of the tiny head's rotary half (ERNIE's: height and width alike)
    "paddleocr_vl": lambda caps: (
        dict(text_config=dict(rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1])))
        if "width" in caps
        else {}
    ),
    "ernie4_5_vl_moe": lambda caps: (
        dict(text_config=dict(rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2])))
        if "width" in caps
        else {}
    ),
    # the shared transformer is one module tied over the hybrid layers: two of them
    "zamba": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"]),
}
IMAGE_PATCHES = 4  # a vision tower's image: 4 x 4 patches
DEPTH = dict(layers=2, dense_layers=1)  # the depth caps: alone, the published widths with a cut depth
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers")
# kept at their defaults (Kimi-K2.5's position grid: its height and width alike, not a width to shrink)
KEEP = {"conv1d_width", "num_channels", "in_channels", "out_channels", "audio_channels", "conv_kernel_size",
        "pos_emb_height", "pos_emb_width"}  # fmt: skip


def tiny_config(model_type: str, heads: int = 4, **overrides):
    """The default config of `model_type` with every size field shrunk (see the module's doc),
    then `overrides` set (they win). `heads` query heads of 8 (half as many key/value heads), so a
    hidden size of 8 x `heads` and an MLP of twice that: pass at least the tensor-parallel size.
    Raises whatever the config class raises where it refuses."""
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = tf.CONFIG_MAPPING[model_type]
        caps = dict(DEPTH, heads=heads, kv_heads=max(1, heads // 2), width=8 * heads, ffn=16 * heads)
        return _shrunk(cls, _defaults(cls), _merged(_quirks(model_type, caps), overrides), caps)


def published_config(model_type: str, **overrides):
    """The default config of `model_type` (the published checkpoint's widths, vocabulary, heads and
    experts, as transformers ships it) with only its depth cut, as `tiny_config` cuts it: for
    per-rank memory at the published sizes, on the meta device."""
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = tf.CONFIG_MAPPING[model_type]
        return _shrunk(cls, _defaults(cls), _merged(_quirks(model_type, DEPTH), overrides), DEPTH)


def _quirks(model_type, caps) -> dict:
    quirks = QUIRKS.get(model_type, {})
    return copy.deepcopy(quirks(caps) if callable(quirks) else quirks)


def _merged(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for name, value in overrides.items():
        out[name] = _merged(out[name], value) if isinstance(value, dict) and isinstance(out.get(name), dict) else value
    return out


def _defaults(cls) -> dict:
    """{field: default} of a config dataclass, without building it (some defaults do not validate)."""
    out = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if field.default is not dataclasses.MISSING:
            out[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            out[field.name] = field.default_factory()
    return out


def _shrunk(cls, values: dict, overrides: dict, caps: dict):
    from transformers import PretrainedConfig

    try:  # its own defaults, sub-configs and derived fields
        built = cls(**values)
    except Exception:  # defaults that do not validate without the quirks' fields
        built = cls(**{**values, **copy.deepcopy(overrides)})
    state = vars(built)
    before = next((state[k] for k in LAYER_COUNTS if type(state.get(k)) is int), None)
    kwargs = {}
    for name, default in values.items():
        value = state.get(name, default)
        if isinstance(value, PretrainedConfig):
            kwargs[name] = _shrunk(type(value), _sub_values(value), overrides.pop(name, {}), caps)
        elif (
            default is None
            and value is not None
            and not (_per_layer(value, before) or before and _layer_indices(name, value, before))
        ):
            continue  # derived from other fields by the config: derived again from the shrunk ones
        else:
            kwargs[name] = value
    spec = state.get("_heterogeneity_spec")  # a heterogeneous config: sizes that differ per layer
    per_layer, capped = {}, _capped(kwargs, caps)
    for i, sizes in (spec.per_layer_overrides if spec else {}).items():  # capped with the global sizes around
        layer = _capped({**kwargs, **sizes}, caps)
        per_layer[int(i)] = {k: v for k, v in layer.items() if k in sizes or (k in CAPPED_TOGETHER and v != capped[k])}
    kwargs = capped
    if "head_dim" in kwargs and kwargs["head_dim"] is None and kwargs.get("num_attention_heads"):
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]  # as checkpoints set it
    layers = next((k for k in LAYER_COUNTS if type(kwargs.get(k)) is int), None)
    if layers is not None and before is not None and before > kwargs[layers]:
        per_layer = _cut_layers(kwargs, layers, before, per_layer)
    if spec:
        kwargs["per_layer_config"] = per_layer
    if set(caps) != set(DEPTH):
        _place_ids(kwargs)
        _multimodal_rope(cls, kwargs)
        _one_tile(cls, kwargs)
    kwargs.update(overrides)
    return cls(**kwargs)


def _capped(values: dict, caps: dict) -> dict:
    out = {name: _cap(name, value, caps) if type(value) is int else value for name, value in values.items()}
    heads = values.get("num_attention_heads")
    for name in ("num_key_value_heads", "num_kv_heads"):  # as many key/value heads as query heads stays so
        if heads is not None and values.get(name) == heads:
            out[name] = out["num_attention_heads"]
    if "width" in caps:  # an image of IMAGE_PATCHES x IMAGE_PATCHES patches (whole merges of 2 x 2 too)
        image, patch = values.get("image_size"), values.get("patch_size")
        if type(image) is int and type(patch) is int:
            out["image_size"] = min(image, IMAGE_PATCHES * patch)
        elif isinstance(image, list | tuple) and isinstance(patch, list | tuple) and len(image) == len(patch):
            out["image_size"] = type(image)(min(i, IMAGE_PATCHES * p) for i, p in zip(image, patch, strict=True))
    parts = [values.get(name) for name in ("qk_nope_head_dim", "qk_rope_head_dim")]
    for name in ("head_dim", "qk_head_dim"):  # a query/key head of [no-rope | rope] widths stays their sum
        if None not in parts and values.get(name) == sum(parts):
            out[name] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    return out


def _per_layer(value, layers) -> bool:
    """A list with one entry per layer (`layer_types`, `no_rope_layers=[1, 1, 1, 0, ...]`)."""
    return isinstance(value, (list, tuple)) and layers is not None and len(value) == layers and not _indices(value)


def _layer_indices(name, value, layers) -> bool:
    """A list of layer indices (`mlp_only_layers=[0, 1]`, `moe_layers`, `hybrid_layer_ids`, SAM's
    `global_attn_indexes`, `window_block_indexes`)."""
    return (
        ("layer" in name or name.endswith(("attn_indexes", "block_indexes")))
        and isinstance(value, (list, tuple))
        and _indices(value)
        and all(i < layers for i in value)
    )


def _indices(value) -> bool:
    return all(type(i) is int and i >= 0 for i in value) and all(a < b for a, b in zip(value, value[1:], strict=False))


def _sub_values(config) -> dict:
    state = vars(config)
    return {name: state.get(name, default) for name, default in _defaults(type(config)).items()}


def _cap(name: str, value: int, caps: dict) -> int:
    if name in KEEP:
        return value
    for pattern, cap in CAPS:
        if re.fullmatch(pattern, name):
            if cap is None or (type(cap) is int and set(caps) == set(DEPTH)) or (type(cap) is str and cap not in caps):
                return value  # an id, or a width where only the depth is cut
            value = min(value, caps.get(cap, cap))
            while cap in ("heads", "kv_heads") and caps["width"] % value:  # heads that split the width
                value -= 1
            return value
    return value


def _cut_layers(kwargs: dict, count: str, before: int, per_layer: dict) -> dict:
    """Cut the depth, keeping the first layer of each value of each per-layer entry (a list with
    an entry per layer, a list of layer indices, its own sizes), then the first layers, up to the
    capped count at least. A model whose last layers reuse earlier layers' key/value cache keeps a
    producer and a reuser of each kind.
    Returns the per-layer sizes of the layers kept, by their new index."""
    lists = [k for k, v in kwargs.items() if _per_layer(v, before)]
    index_lists = [k for k, v in kwargs.items() if _layer_indices(k, v, before)]
    features = [
        {(k, str(kwargs[k][i])) for k in lists}
        | {(k, i in kwargs[k]) for k in index_lists}
        | {("sizes", str(sorted(per_layer.get(i, {}).items())))}
        for i in range(before)
    ]
    keep, seen = [], set()
    for i, layer in enumerate(features):  # each value of each per-layer entry, on the first layer that has it
        if not layer <= seen:
            keep.append(i)
            seen |= layer
    keep += [i for i in range(before) if i not in keep][: max(0, kwargs[count] - len(keep))]
    shared = kwargs.get("num_kv_shared_layers")
    if shared and shared < before:  # the last `shared` layers reuse the cache of the last earlier one of their kind
        kinds = {}
        for i, layer in enumerate(features):
            kinds.setdefault(frozenset(layer), []).append(i)
        keep = [indices[0] for indices in kinds.values()] + [indices[-1] for indices in kinds.values()]
        kwargs["num_kv_shared_layers"] = len(kinds)
    elif shared:  # every layer reuses a cache it is given
        kwargs["num_kv_shared_layers"] = len(set(keep))
    keep = sorted(set(keep))
    for k in lists:
        kwargs[k] = type(kwargs[k])(kwargs[k][i] for i in keep)
    for k in index_lists:
        kwargs[k] = type(kwargs[k])(new for new, old in enumerate(keep) if old in kwargs[k])
    kwargs[count] = len(keep)
    return {new: per_layer[old] for new, old in enumerate(keep) if old in per_layer}


def _one_tile(cls, kwargs: dict):
    """LLaVA-NeXT's any-resolution grids: one tile of the shrunk tower's image (the processor then
    makes the base image and that tile)."""
    vision = kwargs.get("vision_config")
    size = getattr(vision, "image_size", None)
    if type(size) is int and "image_grid_pinpoints" in {f.name for f in dataclasses.fields(cls)}:
        kwargs["image_grid_pinpoints"] = [[size, size]]


def _multimodal_rope(cls, kwargs: dict):
    """Multimodal rotary embeddings (Qwen-VL's mrope): the rotary half of a head in three sections
    (time, height, width) summing to the shrunk head's; the modeling code's defaults fit published heads."""
    rope, heads = kwargs.get("rope_parameters"), kwargs.get("num_attention_heads")
    if not (rope and isinstance(rope, dict) and "mrope_section" in getattr(cls, "ignore_keys_at_rope_validation", ())):
        return
    head = kwargs.get("head_dim") or (kwargs.get("hidden_size", 0) // heads if heads else 0)

    def sections(params):
        factor = params.get("partial_rotary_factor", kwargs.get("partial_rotary_factor")) or 1.0
        half = int(head * factor) // 2
        return dict(params, mrope_section=[half - 2 * (half // 3), half // 3, half // 3])

    per_type = all(isinstance(v, dict) for v in rope.values())  # {layer type: parameters}
    kwargs["rope_parameters"] = {k: sections(v) for k, v in rope.items()} if per_type else sections(rope)


def _place_ids(kwargs: dict):
    from transformers import PretrainedConfig

    parts = [vars(v).get("vocab_size") for v in kwargs.values() if isinstance(v, PretrainedConfig)]
    vocab = kwargs.get("vocab_size") or next((v for v in parts if type(v) is int), None)  # a composite's text part
    if type(vocab) is not int:
        return
    top = vocab - 1
    for name, value in kwargs.items():
        if not re.fullmatch(CAPS[0][0], name) or value is None:
            continue
        if name in LOW_IDS:
            low = LOW_IDS[name]
            kwargs[name] = [low] if isinstance(value, list) else low
        elif type(value) is int and value >= vocab - MEANINGFUL_IDS:
            kwargs[name] = top
            top -= 1
