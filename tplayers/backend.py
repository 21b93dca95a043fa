"""Which implementation runs: the Triton kernel or its pure-torch reference.

`set_backend("auto" | "triton" | "torch")`, or env `TPLAYERS_BACKEND`. `triton` forces the kernels
(for benchmarking), `torch` the references. `auto` runs the reference on anything but CUDA tensors;
on CUDA an op that names itself (`uses_triton(t, op, key)`) runs its kernel only where the kernel
was measured faster than torch's own op at that shape, so `auto` is never slower than torch
(cuBLAS + the epilogue in torch, SDPA, HF's norm ops); the other ops their kernel. The kernel
modules are imported only when Triton is chosen, so `import tplayers` never imports triton.

The choice is measured once per (GPU name, op, dtype, shape class) on first use: the op's recipe
(`register`) builds random inputs of the shape class's representative size on the device and both
paths run, alternating, timed with CUDA events (median of REPS each after WARMUP). The kernel is
chosen where it is faster by more than EVEN; within that the two are even and torch's op runs. A
kernel that raises while measured is dispatched away. Shape classes round token counts up
(`token_bucket`, `dim_class`): a few classes per layer, the model's own dims near exact.

Every choice is kept in a JSON file (TPLAYERS_KERNEL_CHOICES, default
~/.cache/tplayers/kernel_choices.json), written under a file lock: the ranks of a node measure a
shape once and all read the same choice, so a computation replicated over ranks (a norm on the TP
ranks) runs the same kernel on each. Ranks on other nodes measure for themselves (a
tensor-parallel group spans one node). TPLAYERS_KERNEL_MEASURE=0: nothing is measured: the file's
choices where it has them, else the kernel. Nothing is measured while a CUDA graph is captured.
`tplayers bench --kernels` reports the `auto` path beside both.

Measured: every GEMM launch (`tplayers.backend.gemm`: the layers' forward, input and weight
gradients, the overlap engine's chunks; against cuBLAS + the epilogue in torch), RMSNorm forward +
backward (against HF's ops) and nn.ParallelAttention's attention forward + backward (against SDPA).
The SwiGLU backward, the gradient statistics and the vocabulary cross-entropy keep their kernels
(0.14-0.32x torch's time at every shape the bench measured on H100 / H200); the experts' grouped
GEMM keeps its kernel until its torch path runs `torch._grouped_mm`.
"""

import contextlib
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "triton", "torch")
_backend = os.environ.get("TPLAYERS_BACKEND", "auto")

CHOICES_ENV = "TPLAYERS_KERNEL_CHOICES"
MEASURE_ENV = "TPLAYERS_KERNEL_MEASURE"
DEFAULT_FILE = Path.home() / ".cache" / "tplayers" / "kernel_choices.json"
WARMUP, REPS = 3, 10
EVEN = 1.02  # the kernel must beat torch's op by more than this factor to be chosen

# op -> recipe(key, dtype, device) -> (run the kernel, run torch's op): zero-argument callables on
# random inputs of the shape class `key`
_RECIPES: dict[str, Callable] = {}
_chosen: dict = {}  # (op, key, dtype, device) -> whether the kernel runs, for this process


def register(op: str, recipe: Callable) -> None:
    """Make `op` measured: `recipe(key, dtype, device)` -> (kernel_fn, torch_fn) (module docstring)."""
    _RECIPES[op] = recipe


def token_bucket(n: int) -> int:
    """The shape class of a token count: the next power of two, at least 64."""
    return max(64, 1 << max(0, int(n) - 1).bit_length())


def choices_file() -> Path:
    return Path(os.environ.get(CHOICES_ENV) or DEFAULT_FILE)


