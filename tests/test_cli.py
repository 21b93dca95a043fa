"""`tplayers demo`, the main job, end to end through the installed command."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "tplayers.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("flags", [[], ["--sequence-parallel", "--tp", "4", "--seq", "32"]], ids=["tp2", "tp4_sp"])
def test_demo_trains_and_matches_unsharded(tmp_path, flags):
    result = run_cli("demo", "--steps", "25", "--out", str(tmp_path), *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "agrees with the unsharded run to 0.0001 for 25 steps" in result.stdout, result.stdout
    rows = list(csv.DictReader(open(tmp_path / "loss.csv")))
    losses = [float(r["loss_tp"]) for r in rows]
    unsharded = [float(r["loss_unsharded"]) for r in rows]
    assert len(losses) == 25
    assert losses[-1] < 0.7 * losses[0]  # it learns
    assert max(abs(a - b) for a, b in zip(losses, unsharded, strict=True)) < 1e-4  # like the unsharded twin
    assert (tmp_path / "loss.png").stat().st_size > 0


@pytest.mark.interpreter
def test_demo_on_triton_backend(tmp_path):
    result = run_cli(
        "demo", "--steps", "3", "--backend", "triton", "--hidden", "16", "--ffn", "32",
        "--batch", "2", "--seq", "8", "--layers", "1", "--out", str(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "agrees with the unsharded run" in result.stdout


def test_demo_bad_input_exit_code_2(tmp_path):
    result = run_cli("demo", "--tp", "4", "--ffn", "102", cwd=tmp_path)
    assert result.returncode == 2
    assert "ffn (102) is not divisible by the tensor-parallel size (4)" in result.stderr


@pytest.mark.parametrize("launcher", ["torchrun", "local"])
def test_example_runs_under_torchrun_and_local_launcher(tmp_path, launcher):
    script = str(Path(__file__).parents[1] / "examples" / "train_llama.py")
    args = ["--steps", "5", "--sequence-parallel"]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, *args]
    else:
        cmd = [sys.executable, script, "--tp", "2", *args]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "agrees with unsharded for 5 of 5 steps" in result.stdout, result.stdout
