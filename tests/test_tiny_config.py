"""`tplayers.testing.tiny_config`: any transformers model type's default config shrunk to a tiny
model that keeps the model's structure: every size capped, sizes that were equal (or a sum) kept
so, one layer of each kind the full model has. The newcomer sweep (`tests/test_newcomers.py`)
builds and trains every causal-LM type from it."""

import warnings

import pytest
import torch

from tplayers.testing import published_config, tiny_config


def _model(config):
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            return tf.AutoModelForCausalLM.from_config(config)


def _layer_kinds(model_type, name, **kwargs):
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full, tiny = tf.AutoConfig.for_model(model_type), tiny_config(model_type, **kwargs)
    return set(map(str, vars(full)[name])), set(map(str, vars(tiny)[name])), tiny


@pytest.mark.parametrize("model_type", ["llama", "gemma3", "deepseek_v3", "qwen3_next", "llama4", "dots3_note_text"])
def test_the_model_is_tiny(model_type):
    params = sum(p.numel() for p in _model(tiny_config(model_type)).parameters())
    assert params < 1_000_000, params


def test_sizes_follow_the_head_count():
    config = tiny_config("mistral", heads=8)  # 32 query heads share 8 key/value heads
    assert (config.num_attention_heads, config.num_key_value_heads, config.hidden_size) == (8, 4, 64)
    assert config.intermediate_size == 128 and config.num_hidden_layers == 2 and config.vocab_size == 128
    assert tiny_config("llama").num_key_value_heads == 4  # multi-head attention stays so
    assert tiny_config("llama", heads=8, hidden_size=128).hidden_size == 128  # overrides win


def test_composite_configs_shrink_every_part():
    config = tiny_config("gemma3")
    assert config.text_config.hidden_size == 32 and config.vision_config.hidden_size == 32
    assert config.vision_config.num_hidden_layers == 2
    assert config.image_token_index < config.text_config.vocab_size  # a meaningful id stays in the vocabulary


def test_the_depth_cut_keeps_every_kind_of_layer():
    full, tiny, _ = _layer_kinds("gemma4_text", "layer_types")  # sliding and full attention, cache shared
    assert tiny == full == {"sliding_attention", "full_attention"}
    full, tiny, _ = _layer_kinds("llama4_text", "no_rope_layers")  # rope and NoPE layers
    assert tiny == full == {"0", "1"}
    config = tiny_config("flint")  # layer indices: dense layers listed, the rest mixtures of experts
    assert 0 < len(config.mlp_only_layers) < config.num_hidden_layers


def test_equal_and_summed_sizes_stay_so():
    config = tiny_config("axk1")  # MLA: as many key/value heads as query heads
    assert config.num_key_value_heads == config.num_attention_heads
    config = tiny_config("dots3_note_text")  # per-layer sizes: the sliding layers' head = [no-rope | rope]
    sliding = config.layer_types.index("sliding_attention")
    layer = config.per_layer_config[sliding]
    assert layer.head_dim == layer.qk_nope_head_dim + layer.qk_rope_head_dim


def test_defaults_that_build_no_model_get_the_published_fields():
    config = tiny_config("dots1")  # its defaults leave the expert counts None
    assert config.n_routed_experts == 4 and config.n_shared_experts == 1


def test_an_unknown_type_is_refused():  # negative control: nothing is invented for a type transformers lacks
    with pytest.raises(KeyError, match="no-such-model"):
        tiny_config("no-such-model")


def test_published_config_cuts_only_the_depth():
    import transformers as tf

    full, cut = tf.AutoConfig.for_model("glm_moe_dsa"), published_config("glm_moe_dsa")
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "n_routed_experts", "index_n_heads"):
        assert getattr(cut, key) == getattr(full, key), key
    assert cut.num_hidden_layers == 2 < full.num_hidden_layers
