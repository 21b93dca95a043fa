"""What the LoRA on tensor-parallel layers (`tplayers.hf.lora`) and on experts
(`tplayers.hf.lora_experts`) both check and both do: the refusals, peft's config checked, a
factor kept whole."""

from torch.distributed.tensor import Replicate

from tplayers.hf.summed_grads import summed_grads
from tplayers.placement import placement_or_none, set_placement

SIMPLE_INITS = (True, False, "gaussian")  # the ones that do not read the base weight

EXPERT_LORA = (
    "LoRA on a parameter (peft's target_parameters, its ParamWrapper) is supported on transformers' standard "
    "experts' gate_up_proj / down_proj only (tplayers.hf.lora_experts)"
)


def _refuse(name, why):
    raise ValueError(f"tplayers LoRA: {name}: {why}")


def check_config(config, where):
    """Refuse what the sharded factors cannot compute exactly (on every rank alike)."""
    variants = [f for f in ("use_dora", "use_bdlora", "alora_invocation_tokens", "arrow_config")
                if getattr(config, f, None)]  # fmt: skip
    if variants:
        _refuse(where, f"peft's LoRA variant {variants[0]} is not supported on tensor-parallel layers")
    if config.init_lora_weights not in SIMPLE_INITS:
        _refuse(
            where,
            f"init_lora_weights={config.init_lora_weights!r} reads the whole base weight; initialize the adapter "
            "on the unsharded model (peft.get_peft_model before tplayers.parallelize)",
        )


def keep_whole(param, group, partial: bool):
    """A factor kept whole: Replicate; summed over the group where each rank computes part of its
    gradient (the hook parallelize gives such weights)."""
    if partial:
        summed_grads([param], group)
    elif placement_or_none(param) is None:
        set_placement(param, group, Replicate())