def measuring_enabled() -> bool:
    return os.environ.get(MEASURE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def record_key(op: str, dtype, key: tuple) -> str:
    return f"{op}|{str(dtype).removeprefix('torch.')}|{','.join(str(k) for k in key)}"


def kernel_is_faster(op: str, key: tuple, dtype, device) -> bool:
    """Whether `auto` runs `op`'s Triton kernel at shape class `key` on `device` (module docstring)."""
    chosen = _chosen.get((op, key, dtype, device))  # every launch asks: one dict lookup once known
    if chosen is not None:
        return chosen
    gpu = torch.cuda.get_device_name(device)
    name = record_key(op, dtype, key)
    record = read_choices().get(gpu, {}).get(name)
    if record is None and measuring_enabled() and op in _RECIPES and not torch.cuda.is_current_stream_capturing():
        with _locked():
            record = read_choices().get(gpu, {}).get(name)  # another rank of the node may have measured it
            if record is None:
                record = measure(lambda: _RECIPES[op](key, dtype, device), device)
                _write(gpu, name, record)
    chosen = True if record is None else bool(record["kernel"])  # not measured: the kernel
    _chosen[(op, key, dtype, device)] = chosen
    return chosen


def measure(build, device) -> dict:
    """Both paths of `build()` -> (kernel_fn, torch_fn) timed alternately on `device`: {"kernel":
    chosen, "kernel_ms", "torch_ms"}, or the error of either (then torch's op is chosen)."""
    # a first use inside an evaluation (no_grad, inference mode) or under autocast measures the same
    # thing: the recipes build their inputs and run forward and backward in the dtype they were given
    outside = (torch.inference_mode(False), torch.enable_grad(), torch.autocast("cuda", enabled=False))
    try:
        with contextlib.ExitStack() as stack:
            for context in outside:
                stack.enter_context(context)
            paths = build()
            for fn in paths * WARMUP:
                fn()
            times = [[], []]
            for _ in range(REPS):
                for i, fn in enumerate(paths):
                    times[i].append(_elapsed_ms(fn))
    except Exception as e:  # noqa: BLE001 -- a kernel that fails here is dispatched away, not raised
        _synchronize(device)
        return {"kernel": False, "error": f"{type(e).__name__}: {e}"[:300]}
    kernel_ms, torch_ms = statistics.median(times[0]), statistics.median(times[1])
    return {"kernel": kernel_ms * EVEN < torch_ms, "kernel_ms": kernel_ms, "torch_ms": torch_ms}


def _elapsed_ms(fn) -> float:
    """One call of `fn`, timed on the device with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _synchronize(device):
    torch.cuda.synchronize(device)


def read_choices(path=None) -> dict:
    """{GPU name: {record key: record}} from the choices file ({} where it is missing or unreadable)."""
    path = Path(path) if path is not None else choices_file()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(gpu: str, name: str, record: dict) -> None:
    path = choices_file()
    data = read_choices(path)
    data.setdefault(gpu, {})[name] = record
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(f.name, path)  # readers see the old file or the new one, never half of one
    except OSError:  # a read-only home: the choice still holds for this process
        pass


@contextlib.contextmanager
def _locked():
    """The choices file's lock (a sibling .lock file), across the processes of this machine."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks: each process measures for itself
        yield
        return
    path = choices_file().with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")  # noqa: SIM115 -- held for the block
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def forget_choices() -> None:
    """Drop this process's cached choices (the file is read again on next use)."""
    _chosen.clear()


def set_backend(name: str) -> None:
    """Select the GEMM backend for every tplayers layer in this process."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


@contextlib.contextmanager
def backend_kept():
    """The backend selected now, selected again when the block ends, whatever the block selected
    (the test pool's workers serve one test after another)."""
    global _backend
    before = _backend
    try:
        yield
    finally:
        _backend = before


def get_backend() -> str:
    if _backend not in BACKENDS:
        raise ValueError(f"TPLAYERS_BACKEND must be one of {BACKENDS}, got {_backend!r}")
    return _backend


def uses_triton(tensor, op: str | None = None, key: tuple = ()) -> bool:
    """Whether `tensor`'s op runs the Triton kernel (module docstring): `op` and its shape class
    `key` make `auto` measure it against torch's op (a recipe registered in tplayers.backend)."""
    backend = get_backend()
    if backend != "auto":
        return backend == "triton"
    if not tensor.is_cuda:
        return False
    if op is None:
        return True
    return kernel_is_faster(op, key, tensor.dtype, tensor.device)


def dim_class(n: int) -> int:
    """A GEMM dim's shape class: the next power of two up to 256, then a multiple of 256 up to
    4096 and of 1024 beyond: varying token counts meet a few classes, model dims stay near exact."""
    n = int(n)
    if n <= 256:
        return max(16, 1 << max(0, n - 1).bit_length())
    step = 256 if n <= 4096 else 1024
    return -(-n // step) * step


def _gemm_key(a, b, epilogue) -> tuple:
    """The shape class of a GEMM launch: (M, N, K) classes, its batch form, each operand's layout
    (unit stride along K or not: a weight gradient reads transposed activations) and its epilogue."""
    given = lambda name: int(epilogue.get(name) is not None)  # noqa: E731
    return (
        dim_class(a.shape[-2]), dim_class(b.shape[-2]), dim_class(a.shape[-1]), a.shape[0] if a.dim() == 3 else 0,
        int(b.dim() == 3), "".join("k" if t.stride(-1) == 1 else "r" for t in (a, b)), given("bias"),
        epilogue.get("activation") or "", given("residual"), int(bool(epilogue.get("accumulate"))),
        int(bool(epilogue.get("reduce_batch"))), given("swiglu_out"),
    )  # fmt: skip


def gemm_runs_triton(a, b, **epilogue) -> bool:
    """Whether `gemm(a, b, **epilogue)` runs the Triton kernel (under auto: measured per shape class)."""
    measured = a.is_cuda and get_backend() == "auto"  # the shape class only where it decides
    return uses_triton(a, "gemm", _gemm_key(a, b, epilogue) if measured else ())


def gemm(a, b, **epilogue):
    """`matmul(a, b, **epilogue)` on the selected backend (see kernels/matmul.py for the contract)."""
    if gemm_runs_triton(a, b, **epilogue):
        from tplayers.kernels.matmul import matmul

        return matmul(a, b, **epilogue)
    return torch_gemm(a, b, **epilogue)


def torch_gemm(a, b, **epilogue):
    """The GEMM and its epilogue in torch's ops. An activation / residual epilogue of a plain 2-D GEMM
    runs as eager code runs it (F.linear, then each op in the output's dtype: what a model's own
    forward costs, and what `auto` weighs the kernel against); the rest is `matmul_ref`."""
    from tplayers.kernels.matmul_ref import check_args, matmul_ref  # the reference module does not import triton

    activation, residual, scale = epilogue.get("activation"), epilogue.get("residual"), epilogue.get("scale", 1.0)
    if activation is None and residual is None and scale == 1.0:  # every GEMM a layer runs: the reference's
        return matmul_ref(a, b, **epilogue)
    bias, out, out_dtype = epilogue.get("bias"), epilogue.get("out"), epilogue.get("out_dtype")
    target = out.dtype if out is not None else (out_dtype or a.dtype)
    same_dtype = target == a.dtype == b.dtype and all(t is None or t.dtype == a.dtype for t in (bias, residual))
    plain_2d = b.dim() == 2 and epilogue.get("swiglu_out") is None and not (
        epilogue.get("accumulate") or epilogue.get("reduce_batch"))  # fmt: skip
    if not (same_dtype and plain_2d):
        return matmul_ref(a, b, **epilogue)
    check_args(a, b, bias, activation, residual, out, False, False, out_dtype)
    c = F.linear(a, b, bias)
    if scale != 1.0:
        c = c * scale
    if activation is not None:
        c = F.gelu(c, approximate="tanh") if activation == "gelu_tanh" else F.silu(c)
    if residual is not None:
        c = c + residual
    return c if out is None else out.copy_(c)


def _gemm_recipe(key, dtype, device):
    """Random operands of the class `key` (`_gemm_key`), with its layouts and epilogue, and the two
    paths on them (a recipe, `register`)."""
    from tplayers.kernels.matmul import matmul

    M, N, K, batch, batched_b, layout, bias, activation, residual, accumulate, reduce, swiglu = key
    lead = (batch,) if batch else ()

    def operand(rows, k_major, batched=True):
        t = torch.randn((*(lead if batched else ()), rows, K), device=device, dtype=dtype)
        return t if k_major else t.transpose(-1, -2).contiguous().transpose(-1, -2)

    def new(shape, out_dtype=dtype):
        return torch.randn(shape, device=device, dtype=out_dtype)

    a, b = operand(M, layout[0] == "k"), operand(N, layout[1] == "k", batched_b)
    out_shape = (M, N) if reduce or not batch else (batch, M, N)
    out = new(out_shape, torch.float32 if accumulate else dtype)
    epilogue = dict(
        bias=new(N) if bias else None, activation=activation or None, residual=new(out_shape) if residual else None,
        accumulate=bool(accumulate), reduce_batch=bool(reduce),
        swiglu_out=new((*out_shape[:-1], N // 2)) if swiglu else None,
    )  # fmt: skip
    return (lambda: matmul(a, b, out=out, **epilogue)), (lambda: torch_gemm(a, b, out=out, **epilogue))


def unscale_and_stats_(tensors, inv_scale):
    """`unscale_and_stats_` (kernels/grad_stats.py) on the selected backend: multiplies `tensors`
    in place by `inv_scale` (None: no write) and returns per tensor [sum |g|, sum g^2, max |g|]
    (fp32, (len(tensors), 3)) and the found-inf flag (fp32, (1,))."""
    if tensors and uses_triton(tensors[0]):
        from tplayers.kernels.grad_stats import unscale_and_stats_ as fused
    else:
        from tplayers.kernels.grad_stats_ref import unscale_and_stats_ref as fused
    return fused(tensors, inv_scale)


register("gemm", _gemm_recipe)
