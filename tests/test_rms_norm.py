"""The fused RMSNorm: its kernels against the reference (forward, dx, dweight) in Triton's
interpreter; `tplayers.nn.RMSNorm` against HF's LlamaRMSNorm, forward and both gradients, on both
backends; which HF norms `parallelize` runs through it."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tplayers
from tplayers.hf.norms import fuse_rms_norms, is_llama_rms_norm
from tplayers.testing import assert_close, examples, kernel_device, kernel_generator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.interpreter
@pytest.mark.kernel
@settings(max_examples=examples(30), deadline=None)
@given(
    rows=st.integers(1, 40), width=st.integers(1, 300), dtype=st.sampled_from(DTYPES), strided=st.booleans(),
    fp32_weight=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_kernels_match_reference(rows, width, dtype, strided, fp32_weight, seed):
    from tplayers.kernels.rms_norm import INTERPRET, rms_norm, rms_norm_backward, rms_norm_backward_ref, rms_norm_ref

    assert INTERPRET == (kernel_device() == "cpu")
    gen = kernel_generator(seed)
    wide = (2 * torch.randn(rows, width + 5, generator=gen)).to(dtype)
    x = wide[:, 2 : 2 + width] if strided else wide[:, :width].contiguous()  # rows a stride apart
    weight = (1 + 0.3 * torch.randn(width, generator=gen)).to(torch.float32 if fp32_weight else dtype)
    y, rstd = rms_norm(x, weight, 1e-5)
    y_ref, rstd_ref = rms_norm_ref(x, weight, 1e-5)
    assert y.dtype == y_ref.dtype and rstd.dtype == torch.float32
    assert_close(rstd, rstd_ref)
    # the rows are rounded to x's dtype before the weight (as HF rounds them): x's precision bounds y's
    assert_close(y.to(dtype), y_ref.to(dtype))
    dy = torch.randn(rows, width, generator=gen).to(y.dtype)
    dx, dw = rms_norm_backward(dy, x, weight, rstd)
    dx_ref, dw_ref = rms_norm_backward_ref(dy, x, weight, rstd_ref)
    assert_close(dx, dx_ref)
    assert_close(dw.to(dtype), dw_ref.to(dtype))


@pytest.mark.interpreter
@pytest.mark.kernel
def test_kernels_negative_control():
    from tplayers.kernels.rms_norm import rms_norm, rms_norm_backward, rms_norm_backward_ref, rms_norm_ref

    x, weight = torch.randn(6, 40), 1 + torch.rand(40)
    y_ref, rstd = rms_norm_ref(x, weight, 1e-6)
    with pytest.raises(AssertionError):  # another row's scale
        assert_close(rms_norm(x.roll(1, 0), weight, 1e-6)[0], y_ref)
    dy = torch.randn(6, 40)
    with pytest.raises(AssertionError):  # the weight's gradient of other rows
        dw_ref = rms_norm_backward_ref(dy, x, weight, rstd)[1]
        assert_close(rms_norm_backward(dy.roll(1, 0), x, weight, rstd)[1], dw_ref)
    assert_close(rms_norm(x, weight, 1e-6)[0], y_ref)


def _hf_norm(width, dtype, seed):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(width, generator=torch.Generator().manual_seed(seed)))
    return norm


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_module_matches_hf_llama_rms_norm(backend, dtype):
    """tplayers.nn.RMSNorm built from an HF norm: its forward, dx and dweight are the HF module's
    (bit for bit on the torch backend, which runs HF's ops; within the table on the kernels)."""
    hf = _hf_norm(24, dtype, 0)
    fused = tplayers.nn.RMSNorm.from_norm(_hf_norm(24, dtype, 0))
    x = (2 * torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(1))).to(dtype)
    dy = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    tplayers.set_backend(backend)
    try:
        outs = []
        for norm in (hf, fused):
            xi = x.clone().requires_grad_(True)
            y = norm(xi)
            y.backward(dy)
            outs.append((y.detach(), xi.grad, norm.weight.grad))
    finally:
        tplayers.set_backend("auto")
    exact = backend == "torch"
    for got, want, what in zip(outs[1], outs[0], ("y", "dx", "dweight"), strict=True):
        assert_close(got, want, exact=exact, msg=lambda m, w=what: f"{w}: {m}")


def test_which_norms_are_fused():
    """Norms whose forward is LlamaRMSNorm's word for word are swapped, holding the same Parameter
    under the same name; Gemma's (1 + weight) and a hooked norm are left as they are."""
    import transformers as tf

    small = dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=4)  # fmt: skip
    qwen3 = tf.Qwen3ForCausalLM(tf.Qwen3Config(**small))
    weights = {name: p for name, p in qwen3.named_parameters()}
    keys = list(qwen3.state_dict())
    qwen3.model.layers[0].post_attention_layernorm.register_forward_hook(lambda *a: None)
    swapped = fuse_rms_norms(qwen3)
    assert "model.norm" in swapped and "model.layers.0.self_attn.q_norm" in swapped
    assert "model.layers.0.post_attention_layernorm" not in swapped  # someone's hook is on it
    assert isinstance(qwen3.model.norm, tplayers.nn.RMSNorm)
    assert list(qwen3.state_dict()) == keys
    assert all(p is weights[name] for name, p in qwen3.named_parameters())
    gemma = tf.GemmaForCausalLM(tf.GemmaConfig(**small))
    assert not any(is_llama_rms_norm(m) for m in gemma.modules())
    assert fuse_rms_norms(gemma) == []


def _saved_bytes(fn):
    """Bytes of the distinct tensors autograd keeps for backward while `fn` runs."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.interpreter
def test_keeps_a_third_of_what_hf_keeps_for_backward():
    """bf16 rows: HF's eager norm keeps an fp32 copy of them and the 16-bit normalised rows (6 bytes
    a feature); the fused norm keeps the rows and one fp32 rstd per row (2 bytes a feature)."""
    x = torch.randn(64, 256).to(torch.bfloat16).requires_grad_(True)
    hf = _hf_norm(256, torch.bfloat16, 0)
    fused = tplayers.nn.RMSNorm.from_norm(_hf_norm(256, torch.bfloat16, 0))
    tplayers.set_backend("triton")
    try:
        mine = _saved_bytes(lambda: fused(x))
    finally:
        tplayers.set_backend("auto")
    theirs = _saved_bytes(lambda: hf(x))
    assert mine <= x.numel() * 2 + 64 * 4 + 256 * 2, mine  # x, rstd, the weight
    assert theirs >= 3 * (mine - 256 * 2), (theirs, mine)
