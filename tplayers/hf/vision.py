"""Vision-language models: the modules beside the language model (vision towers, projectors).

A tower and its projector see an image's patches, not the text's sequence. They are split by
heads and features like the text layers (their attention and MLPs match the same adapters), but
never by sequence: sequence parallelism cuts the language model's sequence only, at its first
block, after the image features are merged into it. Projectors are column / row pairs; a tower's
other linear layers (a one-linear projector, a patch merger's) column-parallel with their output
gathered; nn.MultiheadAttention (in SigLIP's pooling head), which reads its weights itself, whole.
"""

import functools
import inspect
import math
import re

import torch
from torch import nn

from tplayers.hf.attention import _finish_attention, _fused_qkv, _per_head_weights
from tplayers.hf.shard import ShardingPass
from tplayers.hf.source import forward_source, source

# Sub-configs of a model that takes more than text: a tower per kind of input
TOWER_CONFIGS = ("vision_config", "audio_config", "vision_tower_config", "speech_config", "vq_config")


def towers(model) -> list[str]:
    """The modules beside the language model of a model with a vision (or audio) sub-config: every
    child with weights along the path from the model to its decoder (`get_decoder()`), other than
    that path and the LM head. Empty for a text model."""
    config = getattr(model, "config", None)
    if not any(getattr(config, key, None) is not None for key in TOWER_CONFIGS) and _vision_config(model) is None:
        return []
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    path = next((name for name, m in model.named_modules() if m is decoder), "")
    if not path:
        return []
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    parts, out = path.split("."), [f"{path}.{child}" for child in INNER_TOWERS.get(type(decoder).__name__, ())]
    for depth in range(len(parts)):
        parent = ".".join(parts[:depth])
        on_path = ".".join(parts[: depth + 1])
        for child, module in (model.get_submodule(parent) if parent else model).named_children():
            full = f"{parent}.{child}" if parent else child
            if full != on_path and module is not head and any(True for _ in module.parameters()):
                out.append(full)
    return out


# Decoders that hold their towers themselves (GIT's model embeds the image, projects it and runs the
# text decoder over [image tokens; text tokens]; Idefics' cross-attends to its perceiver's latents)
INNER_TOWERS = {
    "GitModel": ("image_encoder", "visual_projection"),
    "IdeficsModel": ("vision_model", "perceiver_resampler"),
    "Phi4MultimodalModel": ("embed_tokens_extend",),  # its image and audio encoders with their projections
}


