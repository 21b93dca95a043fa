"""Named models, precision recipes and GPUs: the tables behind `ModelSpec.preset`,
`Precision.preset` and `ClusterSpec.preset` (and the CLI's --model / --precision / --cluster), as
the classes' fields (`tplayers.plan.specs` builds its classes from them; this module imports none)."""

from __future__ import annotations

GiB = 2**30

PRECISION_PRESETS = {
    # ZeRO paper Sec. 3.1: 2 + 2 + 12 (fp32 master, momentum, variance).
    "mixed-adam": dict(param_bytes=2, grad_bytes=2, optimizer_bytes=12),
    # Same recipe counting the fp32 gradient copy among optimizer states: 2 + 2 + 16 = 20.
    "mixed-adam-fp32-grads": dict(param_bytes=2, grad_bytes=2, optimizer_bytes=16),
    # Everything fp32: 4 params + 4 grads + 8 (momentum, variance); fp32 activations.
    "fp32-adam": dict(param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4),
    # bf16 params / grads and bf16 Adam states, no master copy: 2 + 2 + 4.
    "bf16-adam": dict(param_bytes=2, grad_bytes=2, optimizer_bytes=4),
    # Plain SGD in bf16 without momentum: no optimizer state.
    "bf16-sgd": dict(param_bytes=2, grad_bytes=2, optimizer_bytes=0),
    # Mixed-precision SGD with momentum: fp32 master 4 + momentum 4.
    "mixed-sgd-momentum": dict(param_bytes=2, grad_bytes=2, optimizer_bytes=8),
}


def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, seq_len):
    return dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        ffn_hidden=ffn,
        vocab=vocab,
        seq_len=seq_len,
        gated_mlp=True,
        dropout=False,
        name=name,
    )


MODEL_PRESETS = {
    # Llama 3 herd (Dubey et al. 2024, Table 3); training context 8192.
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    # Llama 2 (Touvron et al. 2023): multi-head attention at 7B, context 4096.
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    # GPT-3 175B (Brown et al. 2020, Table 2.1): GPT-2 architecture, tied embeddings,
    # learned positions, LayerNorm, biases, GeLU 4h MLP, dropout.
    "gpt3-175b": dict(
        layers=96,
        hidden=12288,
        heads=96,
        vocab=50257,
        seq_len=2048,
        gated_mlp=False,
        tied_embeddings=True,
        norm="layernorm",
        linear_bias=True,
        position_embedding="learned",
        dropout=True,
        name="gpt3-175b",
    ),
}


# Datasheet numbers. Capacities are the nominal GiB nvidia-smi shows (within ~1%).
# NVLink / network bandwidths are per GPU, one direction.
_GPU_PRESETS = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOPS dense BF16, 40GB HBM2 1,555 GB/s,
    # NVLink 600 GB/s (bidirectional -> 300e9 one way). DGX A100 user guide: 8x 200 Gb/s HDR
    # InfiniBand compute ports, one per GPU -> 25e9 B/s.
    "a100-40gb": dict(
        peak_flops=312e12,
        hbm_bytes=40 * GiB,
        hbm_bandwidth=1.555e12,
        intra_node_bandwidth=300e9,
        inter_node_bandwidth=25e9,
    ),
    # Same datasheet, 80GB HBM2e SXM: 2,039 GB/s.
    "a100-80gb": dict(
        peak_flops=312e12,
        hbm_bytes=80 * GiB,
        hbm_bandwidth=2.039e12,
        intra_node_bandwidth=300e9,
        inter_node_bandwidth=25e9,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet, SXM: 989 TFLOPS dense BF16 (1,979 with sparsity),
    # 80GB HBM3 3.35 TB/s, NVLink 900 GB/s (-> 450e9 one way). DGX H100 user guide:
    # 8x 400 Gb/s NDR ConnectX-7, one per GPU -> 50e9 B/s.
    "h100-80gb": dict(
        peak_flops=989e12,
        hbm_bytes=80 * GiB,
        hbm_bandwidth=3.35e12,
        intra_node_bandwidth=450e9,
        inter_node_bandwidth=50e9,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: same compute as H100 (989 TFLOPS dense BF16),
    # 141GB HBM3e 4.8 TB/s, NVLink 900 GB/s; DGX H200 networking as DGX H100.
    "h200": dict(
        peak_flops=989e12,
        hbm_bytes=141 * GiB,
        hbm_bandwidth=4.8e12,
        intra_node_bandwidth=450e9,
        inter_node_bandwidth=50e9,
    ),
}
_GPU_ALIASES = {"h100": "h100-80gb", "h100-sxm": "h100-80gb", "h200-141gb": "h200", "a100": "a100-80gb"}
CLUSTER_PRESETS = tuple(sorted({*_GPU_PRESETS, *_GPU_ALIASES}))
