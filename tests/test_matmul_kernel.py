"""The Triton GEMM in the interpreter against `matmul_ref` on fp32-upcast inputs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tplayers.kernels.matmul import INTERPRET, matmul, matmul_ref

from tplayers.testing import assert_close, examples, kernel_device, kernel_generator

pytestmark = [pytest.mark.interpreter, pytest.mark.kernel]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def strided(shape, dtype, layout, gen):
    """A tensor of `shape` as a strided view of a larger buffer: 'contiguous', 'transposed'
    (last two dims swapped in memory) or 'sliced' (a window of a wider, taller buffer)."""
    if layout == "transposed":
        base = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=gen).to(dtype)
        return base.transpose(-1, -2)
    if layout == "sliced":
        base = torch.randn(*shape[:-2], shape[-2] + 3, shape[-1] + 5, generator=gen).to(dtype)
        return base[..., 2 : 2 + shape[-2], 1 : 1 + shape[-1]]
    return torch.randn(shape, generator=gen).to(dtype)


@st.composite
def gemm_cases(draw):
    mode = draw(st.sampled_from(["2d", "batched", "reduce_batch"]))
    batch = draw(st.integers(1, 3))
    m, n, k = draw(st.integers(1, 70)), draw(st.integers(1, 70)), draw(st.integers(1, 70))
    return dict(
        mode=mode, batch=batch, m=m, n=n, k=k,
        dtype=draw(st.sampled_from(DTYPES)),
        layouts=[draw(st.sampled_from(["contiguous", "transposed", "sliced"])) for _ in range(3)],
        bias=draw(st.booleans()),
        scale=draw(st.sampled_from([1.0, 0.5, -1.25])),
        activation=draw(st.sampled_from([None, "gelu_tanh", "silu"])),
        residual=draw(st.booleans()) and mode != "reduce_batch",
        accumulate=draw(st.booleans()),
        batched_b=mode != "2d" and draw(st.booleans()),  # a weight per batch, or one shared
        fp32_out=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def test_runs_in_interpreter():
    assert INTERPRET == (kernel_device() == "cpu"), "conftest sets TRITON_INTERPRET=1 on CPU before triton is imported"


@settings(max_examples=examples(60))
@given(gemm_cases())
def test_kernel_matches_reference(case):
    gen = kernel_generator(case["seed"])
    dt, (la, lb, lc) = case["dtype"], case["layouts"]
    m, n, k, batch = case["m"], case["n"], case["k"], case["batch"]
    lead = () if case["mode"] == "2d" else (batch,)
    a = strided((*lead, m, k), dt, la, gen)
    b = strided((*lead, n, k) if case["batched_b"] else (n, k), dt, lb, gen)
    out_shape = (m, n) if case["mode"] != "batched" else (batch, m, n)
    out_dtype = torch.float32 if case["accumulate"] or case["fp32_out"] else dt
    out = strided(out_shape, out_dtype, lc, gen)
    bias = torch.randn(n, generator=gen).to(dt) if case["bias"] else None
    residual = torch.randn(out_shape, generator=gen).to(dt) if case["residual"] else None
    epilogue = dict(
        scale=case["scale"], activation=case["activation"], accumulate=case["accumulate"],
        reduce_batch=case["mode"] == "reduce_batch",
    )  # fmt: skip
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    expected = matmul_ref(f32(a), f32(b), bias=f32(bias), residual=f32(residual), out=out.float().clone(), **epilogue)
    result = matmul(a, b, bias=bias, residual=residual, out=out, **epilogue)
    assert result is out
    # fp16 / bf16 inputs are exact in fp32, so the only differences are summation order and
    # the final rounding to the output dtype: the table's tolerance for that dtype.
    assert_close(result, expected.to(out_dtype))


def test_writes_only_its_window_of_a_larger_buffer():
    big = torch.zeros(3, 20, 11)
    a, w = torch.randn(3, 7, 5), torch.randn(11, 5)
    matmul(a, w, out=big[:, 4:11])
    assert_close(big[:, 4:11], matmul_ref(a, w))
    assert big[:, :4].eq(0).all() and big[:, 11:].eq(0).all()


@pytest.mark.parametrize("shape", [(0, 5, 4), (6, 0, 4), (6, 5, 0)])
def test_zero_size(shape):
    m, n, k = shape
    a, b, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    assert_close(matmul(a, b, bias=bias), matmul_ref(a, b, bias=bias), exact=True)


def test_accumulate_into_fp32_weight_grad():
    dy, x = torch.randn(4, 9, 6, dtype=torch.float16), torch.randn(4, 9, 5, dtype=torch.float16)
    acc = torch.ones(6, 5)
    matmul(dy.transpose(1, 2), x.transpose(1, 2), reduce_batch=True, out=acc, accumulate=True)
    expected = 1 + torch.einsum("bsn,bsk->nk", dy.float(), x.float())
    assert_close(acc, expected)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(a=torch.randn(3, 4), b=torch.randn(5, 6)), "K=4"),
        (dict(a=torch.randn(3, 4), b=torch.randn(5, 4, dtype=torch.float16)), "share a float dtype"),
        (dict(a=torch.randn(3, 4), b=torch.randn(5, 4), bias=torch.randn(4)), "bias must have shape"),
        (dict(a=torch.randn(3, 4), b=torch.randn(5, 4), accumulate=True), "fp32 `out`"),
        (dict(a=torch.randn(3, 4), b=torch.randn(5, 4), activation="relu"), "activation must be"),
        (dict(a=torch.randn(3, 4), b=torch.randn(5, 4), out=torch.empty(3, 5, device="meta")), "out is on meta"),
    ],
)
def test_bad_arguments(kwargs, error):
    for fn in (matmul, matmul_ref):
        with pytest.raises((ValueError, TypeError), match=error):
            fn(**kwargs)


def test_offsets_beyond_32_bits():
    """Rows 2**31 elements apart: the launcher switches the kernel to 64-bit offsets."""
    storage = torch.empty(2**31 + 64, dtype=torch.float16)  # 4 GiB of address space, 2 pages touched
    out = storage.as_strided((2, 4), (2**31, 1))
    a, w = torch.randn(2, 8, dtype=torch.float16), torch.randn(4, 8, dtype=torch.float16)
    matmul(a, w, out=out)
    assert_close(out.clone(), matmul_ref(a.float(), w.float()).half())


def test_strided_bias():
    a, w, bias = torch.randn(5, 6), torch.randn(4, 6), torch.randn(8)[::2]
    assert_close(matmul(a, w, bias=bias), matmul_ref(a, w, bias=bias))


@settings(max_examples=examples(25))
@given(
    m=st.integers(1, 70), half_n=st.integers(1, 40), k=st.integers(1, 50), batch=st.sampled_from([None, 2]),
    dtype=st.sampled_from(DTYPES), bias=st.booleans(), sliced=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_swiglu_epilogue_matches_reference(m, half_n, k, batch, dtype, bias, sliced, seed):
    """C's columns alternate gate, up; the epilogue also writes H = silu(gate) * up."""
    gen = kernel_generator(seed)
    lead = () if batch is None else (batch,)
    a = strided((*lead, m, k), dtype, "sliced" if sliced else "contiguous", gen)
    w = torch.randn(2 * half_n, k, generator=gen).to(dtype)
    b = torch.randn(2 * half_n, generator=gen).to(dtype) if bias else None
    h = strided((*lead, m, half_n), dtype, "sliced" if sliced else "contiguous", gen)
    y = matmul(a, w, bias=b, swiglu_out=h)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    h_ref = torch.empty(h.shape)
    y_ref = matmul_ref(f32(a), f32(w), bias=f32(b), swiglu_out=h_ref)
    assert_close(y, y_ref.to(dtype))
    assert_close(h, h_ref.to(dtype))


