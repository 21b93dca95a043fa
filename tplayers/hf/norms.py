"""HF's RMSNorms run by the fused kernels: a norm whose class's forward is LlamaRMSNorm's word for
word (140 classes in transformers 5.24: Llama, Mistral, Qwen2 / 3, ...) becomes a
`tplayers.nn.RMSNorm` holding the same weight Parameter. Only that exact source is taken: a norm
with other math (Gemma's 1 + weight, a norm without weight, a cast in another place) keeps its
own forward.
"""

from torch import nn

from tplayers.hf.source import source
from tplayers.nn.norm import RMSNorm


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
