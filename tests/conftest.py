import os

# Triton reads this when it is imported: the Triton backend then runs in the interpreter on CPU.
# TPLAYERS_TEST_DEVICE=cuda (`tplayers bench --kernels` on a GPU) runs the `kernel` tests there
# instead, compiled, with tensors made on that device; the rest of the suite is CPU ranks only.
KERNEL_DEVICE = os.environ.get("TPLAYERS_TEST_DEVICE", "cpu")
if KERNEL_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
else:  # each hypothesis example is a new shape: one config each, not every config timed on each
    os.environ.setdefault("TPLAYERS_AUTOTUNE", "0")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# overlap="auto" keeps the paths it measures in the costs file: the suite's own file, not the
# machine's ~/.cache (the ranks the pools start and the CLI tests' processes inherit it).
os.environ["TPLAYERS_OVERLAP_COSTS"] = os.path.join(
    __import__("tempfile").mkdtemp(prefix="tplayers-tests-"), "overlap_costs.json"
)
# backend="auto" keeps its measured kernel choices in a file too: the suite's own.
os.environ["TPLAYERS_KERNEL_CHOICES"] = os.path.join(os.path.dirname(os.environ["TPLAYERS_OVERLAP_COSTS"]),
                                                     "kernel_choices.json")  # fmt: skip
# Measuring (overlap="auto" timing both paths on a new shape's first calls) makes the same call
# give the ring's bits once and the plain path's the next (they sum in different orders), as
# cudnn.benchmark does: the suite checks bit-exact repeats, so it runs the model's choice alone,
# like a bit-reproducible run. tests/test_overlap_measure.py turns measuring on where it tests it.
os.environ["TPLAYERS_OVERLAP_MEASURE"] = "0"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from tplayers.testing import WorkerPool  # noqa: E402

# References run without TF32 (no effect on CPU; keeps GPU runs of this suite honest).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(autouse=True)
def _kernel_device(request):
    """A kernel test's tensors are made on TPLAYERS_TEST_DEVICE by default, while it runs: set then,
    not at import, so that collecting the suite (module-level tensors, CPU generators) never
    touches the device (tests/test_gpu_path.py keeps it so)."""
    if KERNEL_DEVICE == "cpu" or "kernel" not in request.keywords:
        yield
        return
    torch.set_default_device(KERNEL_DEVICE)
    try:
        yield
    finally:
        torch.set_default_device(None)


def pytest_collection_modifyitems(config, items):
    if KERNEL_DEVICE == "cpu":
        return
    off = pytest.mark.skip(reason=f"TPLAYERS_TEST_DEVICE={KERNEL_DEVICE} runs the kernel tests only; the rest of "
                           "the suite runs on local gloo CPU ranks (run it without TPLAYERS_TEST_DEVICE)")  # fmt: skip
    for item in items:
        if "kernel" not in item.keywords:
            item.add_marker(off)


settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# Longer runs: TPLAYERS_EXAMPLES_SCALE=10 multiplies every test's example count;
# HYPOTHESIS_PROFILE=random draws fresh examples instead of the fixed CI sequence.
settings.register_profile(
    "random",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def pool():
    """Four local gloo ranks, started once and shared by every multi-rank test."""
    with WorkerPool(world_size=4) as workers:
        yield workers
