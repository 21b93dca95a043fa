"""Tile-config sweeps on one CUDA GPU: each candidate config of Hopper's TMA GEMM and of flash
attention timed against torch's op at the bench's shapes, to choose the kernels' own configs.

    python bench/sweep.py [--only gemm flash] [--out bench/out/sweep]

GEMM: every config of SWEEP_GEMM (tiles, warps, stages) through Triton's autotuner, which times
each with do_bench (median) at each shape; cuBLAS (F.linear) and the shipped configs' choice
beside them. Flash attention: each forward config of SWEEP_FLASH_FWD, and each dK / dV and dQ
config of SWEEP_FLASH_BWD (the other backward kernel at its shipped config), causal GQA against
SDPA. A config that does not compile or fit shared memory reports inf. Writes <out>/sweep.csv and
prints each case's configs, fastest first. Needs a CUDA GPU (sm_90 for the TMA GEMM).
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import _import_from_checkout  # noqa: E402  (bench/kernels.py: tplayers from this checkout)

_import_from_checkout()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from linear import write_csv  # noqa: E402
from triton.testing import do_bench  # noqa: E402

GEMM_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (8192, 5504, 4096))
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
SWEEP_GEMM = (
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4),
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 8, 5), (128, 128, 64, 4, 4),
    (128, 128, 128, 8, 3), (128, 256, 128, 8, 2), (64, 256, 64, 4, 4), (128, 64, 64, 4, 4),
)  # fmt: skip
FLASH_SHAPES = ((1, 16, 4, 4096, 128),)  # (B, H, KH, S, D): Llama-3-8B's attention at TP 2
# (BLOCK_M, BLOCK_N, warps, stages)
SWEEP_FLASH_FWD = (
    (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3),
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 32, 4, 3), (256, 64, 8, 2),
)  # fmt: skip
SWEEP_FLASH_BWD = {
    "dkdv": ((32, 64, 8, 2), (32, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 3)),
    "dq": ((64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2)),
}
FIELDS = ("case", "config", "time_ms", "tflops", "ratio_to_torch", "torch_ms", "device")


def _median(timing):
    """The autotuner's timing of a config: do_bench's (median, p20, p80), or one number."""
    return timing[0] if isinstance(timing, list | tuple) else timing


def gemm_sweep(dtype=torch.bfloat16):
    """Rows of every SWEEP_GEMM config at each GEMM_SHAPES shape, plain epilogue."""
    from tplayers.kernels import matmul as mm
    from tplayers.kernels.tuning import TunedLaunch

    configs = []
    for bm, bn, bk, warps, stages in SWEEP_GEMM:
        cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps,
                            num_stages=stages)  # fmt: skip
        configs.append(cfg)
    wide = triton.autotune(configs=configs, key=["M", "N", "K"], restore_value=["c_ptr"])(mm._matmul_tma_kernel)
    shipped = mm._tma_launch
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for M, N, K in GEMM_SHAPES:
        a = torch.randn((M, K), generator=gen, device="cuda").to(dtype)
        w = (torch.randn((N, K), generator=gen, device="cuda") * K**-0.5).to(dtype)
        flops, case = 2.0 * M * N * K, f"tma-gemm {dtype} M{M} N{N} K{K}"
        torch_ms = do_bench(lambda a=a, w=w: F.linear(a, w), return_mode="median")
        mm._tma_launch = TunedLaunch(wide)
        try:
            mm.matmul(a, w)  # the autotuner times every config here
        finally:
            mm._tma_launch = shipped
        for cfg, timing in getattr(wide, "configs_timings", {}).items():  # Triton's record of the last tuning
            ms = _median(timing)
            rows.append(dict(case=case, config=_gemm_name(cfg), time_ms=ms, tflops=flops / ms / 1e9,
                             ratio_to_torch=ms / torch_ms, torch_ms=torch_ms))  # fmt: skip
        ms = do_bench(lambda a=a, w=w: mm.matmul(a, w), return_mode="median")
        rows.append(dict(case=case, config=f"shipped ({_gemm_name(shipped.autotuned.best_config)})", time_ms=ms,
                         tflops=flops / ms / 1e9, ratio_to_torch=ms / torch_ms, torch_ms=torch_ms))  # fmt: skip
    return rows


def _gemm_name(cfg):
    k = cfg.kwargs
    return f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} w{cfg.num_warps} s{cfg.num_stages}"


def _qkv(B, H, KH, S, D, dtype, gen):
    q = torch.randn((B, H, S, D), generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn((B, KH, S, D), generator=gen, device="cuda").to(dtype) for _ in range(2))
    return q, k, v


def _timed(fn):
    try:
        return do_bench(fn, return_mode="median")
    except Exception as e:  # out of shared memory, a compile error: this config cannot run
        print(f"  {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        return math.inf


def flash_sweep(dtype=torch.bfloat16):
    """Rows of every forward and backward config at FLASH_SHAPES (causal)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [row for shape in FLASH_SHAPES for row in _flash_shape(*shape, dtype, gen)]


