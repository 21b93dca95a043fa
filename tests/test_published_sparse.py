"""The 2026 sparse-attention and hyper-connection families at their published sizes: DeepSeek-V4
(compressed sparse attention, grouped output projection, hyper-connections), GLM-5 (`glm_moe_dsa`,
DeepSeek Sparse Attention beside MLA), Hunyuan V4 (`hy_v4`, DSA, an output gate and
hyper-connections) and Qwen4-Exp (`qwen4_exp_text`, Gated DeltaNet, query-sparse attention and
hyper-connections), from the configs transformers ships (`tplayers.testing.published_config`: the
published widths, vocabulary, heads and experts, the depth cut to one layer of each kind), built
on the meta device. At TP 2, 4 and 8 the most loaded rank holds at most 1.05x its 1/TP of the
parameters: what is kept whole on every rank (the latents, the indexers, the norms) is small beside
what is split. Qwen4-Exp's hyper-connection mixers (2 x 4 x 8192 x 640 weights a connection, 11% of
a rank's share of a layer at TP 8 were they whole) are stored split and gathered at each forward
(`GatheredWeightLinear`). Their numerics, tiny, are in the newcomer sweep."""

import warnings

import pytest
import torch

import tplayers
from tplayers.testing import published_config

pytestmark = [pytest.mark.multirank, pytest.mark.tplayers]

TYPES = ["deepseek_v4", "glm_moe_dsa", "hy_v4", "qwen4_exp_text"]


def published_bytes(rank, tp, group, model_type):
    """(this rank's parameter bytes, the unsharded model's) at the published widths, on meta."""
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):  # GLM-5's experts alone are 24 GiB a layer in fp32
            model = tf.AutoModelForCausalLM.from_config(published_config(model_type))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tplayers.parallelize(model, group=group, verify=False)
    return sum(p.numel() * p.element_size() for p in model.parameters()), total


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("model_type", TYPES)
def test_published_sizes_hold_their_share(tplayers_pool, model_type, tp):
    replies = tplayers_pool.run(published_bytes, tp, model_type)
    held, total = max(r[0] for r in replies), replies[0][1]
    print(f"{model_type} TP {tp}: {held / (total / tp):.4f}x the ideal share ({total / 2**30:.1f} GiB unsharded)")
    assert held <= 1.05 * total / tp, f"{model_type}: {held} bytes on the most loaded rank, {held / (total / tp):.4f}x"
