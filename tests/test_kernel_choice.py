"""backend="auto"'s measured choice (tplayers.backend): the kernel runs only where it was
timed faster than torch's op by more than EVEN; a kernel that fails is dispatched away; choices
are measured once per (GPU, op, dtype, shape class), kept in the choices file and shared by the
processes of a machine under its lock. Timings and the GPU are faked here (no CUDA on CI); each
op's recipe runs for real, both paths, in Triton's interpreter, so a recipe that would crash on
its first GPU use fails here."""

import json
import multiprocessing
import os
import time

import pytest
import torch
import torch.nn.functional as F

from tplayers import backend
from tplayers.testing import assert_close


@pytest.fixture
def choices(tmp_path, monkeypatch):
    """A fresh choices file, a fake GPU named "Fake GPU", and no cached choice."""
    path = tmp_path / "choices.json"
    monkeypatch.setenv(backend.CHOICES_ENV, str(path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(backend, "_synchronize", lambda device: None)
    backend.forget_choices()
    yield path
    backend.forget_choices()


def fake_timings(monkeypatch, kernel_ms, torch_ms):
    """Each call of a path takes the given time (the kernel path is the recipe's first)."""
    monkeypatch.setattr(backend, "_elapsed_ms", lambda fn: fn())
    return (lambda: kernel_ms), (lambda: torch_ms)


@pytest.mark.parametrize(
    "kernel_ms, torch_ms, chosen",
    [(1.0, 1.5, True), (1.0, 1.01, False), (1.2, 1.0, False), (1.0, 1.0, False)],
    ids=["faster", "within-even", "slower", "tie"],
)
def test_the_kernel_only_where_faster_by_more_than_even(choices, monkeypatch, kernel_ms, torch_ms, chosen):
    backend.register("fake-op", lambda key, dtype, device: fake_timings(monkeypatch, kernel_ms, torch_ms))
    assert backend.kernel_is_faster("fake-op", (64, 8), torch.bfloat16, "cuda:0") is chosen
    record = json.loads(choices.read_text())["Fake GPU"]["fake-op|bfloat16|64,8"]
    assert record == {"kernel": chosen, "kernel_ms": kernel_ms, "torch_ms": torch_ms}


def test_a_kernel_that_fails_is_dispatched_away(choices, monkeypatch):
    def broken():
        raise RuntimeError("out of resources: shared memory")

    backend.register("broken-op", lambda key, dtype, device: (broken, lambda: None))
    assert backend.kernel_is_faster("broken-op", (1,), torch.float16, "cuda:0") is False
    record = json.loads(choices.read_text())["Fake GPU"]["broken-op|float16|1"]
    assert record["kernel"] is False and "out of resources" in record["error"]


@pytest.mark.interpreter
def test_a_first_use_inside_an_evaluation_measures_forward_and_backward(choices, monkeypatch):
    """Met first under torch.no_grad / inference mode (an eval loop), the norm's recipe still runs
    its backward: the choice is the timing's, not a failure's."""
    import tplayers.functional.rms_norm  # noqa: F401 -- registers its recipe

    monkeypatch.setattr(backend, "_elapsed_ms", lambda fn: (fn(), 1.0)[1])
    for context in (torch.no_grad, torch.inference_mode):
        backend.forget_choices()
        choices.unlink(missing_ok=True)
        with context():
            backend.kernel_is_faster("rms_norm", (64, 32, "torch.float32"), torch.float32, torch.device("cpu"))
        record = json.loads(choices.read_text())["Fake GPU"]["rms_norm|float32|64,32,torch.float32"]
        assert "error" not in record and record["kernel"] is False, record  # even: torch's op


def test_measured_once_then_read_from_the_file(choices, monkeypatch):
    calls = []

    def recipe(key, dtype, device):
        calls.append(key)
        return fake_timings(monkeypatch, 1.0, 2.0)

    backend.register("counted-op", recipe)
    for _ in range(3):
        assert backend.kernel_is_faster("counted-op", (128,), torch.bfloat16, "cuda:0")
    backend.forget_choices()  # a new process: the file answers
    assert backend.kernel_is_faster("counted-op", (128,), torch.bfloat16, "cuda:0")
    assert calls == [(128,)]
    assert backend.kernel_is_faster("counted-op", (256,), torch.bfloat16, "cuda:0")  # another class
    assert calls == [(128,), (256,)]


def test_without_measuring_the_file_or_the_kernel(choices, monkeypatch):
    backend.register("never-measured", lambda *_: pytest.fail("measured with measuring off"))
    monkeypatch.setenv(backend.MEASURE_ENV, "0")
    assert backend.kernel_is_faster("never-measured", (64,), torch.bfloat16, "cuda:0")
    choices.write_text(json.dumps({"Fake GPU": {"never-measured|bfloat16|128": {"kernel": False}}}))
    assert not backend.kernel_is_faster("never-measured", (128,), torch.bfloat16, "cuda:0")
    assert not choices.with_suffix(".lock").exists()


def _measure_in_another_process(path, log):
    os.environ[backend.CHOICES_ENV] = path
    torch.cuda.get_device_name = lambda *_: "Fake GPU"
    torch.cuda.is_current_stream_capturing = lambda: False
    backend._elapsed_ms = lambda fn: fn()

    def recipe(key, dtype, device):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # the other process arrives while this one measures
        return (lambda: 1.0), (lambda: 3.0)

    backend.register("shared-op", recipe)
    return backend.kernel_is_faster("shared-op", (64,), torch.bfloat16, "cuda:0")


def test_the_processes_of_a_machine_measure_a_shape_once(tmp_path):
    """Two ranks meeting a new shape at once: one measures under the lock, the other reads its
    choice (so a replicated computation runs the same kernel on both)."""
    log = tmp_path / "measured.txt"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(_measure_in_another_process, [(str(tmp_path / "c.json"), str(log))] * 2)
    assert results == [True, True]
    assert len(log.read_text().split()) == 1


def test_uses_triton_follows_the_backend(monkeypatch):
    x = torch.zeros(2)
    for name, expected in (("triton", True), ("torch", False), ("auto", False)):  # auto on CPU: the reference
        monkeypatch.setattr(backend, "_backend", name)
        assert backend.uses_triton(x, "gemm", ()) is expected


def test_shape_classes():
    assert [backend.dim_class(n) for n in (1, 17, 256, 257, 4096, 4097, 5632, 8192)] == [
        16, 32, 256, 512, 4096, 5120, 6144, 8192
    ]  # fmt: skip
    assert [backend.token_bucket(n) for n in (1, 64, 65, 3000, 8192)] == [64, 64, 128, 4096, 8192]
    a, w = torch.zeros(100, 64), torch.zeros(96, 64)
    plain = backend._gemm_key(a, w, {})
    assert plain == (128, 128, 64, 0, 0, "kk", 0, "", 0, 0, 0, 0)
    wgrad = backend._gemm_key(
        torch.zeros(3, 40, 96).mT, torch.zeros(3, 40, 64).mT, dict(accumulate=True, reduce_batch=True)
    )
    assert wgrad[3:6] == (3, 1, "rr") and wgrad[9:11] == (1, 1)


# -- each recipe, both paths, for real (Triton's interpreter on CPU) ----------------------------


def _run_recipe(op, key, dtype):
    kernel_fn, torch_fn = backend._RECIPES[op](key, dtype, torch.device("cpu"))
    kernel_fn()
    torch_fn()


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "key",
    [
        (32, 48, 16, 0, 0, "kk", 1, "", 0, 0, 0, 0),  # a layer's forward with bias
        (32, 48, 16, 0, 0, "kk", 1, "", 0, 0, 0, 1),  # with the SwiGLU output
        (32, 48, 16, 0, 0, "kk", 1, "gelu_tanh", 1, 0, 0, 0),  # activation and residual
        (32, 48, 16, 2, 0, "kr", 0, "", 0, 0, 0, 0),  # batched, the weight transposed (dgrad)
        (48, 32, 16, 2, 1, "rr", 0, "", 0, 1, 1, 0),  # the weight gradient, accumulated over the batch
    ],
)
def test_gemm_recipe_runs_both_paths(key):
    _run_recipe("gemm", key, torch.float32)


@pytest.mark.interpreter
def test_rms_norm_and_attention_recipes_run_both_paths():
    import tplayers.functional.rms_norm  # noqa: F401 -- registers its recipe
    import tplayers.nn.attention  # noqa: F401

    _run_recipe("rms_norm", (64, 32, "torch.float32"), torch.float32)
    _run_recipe("attention", (64, 4, 2, 32, 16, 1, 0), torch.float32)
    _run_recipe("attention", (64, 2, 2, 32, 16, 0, 1), torch.float32)


@pytest.mark.interpreter
def test_auto_gives_the_same_results_either_way(choices, monkeypatch):
    """The GEMM through `gemm` on "auto", the choice either way, equals the reference (what the
    choice decides is speed, never the numbers beyond the tolerance table)."""
    a, w = torch.randn(20, 16), torch.randn(24, 16)
    want = a @ w.T
    monkeypatch.setattr(backend, "_backend", "auto")
    for chosen in (True, False):
        monkeypatch.setattr(backend, "kernel_is_faster", lambda *_, c=chosen: c)
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        got = backend.gemm(a, w)
        monkeypatch.undo()
        assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation, residual", [("gelu_tanh", False), ("silu", True), (None, True)])
def test_the_torch_path_of_an_epilogue_is_eager_code(dtype, activation, residual):
    """torch_gemm runs an activation / residual epilogue as a model's own forward does (F.linear,
    then each op in the output's dtype: bitwise that code, what auto weighs the kernel against),
    within the table of the fp32-epilogue reference; `out` receives it. Anything else is the reference."""
    from tplayers.kernels.matmul_ref import matmul_ref

    gen = torch.Generator().manual_seed(0)
    a, w, bias = (torch.randn(*s, generator=gen).to(dtype) for s in ((12, 16), (24, 16), (24,)))
    res = torch.randn(12, 24, generator=gen).to(dtype) if residual else None
    act = {None: lambda t: t, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}[activation]
    eager = act(F.linear(a, w, bias)) + (res if residual else 0)
    out = torch.empty(12, 24, dtype=dtype)
    got = backend.torch_gemm(a, w, bias=bias, activation=activation, residual=res, out=out)
    assert got is out and torch.equal(out, eager)
    assert_close(out, matmul_ref(a, w, bias=bias, activation=activation, residual=res))
    if dtype != torch.float32:  # a wider output dtype: the reference, computed in it
        wide = dict(bias=bias, activation=activation, residual=res, out_dtype=torch.float32)
        assert torch.equal(backend.torch_gemm(a, w, **wide), matmul_ref(a, w, **wide))
