"""Norms recognised by their math (`rms_norm_eps`, `l2_norm_eps`: checked on a probe), and HF's RMSNorms
run by the fused kernels: a norm whose class's forward is LlamaRMSNorm's word for
word (140 classes in transformers 5.24: Llama, Mistral, Qwen2 / 3, ...) becomes a
`tplayers.nn.RMSNorm` holding the same weight Parameter. Only that exact source is taken: a norm
with other math (Gemma's 1 + weight, a norm without weight, a cast in another place) keeps its
own forward.
"""

import torch
from torch import nn

from tplayers.hf.source import source
from tplayers.nn.norm import RMSNorm
from tplayers.tolerances import TOLERANCES


def _source(cls) -> str:
    return source(cls.forward)


def _llama_source() -> str:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return _source(LlamaRMSNorm)


def is_llama_rms_norm(module) -> bool:
    """Whether `module` computes exactly LlamaRMSNorm (its forward's source) and holds only its
    weight and epsilon, with no hook of anyone's on it (swapping it would drop the hook)."""
    if isinstance(module, RMSNorm) or _source(type(module)) != _llama_source():
        return False
    weight = getattr(module, "weight", None)
    hooked = module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
    return (isinstance(weight, nn.Parameter) and weight.dim() == 1 and isinstance(module.variance_epsilon, float)
            and [n for n, _ in module.named_parameters()] == ["weight"] and not list(module.buffers())
            and not list(module.children()) and not hooked)  # fmt: skip


def fuse_rms_norms(model) -> list[str]:
    """Swap every LlamaRMSNorm-exact module of `model` for `tplayers.nn.RMSNorm` (same Parameter,
    same name); returns their names."""
    swapped = []
    for name, module in list(model.named_modules()):
        if name and is_llama_rms_norm(module):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, RMSNorm.from_norm(module))
            swapped.append(name)
    return swapped


KNOWN_RMS_NORMS = ("Olmo2RMSNorm",)  # accepted unprobed on the meta device, where no probe can run
EPS_NAMES = ("variance_epsilon", "eps")


def rms_norm_eps(norm) -> float | None:
    """The epsilon of a norm computing weight * (x * rsqrt(mean(x^2) + eps)) in fp32, checked on
    a probe with the module's own weights (so a look-alike with other math, Gemma's (1 + weight),
    is not taken for it); None for anything else."""
    eps = next((getattr(norm, k) for k in EPS_NAMES if isinstance(getattr(norm, k, None), float)), None)
    weight = getattr(norm, "weight", None)
    if eps is None or not isinstance(weight, nn.Parameter) or weight.dim() != 1 or len(list(norm.parameters())) != 1:
        return None
    if weight.is_meta:
        return eps if type(norm).__name__ in KNOWN_RMS_NORMS else None
    x = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    with torch.no_grad():
        h = x.float()
        expected = (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)
        return eps if torch.allclose(norm(x), expected, **TOLERANCES[weight.dtype]) else None


def l2_norm_eps(norm) -> float | None:
    """The epsilon of a weightless norm computing x * rsqrt(sum(x^2) + eps) in fp32 (nGPT's unit-norm
    projection, Dory's L2 norms), checked on a probe; None for anything else."""
    eps = next((getattr(norm, k) for k in EPS_NAMES if isinstance(getattr(norm, k, None), float)), None)
    if eps is None or next(norm.parameters(), None) is not None or next(norm.buffers(), None) is not None:
        return None
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
        return eps if torch.allclose(norm(x), expected, **TOLERANCES[torch.float32]) else None


def is_plain_layer_norm(norm) -> bool:
    """torch's own nn.LayerNorm (not a subclass with a forward of its own) over one dimension, with
    its affine weight, and no hook of anyone's on it."""
    hooked = norm._forward_hooks or norm._forward_pre_hooks or norm._backward_hooks
    return (type(norm) is nn.LayerNorm and norm.elementwise_affine and len(norm.normalized_shape) == 1
            and not hooked)  # fmt: skip
