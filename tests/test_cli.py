"""`tplayers demo` (the main job) and `tplayers plan`, end to end through the command line."""

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "tplayers.tools.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def run_main(*args, capsys) -> tuple[int, str]:
    """(exit code, stderr) of the command line run in this process: for inputs refused before any
    work (no interpreter to start: the exit code of a real process is checked once, below)."""
    from tplayers.tools.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    return code, capsys.readouterr().err


DEMO_STEPS = 20  # enough to learn: the loss ends below 0.7 x its start in every case here


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--sequence-parallel", "--tp", "4", "--seq", "32", "--overlap", "on"],
        ["--dp", "2", "--tp", "2", "--zero", "3", "--no-overlap"],
        ["--pp", "2", "--tp", "2", "--sequence-parallel"],
        # heads 4, kv heads 2, ffn 100, vocabulary 256, 31 tokens under sequence parallelism: none divides by 3
        ["--tp", "3", "--ffn", "100", "--sequence-parallel", "--seq", "31"],
        ["--tp", "2x2", "--sequence-parallel"],  # a 2-D grid (tplayers.hf.grid), the sequence over tp_r
        ["--cp", "2", "--dp", "2", "--tp", "1"],  # context parallelism, gradients reduced over dp x cp
    ],
    ids=[
        "tp2",
        "tp4_sp_overlap_on",
        "dp2_tp2_zero3_overlap_off",
        "pp2_tp2_sp",
        "tp3_uneven",
        "grid_2x2_sp",
        "cp2_dp2",
    ],  # fmt: skip
)
def test_demo_trains_and_matches_unsharded(tmp_path, flags):
    result = run_cli("demo", "--steps", str(DEMO_STEPS), "--out", str(tmp_path), *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"agrees with the unsharded fp32 run to 0.0001 for {DEMO_STEPS} steps" in result.stdout, result.stdout
    rows = list(csv.DictReader(open(tmp_path / "loss.csv")))
    losses = [float(r["loss_tp"]) for r in rows]
    unsharded = [float(r["loss_unsharded"]) for r in rows]
    assert len(losses) == DEMO_STEPS
    assert losses[-1] < 0.7 * losses[0]  # it learns
    assert max(abs(a - b) for a, b in zip(losses, unsharded, strict=True)) < 1e-4  # like the unsharded twin
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert "model state per rank (rank 0): params" in result.stdout
    # the yardstick: both fp32 runs against the unsharded model trained in fp64
    assert list(rows[0]) == ["step", "loss_tp", "loss_unsharded", "loss_fp64", "tp_vs_fp64", "unsharded_vs_fp64"]
    for row in rows:
        assert float(row["tp_vs_fp64"]) == abs(float(row["loss_tp"]) - float(row["loss_fp64"]))
        assert float(row["unsharded_vs_fp64"]) < 1e-4  # fp32 rounding only, over the steps
    assert re.search(r"\|loss - fp64 loss\| median / largest over the steps: sharded \S+ / \S+, unsharded fp32 "
                     r"\S+ / \S+ \(ratio of the medians \S+\)", result.stdout), result.stdout  # fmt: skip
    assert re.search(r"from the fp64 run at the end: sharded \S+, unsharded fp32 \S+", result.stdout), result.stdout


def test_demo_3d_dp2_pp2_tp2_zero3_on_8_ranks(tmp_path):
    """The 3-D main job: 8 local ranks, each its stage's shard of its replica's share."""
    result = run_cli("demo", "--dp", "2", "--pp", "2", "--tp", "2", "--zero", "3", "--steps", "3",
                     "--out", str(tmp_path), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "agrees with the unsharded fp32 run to 0.0001 for 3 steps" in result.stdout, result.stdout
    assert "one of 2 pipeline stages" in result.stdout


def test_demo_saves_and_resumes_at_another_layout(tmp_path):
    """Sharded checkpoints through the main job: 3 steps at DP 2 x TP 2 (ZeRO-3) saved, 3 more at
    PP 2 x TP 2 from the checkpoint, on track with the unsharded twin and with a straight run."""
    saved = run_cli("demo", "--dp", "2", "--tp", "2", "--zero", "3", "--steps", "3", "--save", str(tmp_path / "ck"),
                    "--save-every", "1", "--out", str(tmp_path / "first"), cwd=tmp_path)  # fmt: skip
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_2", "step_3"]  # --keep 2
    resumed = run_cli("demo", "--pp", "2", "--tp", "2", "--steps", "6", "--resume", str(tmp_path / "ck"),
                      "--out", str(tmp_path / "second"), cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "agrees with the unsharded fp32 run to 0.0001 for 6 steps" in resumed.stdout, resumed.stdout
    first = [float(r["loss_tp"]) for r in csv.DictReader(open(tmp_path / "first" / "loss.csv"))]
    second = [float(r["loss_tp"]) for r in csv.DictReader(open(tmp_path / "second" / "loss.csv"))]
    assert second[:3] == first and len(second) == 6
    bad = run_cli("demo", "--resume", str(tmp_path / "nothing"), cwd=tmp_path)
    assert bad.returncode == 2 and "no checkpoint folder there" in bad.stderr


@pytest.mark.interpreter
def test_demo_on_triton_backend(tmp_path):
    result = run_cli(
        "demo", "--steps", "3", "--backend", "triton", "--hidden", "16", "--ffn", "32",
        "--batch", "2", "--seq", "8", "--layers", "1", "--out", str(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "agrees with the unsharded fp32 run" in result.stdout


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--hidden", "66"], "hidden (66) is not divisible by heads (4)"),
        (["--tp", "4x1", "--sequence-parallel", "--seq", "3"], "seq (3) is shorter than tp_r (4)"),
        (["--tp", "2y2"], "--tp takes a size (8) or a grid RxC (4x4), got '2y2'"),
    ],
)
def test_demo_bad_input_exit_code_2(capsys, flags, said):
    code, err = run_main("demo", *flags, capsys=capsys)
    assert code == 2
    assert said in err


@pytest.mark.parametrize(
    "launcher, extra",
    [
        ("torchrun", []),
        ("local", []),
        ("torchrun", ["--dtype", "fp16", "--micro-batches", "2"]),
        ("torchrun4", ["--dp", "2", "--zero", "3"]),
    ],
    ids=["torchrun", "local", "torchrun-fp16", "torchrun-dp2-zero3"],
)
def test_example_runs_under_torchrun_and_local_launcher(tmp_path, launcher, extra):
    script = str(Path(__file__).parents[1] / "examples" / "train_llama.py")
    args = ["--steps", "5", "--sequence-parallel", *extra]
    if launcher.startswith("torchrun"):
        ranks = "4" if launcher == "torchrun4" else "2"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ranks, script, *args]
    else:
        cmd = [sys.executable, script, "--tp", "2", *args]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "agrees with unsharded for 5 of 5 steps" in result.stdout, result.stdout


def test_plan_estimate_search_and_csv(tmp_path):
    result = run_cli(
        "plan", "--model", "llama3-70b", "--cluster", "h100-80gb", "--gpus", "512", "--tp", "8", "--pp", "4",
        "--dp", "16", "--zero", "1", "--num-microbatches", "32", "--sequence-parallel", "--recompute", "selective",
        "--csv", str(tmp_path / "one.csv"), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "fits" in result.stdout and "MFU" in result.stdout
    (row,) = csv.DictReader(open(tmp_path / "one.csv"))
    assert row["tp"] == "8" and row["fits"] == "True" and float(row["memory_total_bytes"]) > 0

    result = run_cli("plan", "--num-params", "1e9", "--cluster", "a100-80gb", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "16.00" in result.stdout  # 2 + 2 + 12 bytes per parameter

    result = run_cli(
        "plan", "--model", "llama3-8b", "--gpus", "16", "--search", "--global-batch", "64", "--top", "3",
        "--show-rejected", "--csv", str(tmp_path / "search.csv"), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "rejected" in result.stdout

    result = run_cli("plan", "--model", "llama3-8b", "--gpus", "16", "--search", "--global-batch", "64", "--tp", "4",
                     "--top", "50", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    ranked = [line for line in result.stdout.splitlines() if "tp=" in line]
    assert ranked and all("tp=4 " in line for line in ranked)  # --tp narrows the search
    rows = list(csv.DictReader(open(tmp_path / "search.csv")))
    assert any(r["fits"] == "True" for r in rows) and any(r["reasons"] for r in rows)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama9-1t"], "unknown model preset 'llama9-1t'"),
        (["--model", "llama3-8b", "--tp", "2", "--gpus", "8"], "tp*pp*dp = 2*1*1 = 2 != 8"),
        (["--layers", "-2", "--hidden", "64", "--heads", "4", "--vocab", "10", "--seq-len", "8"], "layers"),
        (["--model", "llama3-8b", "--cluster", "tpu-v9"], "tpu-v9"),
        (["--model", "llama3-8b", "--search"], "--global-batch"),
        (["--model", "llama3-8b", "--num-params", "1e9"], "one way"),
        (["--model", "llama3-8b", "--search", "--global-batch", "64"], "--search needs --gpus"),
        (["--model", "llama3-8b", "--global-batch", "64"], "--global-batch is for --search"),
        (["--model", "llama3-8b", "--top", "0"], "--top must be >= 1"),
        (["--model", "llama3-8b", "--gpus", "24", "--tp", "6", "--dp", "4"], "some TP groups would span two nodes"),
    ],
)
def test_plan_bad_input_exit_code_2(capsys, args, message):
    code, err = run_main("plan", *args, capsys=capsys)
    assert code == 2, err
    assert message in err


def test_a_refused_input_exits_the_process_with_code_2(tmp_path):
    result = run_cli("plan", "--model", "llama9-1t", cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "unknown model preset 'llama9-1t'" in result.stderr


def test_bench_runs_scripts_into_one_csv_and_png(tmp_path):
    result = run_cli("bench", "--quick", "--only", "amp", "--reps", "1", "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert {r["provider"] for r in rows} >= {"torch", "tplayers-scaler", "tplayers-ref"}
    assert all(r["op"] and r["device"] and "torch=" in r["version"] for r in rows)
    assert all(float(r["ratio_to_baseline"]) > 0 for r in rows)
    assert (tmp_path / "bench.png").stat().st_size > 0 and (tmp_path / "amp" / "amp.csv").is_file()


def test_bench_says_where_overlap_pays_off():
    from tplayers.tools.bench import merge

    raw = [
        dict(kernel="mlp", provider="tplayers", mode="tp", shape="s", device="cpu", time_ms="1.0",
             ratio_to_dtensor="0.9", ratio_overlap_on_off="0.8"),
        dict(kernel="mlp", provider="tplayers", mode="tp+sp", shape="s", device="cpu", time_ms="1.0",
             ratio_to_dtensor="1.1", ratio_overlap_on_off="1.2"),
        dict(kernel="mlp", provider="tplayers", mode="tp", shape="t", device="cpu", time_ms="1.0",
             ratio_to_dtensor="1.0", ratio_overlap_on_off="0.99"),
        dict(kernel="mlp", provider="dtensor", mode="tp", shape="s", device="cpu", time_ms="1.0",
             ratio_to_dtensor="1.0", ratio_overlap_on_off=""),
    ]  # fmt: skip
    assert [r["overlap_pays_off"] for r in merge("linear", raw, "v")] == ["yes", "no", "even", ""]


def test_bench_says_which_path_auto_took():
    from tplayers.tools.bench import merge, summary

    raw = [
        dict(kernel="mlp", provider="tplayers", mode="tp", shape="s", device="cpu", time_ms="1.0",
             ratio_to_dtensor="0.9", auto_took="ring", auto_vs_faster="1.01"),
        dict(kernel="mlp", provider="tplayers-overlap", mode="tp", shape="s", device="cpu", time_ms="1.0",
             ratio_to_dtensor="0.9", ratio_overlap_on_off="0.8"),
    ]  # fmt: skip
    merged = merge("linear", raw, "v")
    assert [(r["auto_took"], r["auto_vs_faster"]) for r in merged] == [("ring", "1.01"), ("", "")]
    assert "ring (1.010: as fast)" in summary(merged)
    grid = [
        dict(op="mlp_fwd_bwd", provider=p, mode="tp", shape="s1", device="cpu", time_ms="1.0", auto_took="plain",
             ratio_to_faster=ratio) for p, ratio in (("auto", "1.02"), ("on", "1.5"), ("off", "1.0"))
    ]  # fmt: skip
    assert [r["auto_vs_faster"] for r in merge("overlap", grid, "v")] == ["1.02", "", ""]


def test_bench_calibrate_writes_a_costs_file_the_layers_read(tmp_path):
    from tplayers.functional import cost_model

    path = tmp_path / "costs.json"
    result = run_cli("bench", "--calibrate", "--rounds", "1", "--reps", "2", "--costs-file", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    costs = cost_model.read_costs("gloo", "cpu", path)
    assert costs.source.startswith("calibrated: gloo on cpu, 2 ranks")
    assert (
        costs.p2p_bytes_per_s > 0 and costs.gemm_flops_per_s["float32"] > 0 and set(costs.hidden) == set(cost_model.OPS)
    )
    assert all(latency >= 0 and bandwidth > 0 for latency, bandwidth in costs.collectives.values())


def test_bench_without_scripts_exit_code_2(tmp_path):
    result = run_cli("bench", "--bench-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2 and "no benchmark scripts" in result.stderr


def test_bench_step_runs_on_cpu_and_writes_csv_and_png(tmp_path):
    """Without a GPU, `tplayers bench --step` checks its script on a tiny shape: every provider
    that can run here gives a row with the same first loss as plain HF's, Liger a note."""
    result = run_cli("bench", "--step", "--out", str(tmp_path), "--", "--providers", "hf", "liger", "tplayers-torch",
                     cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["provider"]: r for r in csv.DictReader(open(tmp_path / "step" / "step.csv"))}
    assert set(rows) == {"hf", "liger", "tplayers-torch"}
    assert "CUDA" in rows["liger"]["note"]
    assert abs(float(rows["tplayers-torch"]["loss_minus_hf"])) < 1e-4
    assert float(rows["tplayers-torch"]["ms_per_step"]) > 0 and float(rows["tplayers-torch"]["time_vs_hf"]) > 0
    assert (tmp_path / "step" / "step.png").stat().st_size > 0
    assert "aten::mm" in (tmp_path / "step" / "step_tplayers-torch_kernels.txt").read_text()