def _vision_config(model):
    """The config of the model's vision tower: its `vision_config`; an image encoder's config where
    the model's main input is the image (VisionEncoderDecoderModel: TrOCR, Donut, Nougat); the
    model's own where it names its patches itself (`_patches_in_config`). None for a text model."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is not None:
        return config.vision_config
    encoder = getattr(config, "encoder", None)
    if getattr(model, "main_input_name", None) == "pixel_values" and hasattr(encoder, "to_dict"):
        return encoder
    return config if _patches_in_config(model) else None


def _patches_in_config(model) -> bool:
    """A model that takes images without a vision sub-config (Fuyu: its patch size, channels and image
    token on its own config, its patches embedded by one linear layer): `get_image_features` and an
    image token."""
    config = getattr(model, "config", None)
    return (type(getattr(config, "patch_size", None)) is int and type(getattr(config, "image_token_id", None)) is int
            and callable(_features_fn(model)))  # fmt: skip


# linear_2(act(linear_1(x))) in the projector's forward, each step on the last one's output
_TWO_LAYER = re.compile(r"(\w+) = self\.linear_1\((\w+)\)\s*\n\s*\1 = self\.act\(\1\)\s*\n\s*\1 = self\.linear_2\(\1\)")


def is_two_layer_projector(module) -> bool:
    """LLaVA-style projectors (LLaVA, LLaVA-NeXT / OneVision, InternVL, Mistral 3, ...): linear_1, an
    elementwise activation without weights, linear_2, read in the forward."""
    if not all(isinstance(getattr(module, k, None), nn.Linear) for k in ("linear_1", "linear_2")):
        return False
    act = getattr(module, "act", None)
    return (
        isinstance(act, nn.Module)
        and not any(True for _ in act.parameters())
        and bool(_TWO_LAYER.search(forward_source(module)))
    )


def two_layer_projector(sp: ShardingPass, name, module):
    """linear_1 column-, linear_2 row-parallel; the module's own forward runs, and the walk goes on
    to whatever else it holds (a norm before them, a patch merger)."""
    sp.column(f"{name}.linear_1", module.linear_1)
    sp.row(f"{name}.linear_2", module.linear_2)


# qkv(x).reshape(tokens, 3, self.num_heads, -1): [q; k; v] row blocks, each head by head
_QKV_BY_HEADS = re.compile(r"self\.qkv\(\w+\)\.reshape\(\w+, 3, self\.num_heads, -1\)")


def is_qkv_by_heads_attention(module) -> bool:
    """Qwen-VL's vision attention (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the towers copied from them):
    one qkv projection the forward reshapes by `self.num_heads`, then proj; read in the forward."""
    return (
        all(isinstance(getattr(module, k, None), nn.Linear) for k in ("qkv", "proj"))
        and type(getattr(module, "num_heads", None)) is int
        and bool(_QKV_BY_HEADS.search(forward_source(module)))
    )


def qkv_by_heads_attention(sp: ShardingPass, name, attn):
    """qkv column-parallel by whole heads of each of q, k and v (`_fused_qkv`), proj row-parallel by
    the same heads, norms acting on each head alike replicated; the forward reshapes by the local
    head count."""
    heads = attn.num_heads
    head_dim = attn.qkv.out_features // (3 * heads)
    local_heads, _ = _fused_qkv(sp, name, attn, "qkv", "proj", heads, heads, head_dim)
    _per_head_weights(sp, name, attn, head_dim, ("qkv", "proj"))  # GLM-5-Next's q / k norms per head
    _finish_attention(sp, name, attn, {"num_heads": local_heads})


# Activations without weights that act on each element alone, as modules
_ELEMENTWISE = {"GELU", "SiLU", "ReLU", "Tanh", "Sigmoid", "Mish", "GELUActivation", "QuickGELUActivation",
                "SiLUActivation", "NewGELUActivation", "GELUTanh", "PytorchGELUTanh"}  # fmt: skip


def is_sequential_mlp(module) -> bool:
    """nn.Sequential(Linear, elementwise activation, Linear): Qwen2-VL's and Qwen2.5-VL's patch mergers."""
    return (
        type(module) is nn.Sequential
        and len(module) == 3
        and isinstance(module[0], nn.Linear)
        and type(module[1]).__name__ in _ELEMENTWISE
        and isinstance(module[2], nn.Linear)
    )


def sequential_mlp(sp: ShardingPass, name, module):
    sp.column(f"{name}.0", module[0])
    sp.row(f"{name}.2", module[2])


def is_projected_gated_merger(module) -> bool:
    """GLM-4V's patch merger (a projection and a norm before a gated MLP), with its forward line for
    line (GLM-4.1V / 4.5V / 4.6V and GLM-OCR copy it), or GLM-5-Next's (its gate and up clamped: each
    element alike)."""
    if not type(module).__name__.endswith("VisionPatchMerger"):
        return False
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionPatchMerger
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionPatchMerger

    return forward_source(module) in (source(Glm4vVisionPatchMerger.forward), source(Glm5NextVisionPatchMerger.forward))


def projected_gated_merger(sp: ShardingPass, name, merger):
    """`proj` and `post_projection_norm` whole on every rank (they act on the whole input before the
    split; their gradients, partial as the gated MLP's input gradient is on each rank, summed), then
    gate / up column-parallel and down row-parallel."""
    for child in ("proj", "post_projection_norm"):
        sp.done.add(f"{name}.{child}")
        sp.whole.add(f"{name}.{child}")
        sp.partial_grads.extend(getattr(merger, child).parameters())
    for proj in ("gate_proj", "up_proj"):
        sp.shared_input_column(f"{name}.{proj}", getattr(merger, proj))
    sp.row(f"{name}.down_proj", merger.down_proj)
    sp.shared_input.append(merger)
    sp.done.add(name)


# Modules of towers kept whole on every rank, by class: nn.MultiheadAttention (SigLIP's pooling
# head's attention; its MLP splits as any two-layer MLP) reads its projections' weights itself.
# A tower's other linear layers no adapter places are column-parallel with their output gathered
# (ShardingPass.tower_linears).
WHOLE = {"MultiheadAttention"}


def is_kept_whole(module) -> bool:
    return type(module).__name__ in WHOLE


def keep_whole(sp: ShardingPass, name, module):
    sp.done.add(name)
    sp.whole.add(name)


def _special_ids(config) -> set[int]:
    """The token ids a config gives a meaning (image, video, boundaries), its text config's included."""
    configs = [config, getattr(config, "text_config", None)]
    return {
        v
        for c in configs
        if c is not None
        for k, v in vars(c).items()
        if type(v) is int and (k.endswith("_token_id") or k.endswith("_token_index"))
    }


def _names(fn, name) -> bool:
    """Whether `fn` takes `name` by its own name (not merely through **kwargs)."""
    return name in inspect.signature(fn).parameters


def _image_tokens(features) -> int:
    """How many token embeddings `get_image_features` gave (one vector each, whatever its width),
    whatever it returns them in: a tensor, a list per image, an output's pooler_output or, where
    that is None, its last_hidden_state (Llama 4, which projects them afterwards)."""
    pooled = getattr(features, "pooler_output", features)
    features = getattr(features, "last_hidden_state", None) if pooled is None else pooled
    parts = features if isinstance(features, list | tuple) else [features]
    return sum(f.numel() // f.shape[-1] for f in parts)


def _first_int(config, names, default):
    return next((v for k in names if type(v := getattr(config, k, None)) is int), default)


# The grids that name a processor's flat-patch layouts (Qwen-VL, RADIO, SigLIP 2, MiniCPM-V's NaViT)
FLAT_PATCH_GRIDS = ("image_grid_thw", "image_grid_hw", "spatial_shapes", "target_sizes")


def _probe_pixels(vision_config, get, batch, generator) -> list[dict]:
    """One random image per row in each layout a processor makes that fits the tower's config, to be
    tried in order: Qwen-VL's flattened patches with `image_grid_thw` (2 x 2 merges of patches; or
    each patch an image, Kimi-K2.5's); RADIO's with `image_grid_hw`; SigLIP 2's flat patches with
    `spatial_shapes` (4 x 4); MiniCPM-V's NaViT row with `target_sizes`; else (batch, channels, height,
    width) at the tower's `image_size` (with `image_sizes` where `get_image_features` names them),
    then (batch, images, channels, height, width) with one image a row (Idefics, SmolVLM; with
    `pixel_attention_mask` by pixel, or Granite-Docling's by tile), then with its base image and one
    tile (LLaVA-NeXT's any resolution, with `image_sizes`); Kosmos-2.5's flattened patches, Molmo 2's
    pooled crop. Empty: none fits."""
    channels = next(
        (v for k in ("num_channels", "in_channels", "in_chans") if type(v := getattr(vision_config, k, None)) is int), 3
    )
    patch = getattr(vision_config, "patch_size", None)
    if any(_names(get, grid) for grid in FLAT_PATCH_GRIDS) and type(patch) is not int:
        return []  # flat patches, the size of which the tower does not name
    if _names(get, "image_grid_thw"):
        merge = _first_int(vision_config, ("spatial_merge_size", "merge_size"), 1)  # Muse's names them otherwise
        frames = _first_int(vision_config, ("temporal_patch_size", "patch_temporal"), 1)
        if not all(type(v) is int for v in (merge, frames)):
            return []
        kernel = getattr(vision_config, "merge_kernel_size", None)  # Kimi-K2.5's (height, width) merge
        merge = kernel[0] if isinstance(kernel, list | tuple) and type(kernel[0]) is int else merge
        side = 2 * merge
        pixels = torch.randn(batch * side * side, channels * frames * patch * patch, generator=generator)
        grid = {"image_grid_thw": torch.tensor([[1, side, side]] * batch)}
        if _names(get, "image_merge_sizes"):  # VideoLLaMA 3: each image's merge, named beside its grid
            grid["image_merge_sizes"] = torch.tensor([merge] * batch)
        # each patch flattened (Qwen-VL), or as an image of its own (Kimi-K2.5's MoonViT), or each merged token's
        # pixels a square, channels last, the grid counting tokens (Inkling 2)
        layouts = [{"pixel_values": pixels, **grid}]
        if frames == 1:
            tokens = {**grid, "image_grid_thw": torch.tensor([[1, 2, 2]] * batch)}
            layouts += [
                {"pixel_values": pixels.view(-1, channels, patch, patch), **grid},
                {"pixel_values": pixels.view(-1, merge * patch, merge * patch, channels), **tokens},
            ]
        return layouts
    if _names(get, "image_grid_hw"):  # RADIO's flattened patches with their (height, width) grid (Nemotron-H Omni)
        side = 4  # 4 x 4 patches: a 2 x 2 pixel shuffle divides it
        pixels = torch.randn(batch * side * side, channels * patch * patch, generator=generator)
        return [{"pixel_values": pixels, "image_grid_hw": torch.tensor([[side, side]] * batch)}]
    if _names(get, "spatial_shapes"):  # SigLIP 2's native resolution (LFM2-VL): flat patches, their grid, a mask
        side = 4  # 4 x 4 patches: a pixel-shuffle factor of 2 or 4 divides it
        return [
            {
                "pixel_values": torch.randn(batch, side * side, channels * patch * patch, generator=generator),
                "spatial_shapes": torch.tensor([[side, side]] * batch),
                "pixel_attention_mask": torch.ones(batch, side * side, dtype=torch.bool),
            }
        ]
    if _names(get, "target_sizes"):  # MiniCPM-V's NaViT packing: every image's patches side by side in one row
        side = 8  # 8 x 8 patches: its two 2 x 2 merges leave 2 x 2 tokens an image
        return [
            {
                "pixel_values": torch.randn(1, channels, patch, batch * side * side * patch, generator=generator),
                "target_sizes": torch.tensor([[side, side]] * batch),
            }
        ]
    if _names(get, "flattened_patches"):  # Kosmos-2.5's (Pix2Struct's layout): [row, column, patch] a row, ids from 1
        width = getattr(vision_config, "patch_embed_hidden_size", None)
        if type(width) is not int:
            return []
        side = 4
        grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).view(-1, 2) + 1
        pixels = torch.randn(batch, side * side, width, generator=generator)
        return [{"flattened_patches": torch.cat([grid.float().expand(batch, -1, -1), pixels], -1)}]
    if _names(get, "image_token_pooling") and _names(get, "image_grids"):
        return _pooled_crop(vision_config, channels, patch, batch, generator)
    size = getattr(vision_config, "image_size", None)
    if size is None:  # a tower of parts, its size on one of their configs (DeepSeek-OCR 2's SAM encoder)
        parts = [v for v in vars(vision_config).values() if hasattr(v, "to_dict")]
        size = next((v for part in parts if (v := getattr(part, "image_size", None)) is not None), None)
    strides = getattr(vision_config, "patch_stride", None)
    if size is None and isinstance(strides, list | tuple) and all(type(v) is int for v in strides):
        size = 2 * math.prod(strides)  # a tower of strided stages (Florence-2's DaViT): its image made 2 x 2 tokens
    size = (size, size) if type(size) is int else tuple(size) if isinstance(size, list | tuple) else ()
    if len(size) != 2 or not all(type(v) is int for v in size):
        return []
    pixels = torch.randn(batch, channels, *size, generator=generator)
    flat = {"pixel_values": pixels}
    if _names(get, "image_sizes"):
        flat["image_sizes"] = torch.tensor([size] * batch)
    stacked = {"pixel_values": pixels.unsqueeze(1)}
    if _names(get, "pixel_attention_mask"):
        stacked["pixel_attention_mask"] = torch.ones(batch, 1, *size, dtype=torch.bool)
    layouts = [flat, stacked]
    if "pixel_attention_mask" in stacked:  # Granite-Docling's: one flag a tile, not a pixel mask
        layouts.append({**stacked, "pixel_attention_mask": torch.ones(batch, 1, dtype=torch.bool)})
    if _names(get, "image_sizes"):  # any-resolution tiles (LLaVA-NeXT): the base image and one tile
        layouts.append({"pixel_values": torch.stack([pixels, pixels.flip(-1)], 1), "image_sizes": flat["image_sizes"]})
    if type(patch) is int and size[0] % patch == 0 and size[1] % patch == 0:  # Fuyu's: the image as flat patches
        patches = pixels.unfold(2, patch, patch).unfold(3, patch, patch)  # (batch, channels, rows, cols, p, p)
        layouts.append({"pixel_values": patches.permute(0, 2, 3, 1, 4, 5).reshape(batch, -1, channels * patch * patch)})
    return layouts


def _pooled_crop(vision_config, channels, patch, batch, generator) -> list[dict]:
    """Molmo 2's: one crop a row as flat patches (as many as the tower has positions: they are fixed),
    pooled into a 2 x 2 grid of tokens (`image_grids` [2, 2, 0, 0]), each token pooling a quarter of
    the patches (`image_token_pooling`, indices into every row's patches flattened)."""
    patches = getattr(vision_config, "num_position_embeddings", None)
    if type(patch) is not int or type(patches) is not int or patches < 4:
        return []
    quarter = patches // 4
    pooling = torch.arange(batch * 4 * quarter).view(batch, 4, quarter)
    pooling += torch.arange(batch)[:, None, None] * (patches - 4 * quarter)  # each row's own patches
    return [
        {
            "pixel_values": torch.randn(batch, patches, channels * patch * patch, generator=generator),
            "image_token_pooling": pooling.view(batch * 4, quarter),
            "image_grids": torch.tensor([[2, 2, 0, 0]] * batch),
        }
    ]


def _other_inputs(config, get, batch, generator) -> dict:
    """What else `get_image_features` requires by name: images for a second tower (DeepSeek-VL
    hybrid's `high_res_pixel_values`, seen by the tower of its `high_res_vision_config`), at that
    tower's size; InstructBLIP's `qformer_input_ids` (the prompt in the Q-Former's vocabulary)."""
    out = {}
    for name, param in inspect.signature(get).parameters.items():
        qformer = getattr(config, "qformer_config", None)
        if name == "qformer_input_ids" and type(getattr(qformer, "vocab_size", None)) is int:
            out[name] = torch.randint(0, qformer.vocab_size, (batch, 4), generator=generator)
            out["qformer_attention_mask"] = torch.ones(batch, 4, dtype=torch.long)
            continue
        prefix = name.removesuffix("_pixel_values")
        tower = getattr(config, f"{prefix}_vision_config", None)
        if prefix == name or param.default is not param.empty or tower is None:
            continue
        size, channels = getattr(tower, "image_size", None), getattr(tower, "num_channels", 3)
        if type(size) is int and type(channels) is int:
            out[name] = torch.randn(batch, channels, size, size, generator=generator)
    return out


def _tiled_image(vision_config, ids, generator) -> list[dict]:
    """Mllama's image: one image a row in the first of its tiles (aspect ratio 1:1, id 1), every
    token of the text attending to it (`cross_attention_mask`); empty where the config lacks a size."""
    size, tiles = getattr(vision_config, "image_size", None), getattr(vision_config, "max_num_tiles", None)
    channels = _first_int(vision_config, ("num_channels",), 3)
    if type(size) is not int or type(tiles) is not int:
        return []
    batch, first = ids.shape[0], torch.zeros(tiles, dtype=torch.long)
    first[0] = 1
    return [
        {
            "pixel_values": torch.randn(batch, 1, tiles, channels, size, size, generator=generator),
            "aspect_ratio_ids": torch.ones(batch, 1, dtype=torch.long),
            "aspect_ratio_mask": first.expand(batch, 1, tiles).clone(),
            "cross_attention_mask": first.expand(batch, ids.shape[1], 1, tiles).clone(),
        }
    ]


def call_with_ids(model, ids, **kwargs):
    """model(ids, **kwargs), the ids passed by name where the forward takes `input_ids` after other
    inputs (BLIP-2's forward takes pixel_values first), as the decoder's where it takes no
    `input_ids` (Pix2Struct: the image is the encoder's input, the text the decoder's), as both the
    encoder's and the decoder's in an encoder-decoder that takes both (T5, BART)."""
    params = list(inspect.signature(model.forward).parameters)
    if "input_ids" not in params and "decoder_input_ids" in params:
        return model(decoder_input_ids=ids, **kwargs)
    if "decoder_input_ids" in params and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        kwargs.setdefault("decoder_input_ids", ids)  # the decoder's text too (T5 makes none from the encoder's)
    if "input_ids" in params and params[0] != "input_ids":
        return model(input_ids=ids, **kwargs)
    return model(ids, **kwargs)


def _no_image_tokens(model, ids, **images) -> torch.Tensor:
    """The model's forward on `ids` and `images` (a layout it takes, or it raises): none of the
    tokens are the image's (an empty tensor, as `_image_tokens` counts them)."""
    call_with_ids(model, ids, **images)
    return ids.new_zeros(0, 1)


def _features_fn(model, kind="image"):
    """The model's `get_image_features` (or `get_video_features`), or its base model's where only that
    has one (DeepSeek-VL, Janus, dots.ocr's successors) or where the base model's requires by name what
    the model's leaves to *args / **kwargs (MiniCPM-V's `target_sizes`, VideoLLaMA 3's
    `image_merge_sizes`): None where neither has."""
    owners = (model, getattr(model, "model", None))
    found = [get for owner in owners if callable(get := getattr(owner, f"get_{kind}_features", None))]
    if len(found) == 2:
        own, base = (inspect.signature(get).parameters for get in found)
        kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        if any(p.kind not in kinds and p.default is p.empty and k not in own for k, p in base.items()):
            return found[1]
    return found[0] if found else None


def probe_images(model, ids, n) -> tuple[torch.Tensor, dict]:
    """The self-check's probe batch for a model that takes images: one random image per row (the
    first layout of `_probe_pixels` the model's `get_image_features` takes), and the ids with that
    image's tokens first, as many as it makes of it, the row's length still a multiple of `n` (with
    `mm_token_type_ids` marking them where the model names that input). Text models: the ids as
    they are, no images. A model with a sharded tower whose images tplayers cannot make is refused:
    the self-check must see the tower."""
    config = getattr(model, "config", None)
    vision_config = _vision_config(model)
    if vision_config is None or not towers(model):
        return ids, {}
    name = f"{type(model).__name__} ({config.model_type})"
    token = _first_int(config, ("image_token_id", "image_token_index"), None)
    get = _features_fn(model)
    if token is None and get is None and _features_fn(model, "video"):  # a video model (InstructBLIP-Video)
        token, get = _first_int(config, ("video_token_id", "video_token_index"), None), _features_fn(model, "video")
    # Kosmos-2 marks its image's places with a mask beside the ids (any token id there), not an image token
    by_mask = token is None and _names(model.forward, "image_embeds_position_mask")
    # BLIP's captioner reads its image through cross-attention: no image tokens in the text, the model's own
    # forward (on the ids as they are) is what takes the images; Mllama's too, its image token first and its
    # image in tiles (`_tiled_image`)
    tiled = token is not None and _names(model.forward, "aspect_ratio_ids")
    takes = _names(model.forward, "pixel_values") or _names(model.forward, "flattened_patches")
    by_cross = (token is None or tiled) and not by_mask and get is None and takes
    batch, generator = ids.shape[0], torch.Generator().manual_seed(0)
    if tiled:
        ids = ids.clone()
        ids[:, 0] = token
    if by_cross:
        get = functools.partial(_no_image_tokens, model, ids)
        layouts = _tiled_image(vision_config, ids, generator) if tiled else []
        layouts = layouts or _probe_pixels(vision_config, model.forward, batch, generator)
        if _names(model.forward, "image_attention_mask"):  # Idefics: every token attends to each row's image
            layouts = [
                {**layout, "image_attention_mask": torch.ones(batch, ids.shape[1], layout["pixel_values"].shape[1])}
                for layout in layouts
                if layout["pixel_values"].dim() == 5
            ]
    else:
        placed = token is not None or by_mask
        layouts = _probe_pixels(vision_config, get, batch, generator) if placed and callable(get) else []
        extra = _other_inputs(config, get, batch, generator) if layouts else {}
        layouts = [{**layout, **extra} for layout in layouts]
    if not layouts:
        raise ValueError(
            f"parallelize(verify): {name} takes images, and tplayers cannot make a probe image for it, so its "
            f"self-check would not see the vision tower it shards; {PASS_INPUTS}"
        )
    weight = next(model.get_submodule(towers(model)[0]).parameters())
    failures = []
    for layout in layouts:
        images = {k: v.to(weight.device, weight.dtype if v.is_floating_point() else v.dtype) for k, v in layout.items()}
        try:
            devices = [weight.device.index or 0] if weight.device.type == "cuda" else []
            with torch.no_grad(), torch.random.fork_rng(devices=devices):  # a tower's dropout leaves no trace
                per_image = _image_tokens(get(**images)) // batch
            break
        except Exception as e:  # before any sharding: not a layout this model takes
            failures.append(f"{type(e).__name__}: {e}")
    else:
        raise ValueError(
            f"parallelize(verify): the unsharded {name} fails on the probe images tplayers made "
            f"({'; '.join(failures)}); {PASS_INPUTS}"
        )
    special = _special_ids(config)
    ordinary = next(i for i in range(int(ids.max()) + 2) if i not in special)
    text = torch.where(torch.isin(ids, torch.tensor(sorted(special), device=ids.device)), ordinary, ids)
    text = torch.cat([text, text[:, : (-per_image) % n]], 1)
    if by_mask:
        token = ordinary
        marks = torch.ones(batch, per_image, device=ids.device, dtype=ids.dtype)
        images["image_embeds_position_mask"] = torch.cat([marks, text * 0], 1)
    if by_cross:
        return ids, images
    ids = torch.cat([torch.full((batch, per_image), token, device=ids.device, dtype=ids.dtype), text], 1)
    if _names(model.forward, "mm_token_type_ids"):  # text 0, image 1, as the processors make them
        images["mm_token_type_ids"] = (ids == token).int()
    return ids, images


PASS_INPUTS = (
    "pass verify={'input_ids': ..., 'pixel_values': ..., ...} (the inputs its processor makes, the same on every "
    "rank) or verify=False"
)
