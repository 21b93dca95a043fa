"""`tplayers bench --kernels` (bench/kernels.py) without a GPU: the refusal, and the script's whole
check / time / row / CSV / PNG pipeline on CPU with the pure-torch references in the Triton
launchers' place, on tiny shapes."""

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


@pytest.fixture
def kernels_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # its `from linear import ...`, as when run as a script
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny(kb):
    from amp import Decoder

    grads = Decoder("tiny", hidden=16, layers=1, ffn=32, kv_hidden=8, vocab=50)
    return kb.Shapes(gemms=((32, 48, 16),), swiglu=((8, 32),), grads=grads, vocab=((8, 100),),
                     grouped=((24, 3, 16, 8),), warmup_ms=1, rep_ms=1)  # fmt: skip


@no_gpu
def test_bench_kernels_without_a_gpu_runs_the_interpreter(tmp_path):
    """`tplayers bench --kernels` on a machine without CUDA: it says so, then runs every case on
    tiny shapes in Triton's interpreter, checks them and writes its CSV and PNG."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it itself
    # --no-tests (passed through to the script) only matters on a GPU: the interpreter's suite runs them itself
    cli = [sys.executable, "-m", "tplayers.tools.cli", "bench", "--kernels", "--no-tests", "--out", str(tmp_path)]
    result = subprocess.run(cli, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "bench/kernels.py: no CUDA GPU is visible" in result.stderr and "interpreter" in result.stderr
    rows = list(csv.DictReader(open(tmp_path / "kernels" / "kernels.csv")))
    assert {r["kernel"] for r in rows} == {
        "matmul",
        "swiglu",
        "grad_stats",
        "vocab_ce",
        "grouped_matmul",
        "flash_attention",
    }
    assert all(r["ok"] == "True" for r in rows) and {r["device"] for r in rows} == {"cpu (Triton interpreter)"}
    assert (tmp_path / "kernels" / "kernels.png").stat().st_size > 0


def test_bench_kernels_refuses_other_scripts_flags(tmp_path):
    cli = [sys.executable, "-m", "tplayers.tools.cli", "bench", "--kernels", "--only", "amp"]
    result = subprocess.run(cli, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--kernels runs bench/kernels.py alone" in result.stderr
    result = subprocess.run(cli[:3] + ["bench", "--no-tests"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 2 and "--no-tests belongs to --kernels" in result.stderr


def test_shapes_cover_every_kernel(kernels_bench):
    kb = kernels_bench
    assert all(2048 <= d <= 8192 for shape in kb.SHAPES.gemms for d in shape)
    numel = sum(torch.Size(s).numel() for s in kb.SHAPES.grads.shapes())
    assert 80e6 < numel < 150e6  # a ~100M-parameter model's gradients
    assert {V for _, V in kb.SHAPES.vocab} == {32000, 128256}
    for shapes in (kb.SHAPES, kb.QUICK_SHAPES):
        cases = kb.cases(shapes)
        assert {c.kernel for c in cases} == {
            "matmul",
            "swiglu",
            "grad_stats",
            "vocab_ce",
            "grouped_matmul",
            "flash_attention",
        }
        assert {c.op for c in cases if c.kernel == "matmul"} == {f"matmul{e}" for e in kb.EPILOGUES}
        assert all((c.flops > 0) != (c.nbytes > 0) for c in cases)  # TFLOP/s or GB/s, one of them


def test_pipeline_on_cpu_with_the_references(kernels_bench, tmp_path):
    kb = kernels_bench
    cases = kb.cases(tiny(kb))
    logged = []
    impl, timer = kb.reference_kernels(), kb.wall_clock_timer(1)
    rows = kb.run(cases, impl, torch.device("cpu"), timer, log=lambda *pair: logged.append(pair))
    assert len(rows) == 2 * len(cases) and len(logged) == len(cases)
    assert [r["provider"] for r in rows] == ["triton", "torch"] * len(cases)
    assert all(r["ok"] and r["err_over_tol"] <= 1 for r in rows), [r for r in rows if not r["ok"]]
    assert all(r["ratio_to_torch"] == 1.0 for r in rows if r["provider"] == "torch")
    assert all((r["tflops"] == "") != (r["gbps"] == "") for r in rows)
    for row in rows:
        row.update(device="cpu", torch=torch.__version__, triton="")
    kb.write_csv(rows, tmp_path / "kernels.csv", kb.FIELDS)
    kb.plot(rows, tmp_path / "kernels.png")
    back = list(csv.DictReader(open(tmp_path / "kernels.csv")))
    assert tuple(back[0]) == kb.FIELDS and len(back) == len(rows)
    assert {r["ok"] for r in back} == {"True"} and (tmp_path / "kernels.png").stat().st_size > 0


def test_a_wrong_kernel_is_not_ok(kernels_bench):
    """Negative control: an fp16 matmul off by 1 % fails the check; a swiglu off by one fp16 step
    near 1, well inside the table's tolerance, passes it."""
    kb = kernels_bench
    impl = kb.reference_kernels()
    refs = vars(impl).copy()
    impl.matmul = lambda a, b, **kw: refs["matmul"](a, b, **kw) * 1.01
    impl.swiglu = lambda gate, up: refs["swiglu"](gate, up) + 2**-10
    cases = [c for c in kb.cases(tiny(kb)) if c.op in ("matmul", "swiglu") and c.dtype == torch.float16]
    rows = kb.run(cases, impl, torch.device("cpu"), kb.wall_clock_timer(1))
    verdict = {r["op"]: r["ok"] for r in rows if r["provider"] == "triton"}
    assert verdict == {"matmul": False, "swiglu": True}