def test_swiglu_epilogue_rejects_bad_arguments():
    a, w = torch.randn(4, 3), torch.randn(6, 3)
    with pytest.raises(ValueError, match=r"swiglu_out must have shape \(4, 3\)"):
        matmul_ref(a, w, swiglu_out=torch.empty(4, 6))
    with pytest.raises(ValueError, match="plain epilogue"):
        matmul_ref(a, w, activation="silu", swiglu_out=torch.empty(4, 3))


@pytest.fixture
def tma_path(monkeypatch):
    """Hopper's TMA kernel in the interpreter (on a GPU of sm_90 or later it runs by itself)."""
    from tplayers.kernels import matmul as module

    monkeypatch.setattr(module, "TMA_IN_INTERPRETER", True)
    return module


@settings(max_examples=examples(40))
@given(
    mode=st.sampled_from(["2d", "batched", "reduce_batch"]), batch=st.integers(1, 3),
    m=st.integers(1, 9).map(lambda x: 8 * x), n=st.integers(1, 9).map(lambda x: 8 * x),
    k=st.integers(1, 9).map(lambda x: 8 * x), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    layouts=st.lists(st.sampled_from(["contiguous", "transposed"]), min_size=2, max_size=2),
    batched_b=st.booleans(), bias=st.booleans(), activation=st.sampled_from([None, "gelu_tanh", "silu"]),
    residual=st.booleans(), accumulate=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_tma_kernel_matches_reference(tma_path, mode, batch, m, n, k, dtype, layouts, batched_b, bias, activation,
                                      residual, accumulate, seed):  # fmt: skip
    """The persistent TMA kernel on the operands its descriptors take (16-bit, 16-byte strides):
    K-major and row-major (a weight gradient's transposed activations) operands, batched, reduced
    over the batch, a weight shared by every batch, each epilogue, accumulating into fp32."""
    gen = kernel_generator(seed)
    lead = () if mode == "2d" else (batch,)
    a = strided((*lead, m, k), dtype, layouts[0], gen)
    b = strided((*lead, n, k) if batched_b and mode != "2d" else (n, k), dtype, layouts[1], gen)
    assert tma_path._tma_layouts(a, b) is not None
    out_shape = (batch, m, n) if mode == "batched" else (m, n)
    out = torch.randn(out_shape, generator=gen).to(torch.float32 if accumulate else dtype)
    bias_t = torch.randn(n, generator=gen).to(dtype) if bias else None
    res = torch.randn(out_shape, generator=gen).to(dtype) if residual and mode != "reduce_batch" else None
    epilogue = dict(activation=activation, accumulate=accumulate, reduce_batch=mode == "reduce_batch")
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    expected = matmul_ref(f32(a), f32(b), bias=f32(bias_t), residual=f32(res), out=out.float().clone(), **epilogue)
    assert_close(matmul(a, b, bias=bias_t, residual=res, out=out, **epilogue), expected.to(out.dtype))


def test_tma_kernel_swiglu_epilogue(tma_path):
    gen = kernel_generator(3)
    a, w = torch.randn(40, 24, generator=gen).half(), torch.randn(48, 24, generator=gen).half()
    h = torch.empty(40, 24, dtype=torch.half)
    y = matmul(a, w, swiglu_out=h)
    h_ref = torch.empty(h.shape)
    assert_close(y, matmul_ref(a.float(), w.float(), swiglu_out=h_ref).half())
    assert_close(h, h_ref.half())


def test_tma_takes_only_what_its_descriptors_can_read(tma_path):
    """fp32, an address or a row stride not a multiple of 16 bytes, a view with no unit stride:
    the pointer kernel runs those (and the results agree either way)."""
    x = torch.randn(32, 40, dtype=torch.bfloat16)
    w = torch.randn(24, 40, dtype=torch.bfloat16)
    assert None not in (tma_path._tma_layouts(x, w), tma_path._tma_layouts(x.t().contiguous().t(), w))
    for other in (w.float(), w[:, 1:33], torch.randn(24, 44, dtype=torch.bfloat16)[:, :36], w[:, ::2]):
        assert tma_path._tma_layouts(x[:, : other.shape[1]], other) is None, other.stride()
        got = matmul(x[:, : other.shape[1]].to(other.dtype), other)
        assert_close(got, matmul_ref(x[:, : other.shape[1]].float(), other.float()).to(other.dtype))


@pytest.mark.parametrize("capability, arch", [((8, 0), 80), ((9, 0), 90), ((12, 0), 90)])
def test_configs_for_the_running_gpu(monkeypatch, capability, arch):
    """The autotuned GEMMs time their own architecture's configs; TPLAYERS_AUTOTUNE=0 takes the
    one of least shared memory (it fits with fp32 inputs too) untimed."""
    from tplayers.kernels import grouped_matmul, matmul, tuning

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    for configs in (matmul.SM80_CONFIGS + matmul.SM90_CONFIGS, grouped_matmul.WGRAD_CONFIGS):
        mine = tuning.configs_for_running_gpu(configs, {})
        assert mine and all(cfg.arch == arch for cfg in mine) and len(mine) < len(configs)
        monkeypatch.setattr(tuning, "AUTOTUNE", False)
        (least,) = tuning.configs_for_running_gpu(configs, {})
        assert all(tuning._footprint(least) <= tuning._footprint(cfg) for cfg in mine)
        monkeypatch.setattr(tuning, "AUTOTUNE", True)
