"""Hybrid and state-space models under tensor parallelism: Gated DeltaNet (Qwen3-Next, Qwen3.5)
and Mamba 2 mixers (Mamba2, Bamba, Nemotron-H, Granite-4 hybrid, Falcon-H1, Zamba2) split by
heads (`tplayers.hf.mixers`), exact against the unsharded model: logits, loss, every parameter
after one SGD step through `gather_state_dict`, and greedy `generate()` with the cache holding
each rank's heads; head and group counts that do not divide the ranks."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_families import matches_unsharded  # noqa: E402

pytestmark = pytest.mark.multirank

# Gated DeltaNet: 3 key heads of 8, each with 2 value heads of 8; one linear-attention layer and
# one full-attention layer; Qwen3-Next's MoE on both.
DELTANET = dict(linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])  # fmt: skip
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
# Mamba 2: hidden 36, 9 heads of 8 (expand 2), state 8, chunks of 4 over the 8 tokens, one group
# over every head (B / C whole on every rank, the gated norm's sum of squares over the group).
MAMBA2 = dict(hidden_size=36, num_heads=9, head_dim=8, expand=2, n_groups=1, state_size=8, conv_kernel=4,
              chunk_size=4)  # fmt: skip
MAMBA_HYBRID = dict(hidden_size=36, mamba_n_heads=9, mamba_d_head=8, mamba_expand=2, mamba_n_groups=1,
                    mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4, num_attention_heads=6,
                    num_key_value_heads=2, head_dim=6)  # fmt: skip
# At TP 4: 4 key heads (Gated DeltaNet), 4 groups (Mamba 2 with groups) where the others have 3.
TP4 = {f: dict(linear_num_key_heads=4, linear_num_value_heads=8) for f in ("qwen3_next", "qwen3_5_text",
                                                                           "qwen3_5_moe_text")}  # fmt: skip
TP4["mamba2-groups"] = dict(n_groups=4, num_heads=8, head_dim=9)
MIXERS = {
    "qwen3_next": ("qwen3_next", dict(DELTANET, **QWEN_MOE)),
    "qwen3_5_text": ("qwen3_5_text", DELTANET),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", dict(DELTANET, **QWEN_MOE)),
    "mamba2": ("mamba2", MAMBA2),
    "mamba2-groups": ("mamba2", dict(MAMBA2, n_groups=3)),  # 3 groups of 3 heads: whole groups per rank
    "bamba": ("bamba", dict(MAMBA_HYBRID, attn_layer_indices=[1])),
    "granitemoehybrid": (
        "granitemoehybrid",
        dict(
            MAMBA_HYBRID,
            layer_types=["mamba", "attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=16,
        ),
    ),  # fmt: skip
    "nemotron_h": (
        "nemotron_h",
        dict(
            hidden_size=36,
            mamba_num_heads=9,
            mamba_head_dim=8,
            expand=2,
            n_groups=1,
            ssm_state_size=8,
            chunk_size=4,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=6,
            layers_block_type=["mamba", "attention", "mlp"],
            num_hidden_layers=3,
        ),
    ),  # fmt: skip
    "falcon_h1": (
        "falcon_h1",
        dict(MAMBA_HYBRID, mamba_d_ssm=72, ssm_multipliers=[1.5, 0.5, 2.0, 0.75, 1.25], mamba_rms_norm=False),
    ),  # fmt: skip
}


def hybrid_matches_unsharded(rank, tp, group, family, sequence_parallel, config):
    import test_families

    test_families.VARIANTS.update(MIXERS)  # in this rank's process
    matches_unsharded(rank, tp, group, family, sequence_parallel, torch.float32, config=config)


@pytest.mark.parametrize("family", list(MIXERS))
@pytest.mark.parametrize("tp, sequence_parallel", [(2, False), (2, True), (3, False), (4, True)],
                         ids=["tp2", "tp2-sp", "tp3", "tp4-sp"])  # fmt: skip
def test_hybrid_matches_unsharded(pool, family, tp, sequence_parallel):
    pool.run(hybrid_matches_unsharded, tp, family, sequence_parallel, TP4.get(family, {}) if tp == 4 else {},
             mesh=(1, 1, tp))  # fmt: skip
