"""The GPU test path (`pytest -m kernel tests` under TPLAYERS_TEST_DEVICE=cuda, which `tplayers
bench --kernels` runs first) collects on any machine: collecting never touches the device, so a
module-level tensor made with a CPU generator cannot break it (it broke 12 files once). Checked here
on CPU, where any use of "cuda" at collection raises."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def collect(*args):
    env = {**os.environ, "TPLAYERS_TEST_DEVICE": "cuda"}
    env.pop("TRITON_INTERPRET", None)  # as a GPU run starts: conftest decides
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args, str(TESTS)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_kernel_tests_collect_under_the_cuda_device():
    run = collect("-m", "kernel")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert "error" not in summary and " collected" in summary, summary
    kernel_files = {line.split("::")[0] for line in run.stdout.splitlines() if "::" in line}
    assert {"tests/test_matmul_kernel.py", "tests/test_flash_attention_kernel.py"} <= {
        str(Path(f).relative_to(TESTS.parent)) if Path(f).is_absolute() else f for f in kernel_files
    }, kernel_files
