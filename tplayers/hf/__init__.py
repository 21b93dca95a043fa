"""HuggingFace integration: `parallelize` shards a causal LM in place, `gather_state_dict` /
`load_full_state_dict` move its full weights in and out of the shards.

    shard.py        the generic pass: walk the modules, apply a plan, swap linears, record exports
    families.py     what tplayers knows about each model family: one adapter per module pattern
    attention.py    the attention adapters (layouts split by heads, ALiBi, norms over a projection,
                    output gates)
    attention_code_models.py  GPTBigCode's, CodeGen's and MPT's fused attention projections
    mlp.py          the MLP adapters (gated -> ParallelMLP, fused gate|up, two-layer)
    moe.py          experts in transformers 5's fused 3-D layout, sharded like MLPs
    fused.py        fused projections: row maps, multi-query [q; k; v]
    verify.py       the self-check: full logits before sharding against the sharded ones after
    pipeline_split.py  a decoder as pipeline stages (tplayers.pipeline)
    parallelize.py  the entry point: runs the pass, wires SP / shared-input hooks into the forward
    state_dict.py   full state dict / gradients under the original names, and loading them back
    lora.py         peft's LoRA adapters on the sharded layers, each factor sharded like its base
    lora_targets.py tplayers.get_peft_model: adapters added to an already parallelized model
    model_methods.py  save_pretrained / resize_token_embeddings / generate() on a parallelized model
    attention_weights.py  output_attentions: every head's weights, gathered

`Trainer`, `parallel_trainer` and `prepare` (HF Trainer, TRL and accelerate on parallelized models)
live in `tplayers.loops`, above tplayers.checkpoint, which they save through; they are named here
on first use (module `__getattr__`), which also keeps transformers' Trainer and accelerate out of
`import tplayers`.

May import: tplayers.nn, tplayers.functional, the foundations (backend, distributed, placement)
and transformers; never tplayers.checkpoint, tplayers.plan or tplayers.tools.
"""

from tplayers.hf.parallelize import parallelize
from tplayers.hf.pipeline_split import next_token_loss, pipeline_split
from tplayers.hf.state_dict import gather_grads, gather_state_dict, load_full_state_dict

_LOOPS = ("Trainer", "parallel_trainer", "prepare")

__all__ = [
    "gather_grads",
    "gather_state_dict",
    "load_full_state_dict",
    "next_token_loss",
    "parallelize",
    "pipeline_split",
    *_LOOPS,
]


def __getattr__(name: str):
    if name in _LOOPS:
        import tplayers.loops

        return getattr(tplayers.loops, name)
    raise AttributeError(f"module 'tplayers.hf' has no attribute {name!r}")