def test_compare_takes_nan_on_one_side_as_a_mismatch(kernels_bench):
    compare = kernels_bench.compare
    nan = float("nan")
    assert compare(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0])) == (0.0, 0.0)
    max_abs, over = compare(torch.tensor([nan, 1.0]), torch.tensor([1.0, 1.0]))
    assert max_abs != max_abs and not over <= 1  # nan: reported, and not ok
    assert compare((torch.ones(2), torch.ones(3)), (torch.ones(2), torch.full((3,), 1.5)))[0] == 0.5


def test_compare_to_fp64_takes_the_side_nearer_the_truth(kernels_bench):
    """A long low-precision reduction: Triton off from torch by more than the table allows, but
    nearer the fp64 run than torch is, passes; one further from it than torch fails."""
    compare_to_fp64 = kernels_bench.compare_to_fp64
    exact = torch.arange(-32.0, 32.0, dtype=torch.float64) * 3  # exact in fp32 too
    torch_off = (exact + torch.where(torch.arange(64) % 2 == 0, 0.5, -0.5)).float()  # rms 0.5
    assert compare_to_fp64(exact.float(), torch_off, exact)[1] == 0.0
    assert compare_to_fp64((exact + 0.55).float(), torch_off, exact)[1] <= 1.0  # within the quarter's slack
    assert compare_to_fp64((exact + 1.0).float(), torch_off, exact)[1] > 1.0
    assert compare_to_fp64(torch_off, torch_off, exact)[1] == 0.0  # equal to torch: the table's ratio


def test_kernel_tests_run_where_they_are_sent(kernels_bench, tmp_path):
    """What `bench --kernels` runs on a GPU first: the suite's `kernel` tests on the device it
    names (here the CPU, in the interpreter: two files, the whole set runs in the suite itself),
    their summary written next to the CSV; only the kernel tests are selected."""
    files = ("tests/test_grouped_matmul_kernel.py", "tests/test_vocab.py")
    assert kernels_bench.run_kernel_tests("cpu", tmp_path, files) == 0
    summary = (tmp_path / "kernel_tests.txt").read_text()
    assert " passed" in summary and " failed" not in summary and " deselected" in summary  # test_vocab's others
