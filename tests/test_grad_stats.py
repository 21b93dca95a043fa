"""The fused unscale + non-finite check + norm statistics pass: the Triton multi-tensor kernel (in
Triton's interpreter) against its pure-torch reference, and both against torch's own
`_amp_foreach_non_finite_check_and_unscale_` and `torch.linalg.vector_norm`.

Unscaled values and found_inf must be bit-exact (nothing is reduced); the sums in the statistics
may differ in summation order (fp32 table tolerance), the max is exact."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tplayers.kernels.grad_stats import unscale_and_stats_
from tplayers.kernels.grad_stats_ref import unscale_and_stats_ref

from tplayers.testing import examples, kernel_device, kernel_generator, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

# inf * 0, overflow past the dtype and nan arithmetic are the point of some cases here: numpy
# (which runs the interpreter) warns about them.
pytestmark = [
    pytest.mark.kernel,
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


# --- comparison helpers (each with a negative control below) ----------------------------------


def assert_same_values(actual, expected):
    """Bit-exact tensors, with nan only compared by position (a nan's payload bits are free)."""
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.dtype == e.dtype and a.shape == e.shape, f"tensor {i}: {a.dtype}{tuple(a.shape)} vs {e.dtype}"
        nan = torch.isnan(e)
        assert torch.equal(torch.isnan(a), nan), f"tensor {i}: nan positions differ"
        a_bits, e_bits = a.view(BITS[a.dtype])[~nan], e.view(BITS[e.dtype])[~nan]
        assert torch.equal(a_bits, e_bits), f"tensor {i}: {int((a_bits != e_bits).sum())} elements differ"


def assert_same_result(actual, expected):
    """(stats, found_inf): sums to the fp32 tolerance (summation order), max and flag exact."""
    (stats, found), (ref_stats, ref_found) = actual, expected
    assert stats.dtype == found.dtype == torch.float32
    assert stats.shape == ref_stats.shape and found.shape == (1,)
    torch.testing.assert_close(stats[:, :2], ref_stats[:, :2], equal_nan=True, **tolerance(torch.float32))
    torch.testing.assert_close(stats[:, 2], ref_stats[:, 2], equal_nan=True, rtol=0, atol=0)
    assert torch.equal(found, ref_found), f"found_inf {found.item()} vs {ref_found.item()}"


def run_both(tensors, inv_scale):
    """Both implementations on their own copies: ((result, tensors) kernel, (result, tensors) ref)."""
    ours, theirs = [t.clone() for t in tensors], [t.clone() for t in tensors]
    return (unscale_and_stats_(ours, inv_scale), ours), (unscale_and_stats_ref(theirs, inv_scale), theirs)


def check_against_reference(tensors, inv_scale):
    (result, values), (ref_result, ref_values) = run_both(tensors, inv_scale)
    assert_same_values(values, ref_values)
    assert_same_result(result, ref_result)
    return result, values


# --- random tensor lists ---------------------------------------------------------------------


def make_tensor(shape, dtype, layout, magnitude, gen):
    """A gradient of `shape`: contiguous, 'transposed' (dense but not contiguous: processed in
    place) or 'sliced' (every other column of a wider buffer: the kernel's copy fallback)."""
    if layout == "sliced":
        wide = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)
        return (wide * magnitude).to(dtype)[..., ::2]
    if layout == "transposed" and len(shape) == 2:
        return (torch.randn(shape[::-1], generator=gen) * magnitude).to(dtype).t()
    return (torch.randn(shape, generator=gen) * magnitude).to(dtype)


tensor_specs = st.lists(
    st.tuples(
        st.one_of(st.tuples(st.integers(0, 3000)), st.tuples(st.integers(0, 60), st.integers(0, 50))),
        st.sampled_from(DTYPES),
        st.sampled_from(["contiguous", "contiguous", "transposed", "sliced"]),
        st.sampled_from([1e-3, 1.0, 3e3]),  # gradient magnitude (3e3 * 64 overflows fp16: inf)
    ),
    min_size=0,
    max_size=5,
)


