"""Which of peft's tuners `parallelize` takes.

- LoRA: its adapters sharded with their base layers (`tplayers.hf.lora`).
- Prompt tuning and p-tuning: embeddings of virtual tokens put before the model's own, made by a
  prompt encoder that is kept whole on every rank (its input is every rank's alike, and the
  gradient reaching it is whole on every rank: the first block's input gradient is summed).
- LN tuning: copies of the norms, whole on every rank like the norms.

The others change what a projection computes in ways the sharded layers do not carry (IA3's
scales, LoHa / LoKr products, VeRA's shared matrices, OFT / BOFT rotations, ...) or hand every
attention key / value prefixes over all its heads (prefix tuning), of which a rank holds some:
refused by name before anything is sharded (before, they failed inside the sharding pass or the
self-check, naming their base layers)."""

from torch import nn

from tplayers.hf.lora import is_peft_model

SUPPORTED = {"LORA": "LoRA", "PROMPT_TUNING": "prompt tuning", "P_TUNING": "p-tuning", "LN_TUNING": "LN tuning"}


def _configs(model) -> dict:
    """{adapter name: peft config} of a peft model; {} for any other model."""
    return dict(model.peft_config) if is_peft_model(model) else {}


def check_tuners(model) -> None:
    """Refuse a peft model holding a tuner the sharded layers cannot compute exactly."""
    for adapter, config in _configs(model).items():
        kind = getattr(config.peft_type, "value", str(config.peft_type))
        if kind == "PREFIX_TUNING":
            raise ValueError(
                f"parallelize: peft's prefix tuning (adapter {adapter!r}) hands every attention key / value prefixes "
                "over all its heads, and each rank of the tensor-parallel group holds some of them: not supported; "
                f"use one of {', '.join(SUPPORTED.values())}"
            )
        if kind not in SUPPORTED:
            raise ValueError(
                f"parallelize: peft's {kind} (adapter {adapter!r}) is not supported on tensor-parallel layers; "
                f"supported: {', '.join(SUPPORTED.values())}"
            )


def whole_prompt_encoders(model, plan) -> dict | None:
    """`plan` with a peft model's prompt encoders (p-tuning's MLP or LSTM) kept whole on every rank,
    where the plan does not place them itself."""
    encoders = getattr(model, "prompt_encoder", None) if _configs(model) else None
    if not isinstance(encoders, nn.Module) or not any(True for _ in encoders.parameters()):
        return plan
    return {"prompt_encoder": "replicate", **(plan or {})}