def _flash_shape(B, H, KH, S, D, dtype, gen):
    from tplayers.kernels import flash_attention as fa

    shipped = fa._gpu_config
    q, k, v = _qkv(B, H, KH, S, D, dtype, gen)
    do = torch.randn_like(q)
    pos = torch.arange(S, dtype=torch.int32, device="cuda").expand(B, S).contiguous()
    doc = torch.zeros(B, S, dtype=torch.int32, device="cuda")
    causal = 2.0 * B * H * S * S * D
    shape = f"B{B} H{H} KH{KH} S{S} D{D} {dtype}"

    def fwd():
        return fa.flash_attention(q, k, v, pos, doc, pos, doc)

    o, lse = fwd()

    def bwd():
        return fa.flash_attention_backward(do, q, k, v, o, lse, pos, doc, pos, doc)

    sdpa_fwd = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                        return_mode="median")  # fmt: skip
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
    sdpa_bwd = do_bench(lambda: torch.autograd.grad(og, (qg, kg, vg), do, retain_graph=True), return_mode="median")
    sweeps = [("fwd", cfg, fwd, sdpa_fwd, causal) for cfg in SWEEP_FLASH_FWD]
    sweeps += [(kind, cfg, bwd, sdpa_bwd, 2.5 * causal) for kind, cfgs in SWEEP_FLASH_BWD.items() for cfg in cfgs]
    sweeps += [("fwd", None, fwd, sdpa_fwd, causal), ("bwd", None, bwd, sdpa_bwd, 2.5 * causal)]
    rows = []
    for kind, cfg, fn, torch_ms, flops in sweeps:
        name = "shipped"
        if cfg is not None:
            bm, bn, warps, stages = cfg
            name = f"{bm}x{bn} w{warps} s{stages}"
            mine = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            fa._gpu_config = lambda kernel, head_dim, arch, kind=kind, mine=mine: (
                mine if kernel == kind else shipped(kernel, head_dim, arch))  # fmt: skip
        try:
            ms = _timed(fn)
        finally:
            fa._gpu_config = shipped
        rows.append(dict(case=f"flash-{kind} {shape}", config=name, time_ms=ms, tflops=flops / ms / 1e9,
                         ratio_to_torch=ms / torch_ms, torch_ms=torch_ms))  # fmt: skip
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=("gemm", "flash"), default=["gemm", "flash"])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "sweep")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/sweep.py: needs a CUDA GPU; nothing to sweep here", file=sys.stderr)
        return 0
    rows = []
    for name, sweep in (("gemm", gemm_sweep), ("flash", flash_sweep)):
        if name in args.only and (name != "gemm" or torch.cuda.get_device_capability()[0] >= 9):
            rows += sweep()
    device = torch.cuda.get_device_name()
    for case in dict.fromkeys(r["case"] for r in rows):
        print(f"\n{case} (torch {next(r['torch_ms'] for r in rows if r['case'] == case):.3f} ms), {device}")
        for r in sorted((r for r in rows if r["case"] == case), key=lambda r: r["time_ms"]):
            print(f"  {r['config']:<40}{r['time_ms']:9.3f} ms{r['tflops']:8.1f} TFLOP/s{r['ratio_to_torch']:8.3f}x")
    for r in rows:
        r["device"] = device
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "sweep.csv", FIELDS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