@pytest.mark.interpreter
@settings(max_examples=examples(15))
@given(
    specs=tensor_specs,
    inv_kind=st.sampled_from(["none", "float", "tensor"]),
    inv_value=st.sampled_from([1.0, 2.0**-16, 0.3, 64.0]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference(specs, inv_kind, inv_value, seed):
    from tplayers.kernels.grad_stats import INTERPRET

    assert INTERPRET == (kernel_device() == "cpu")  # the kernel itself runs (in the interpreter on CPU)
    gen = kernel_generator(seed)
    tensors = [make_tensor(*spec, gen) for spec in specs]
    inv_scale = {"none": None, "float": inv_value, "tensor": torch.tensor([inv_value])}[inv_kind]
    check_against_reference(tensors, inv_scale)


# --- explicit cases --------------------------------------------------------------------------


def three_tensors(gen, dtype=torch.float16):
    """A few blocks each at the interpreter's block of 512, 2-D and mixed dtypes."""
    return [
        torch.randn(40, 37, generator=gen).to(dtype),
        torch.randn(1200, generator=gen),
        torch.randn(13, 100, generator=gen).bfloat16(),
    ]


@pytest.mark.interpreter
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("inv_kind", ["none", "tensor"])
@pytest.mark.parametrize("where", [0, 1100])  # the first block, or the last of three
def test_non_finite_is_found(bad, inv_kind, where):
    gen = kernel_generator(1)
    tensors = three_tensors(gen)
    tensors[1][where] = bad
    inv_scale = None if inv_kind == "none" else torch.tensor([0.5])
    for (stats, found), _ in run_both(tensors, inv_scale):
        assert found.item() == 1.0
        if math.isnan(bad):  # nan in every column of that tensor's row
            assert torch.isnan(stats[1]).all()
        else:
            assert stats[1].tolist() == [math.inf] * 3
        assert torch.isfinite(stats[[0, 2]]).all()  # the other tensors are unaffected
    check_against_reference(tensors, inv_scale)


@pytest.mark.interpreter
def test_zeros_and_empty():
    tensors = [torch.zeros(700, dtype=torch.float16), torch.zeros(3, 0), torch.zeros(5, 5, dtype=torch.bfloat16)]
    for (stats, found), values in run_both(tensors, 0.25):
        assert torch.equal(stats, torch.zeros(3, 3)) and torch.equal(found, torch.zeros(1))
        assert_same_values(values, tensors)
    for result in (unscale_and_stats_([], 0.5), unscale_and_stats_ref([], None)):
        assert result[0].shape == (0, 3) and torch.equal(result[1].cpu(), torch.zeros(1, device="cpu"))
    only_empty = [torch.empty(0), torch.empty(0, 4, dtype=torch.float16)]
    check_against_reference(only_empty, torch.tensor([2.0]))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_unscale_and_vector_norm(dtype):
    """Values exactly as torch's GradScaler op leaves them; stats = 1-norm, squared 2-norm and
    inf-norm of each stored gradient; found_inf as torch's when inv_scale <= 1."""
    gen = kernel_generator(2)
    tensors = [t.mul(100) for t in three_tensors(gen, dtype)]
    tensors[0][3, 4] = math.inf
    inv_scale = torch.tensor([0.3])  # not a power of two: every product is rounded
    # torch's op on CPU copies: its CUDA kernel has no bf16
    expected, torch_found = [t.to("cpu", copy=True) for t in tensors], torch.zeros(1, device="cpu")
    torch._amp_foreach_non_finite_check_and_unscale_(expected, torch_found, inv_scale.cpu())
    expected, torch_found = [t.to(inv_scale.device) for t in expected], torch_found.to(inv_scale.device)
    for impl in (unscale_and_stats_, unscale_and_stats_ref):
        values = [t.clone() for t in tensors]
        stats, found = impl(values, inv_scale)
        assert_same_values(values, expected)
        assert torch.equal(found, torch_found)
        for i, g in enumerate(values[1:], start=1):  # the finite ones
            g = g.float()
            norm1, norm2, norm_inf = (torch.linalg.vector_norm(g, p) for p in (1, 2, math.inf))
            torch.testing.assert_close(stats[i, 0], norm1, **tolerance(torch.float32))
            torch.testing.assert_close(stats[i, 1].sqrt(), norm2, **tolerance(torch.float32))
            assert stats[i, 2] == norm_inf
        assert stats[0].tolist() == [math.inf] * 3


@pytest.mark.interpreter
def test_found_inf_is_taken_after_unscaling():
    """inv_scale > 1 can push a finite fp16 value past 65504: stored as inf, it is reported (torch's
    op checks the values before unscaling and would let it through)."""
    t = torch.tensor([1.0, 40000.0], dtype=torch.float16)
    for (stats, found), (values,) in run_both([t], 2.0):
        assert values.tolist() == [2.0, math.inf]
        assert found.item() == 1.0 and stats[0, 2].item() == math.inf
    torch_found = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_([t.clone()], torch_found, torch.tensor([2.0]))
    assert torch_found.item() == 0.0


@pytest.mark.interpreter
def test_stats_only_writes_nothing():
    gen = kernel_generator(3)
    tensors = three_tensors(gen)
    (result, values), (ref_result, ref_values) = run_both(tensors, None)
    assert_same_values(values, tensors)
    assert_same_values(ref_values, tensors)
    assert_same_result(result, ref_result)


@pytest.mark.interpreter
def test_many_blocks_per_tensor(monkeypatch):
    """Block of 64: tensors of dozens of blocks, each tensor's partials a longer segment."""
    from tplayers.kernels import grad_stats

    monkeypatch.setattr(grad_stats, "INTERPRETER_CONFIG", dict(BLOCK=64))
    gen = kernel_generator(4)
    tensors = three_tensors(gen) + [torch.randn(64, generator=gen), torch.randn(65, generator=gen).half()]
    tensors[2][12, 99] = math.nan  # the very last element of a tensor: the tail of its last block
    stats, _ = check_against_reference(tensors, 1 / 1024)[0]
    assert torch.isnan(stats[2]).all() and torch.isfinite(stats[[0, 1, 3, 4]]).all()


def test_negative_controls():
    """The comparison helpers fail on a deliberately wrong result."""
    gen = kernel_generator(5)
    tensors = three_tensors(gen)
    inv = torch.tensor([0.5])
    (result, values), (ref_result, ref_values) = run_both(tensors, inv)
    # One tensor skipped: its values are not unscaled and its stats row is missing.
    skipped = [t.clone() for t in tensors]
    part = unscale_and_stats_ref(skipped[:2], inv)
    with pytest.raises(AssertionError):
        assert_same_values(skipped, ref_values)
    with pytest.raises(AssertionError):
        assert_same_result(part, ref_result)
    # Rows swapped, or one unit in the last place of one value.
    with pytest.raises(AssertionError):
        assert_same_result((ref_result[0][[1, 0, 2]], ref_result[1]), ref_result)
    off_by_one = [t.clone() for t in ref_values]
    off_by_one[0].view(torch.int16)[0, 0] += 1
    with pytest.raises(AssertionError):
        assert_same_values(off_by_one, ref_values)
    # nan where a value was expected, and a wrong flag.
    with_nan = [t.clone() for t in ref_values]
    with_nan[1][7] = math.nan
    with pytest.raises(AssertionError):
        assert_same_values(with_nan, ref_values)
    with pytest.raises(AssertionError):
        assert_same_result((ref_result[0], torch.ones(1)), ref_result)


@pytest.mark.parametrize("impl", [unscale_and_stats_, unscale_and_stats_ref], ids=["triton", "ref"])
def test_argument_errors(impl):
    a = torch.randn(4, 6)
    before = a.clone()
    with pytest.raises(TypeError, match=r"tensors\[1\] must be fp32/fp16/bf16, got torch.int64"):
        impl([a, a.long()], None)
    with pytest.raises(TypeError, match="must be a list of tensors"):
        impl(a, None)
    with pytest.raises(ValueError, match=rf"tensors\[1\] is on meta but tensors\[0\] is on {a.device}"):
        impl([a, torch.empty(3, device="meta")], None)
    with pytest.raises(ValueError, match=r"1-element fp32 tensor, got shape \(2,\)"):
        impl([a], torch.ones(2))
    with pytest.raises(TypeError, match="inv_scale must be an fp32 tensor"):
        impl([a], torch.ones(1, dtype=torch.float16))
    with pytest.raises(ValueError, match="inv_scale is on meta"):
        impl([a], torch.ones(1, device="meta"))
    with pytest.raises(TypeError, match="inv_scale must be None, a float"):
        impl([a], "0.5")
    assert torch.equal(a, before)  # checked before anything is written
    for fine in (torch.tensor(0.5), 2, 0.5):  # a 0-dim tensor, python numbers
        impl([a.clone()], fine)
