"""`tplayers bench --calibrate`: measure the overlap cost model's constants on this machine and
write them to the costs file the layers read (tplayers.functional.cost_model).

    tplayers bench --calibrate [--tp 2] [--costs-file PATH]        local CPU ranks (gloo)
    torchrun --nproc-per-node N -m tplayers.tools.calibrate         one rank per GPU (NCCL)

What is measured, each timed as the slowest rank's median over repetitions:
    GEMM              one rank's x @ w^T at growing row counts, per dtype: least squares of
                      time = call + FLOPs / throughput
    point-to-point    a ring step (send to the next rank, receive from the previous) at growing
                      sizes: time = latency + bytes / bandwidth
    collective        an AllGather at small sizes: its latency (bytes priced at the same bandwidth)
    overlap           a GEMM and a ring step of about equal length run together: the share of
                      the shorter one that disappears
Every rank of a group must read the same constants (auto_overlap checks it): copy the file to
every machine, or calibrate on each kind and keep one entry per (backend, device).
"""

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

import tplayers
from tplayers.functional import comm, cost_model
from tplayers.functional.auto_overlap import forget_choices

# Latencies are timed at the smallest message, bandwidths fitted over the larger ones (up to the
# activation sizes the layers send): one line through all of them lets a few large transfers set
# the small-message latency, which decides the decode shapes.
CPU_SIZES = dict(gemm_rows=(64, 256, 1024, 2048), gemm_inner=512, bytes=(1 << 8, 1 << 20, 1 << 22, 1 << 24))
GPU_SIZES = dict(gemm_rows=(1024, 4096, 16384), gemm_inner=4096, bytes=(1 << 8, 1 << 22, 1 << 24, 1 << 26))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, reps):
    """The slowest rank's median seconds of fn over `reps`, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def _fit_line(xs, ys):
    """(intercept, slope) of the least-squares line, intercept clamped at 0 and slope at > 0."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    slope = max(slope, 1e-30)
    return max(my - slope * mx, 0.0), slope


def _ring_step(numel, device):
    """A ring step over the default group (send to the next rank, receive from the previous):
    start() puts it in flight and returns its works."""
    n, r = dist.get_world_size(), dist.get_rank()
    send, recv = torch.randn(numel, device=device), torch.empty(numel, device=device)
    return lambda: comm.exchange(send, (r + 1) % n, recv, (r - 1) % n, dist.group.WORLD)


def _wait(works):
    for work in works:
        work.wait()


def _all_gather(ring_bytes, n, device):
    mine = torch.randn(max(ring_bytes // 4 // (n - 1), 1), device=device)
    out = mine.new_empty(n * mine.numel())
    return lambda: comm.all_gather_into(out, mine, dist.group.WORLD, record=False)


def _reduce_scatter(ring_bytes, n, device):
    out = torch.empty(max(ring_bytes // 4 // (n - 1), 1), device=device)
    full = torch.randn(n * out.numel(), device=device)
    return lambda: comm.reduce_scatter_into(out, full, dist.group.WORLD)


def _all_reduce(ring_bytes, n, device):
    t = torch.randn(max(ring_bytes // 4 * n // (2 * (n - 1)), 1), device=device)
    return lambda: comm.all_reduce(t, dist.group.WORLD)


_COLLECTIVES = {"all_gather": _all_gather, "reduce_scatter": _reduce_scatter, "all_reduce": _all_reduce}


def measure(device, reps=20) -> cost_model.OverlapCosts:
    """The constants of the default group's backend on `device`, the same on every rank."""
    n = dist.get_world_size()
    sizes = GPU_SIZES if device.type == "cuda" else CPU_SIZES
    k = sizes["gemm_inner"]
    dtypes = (torch.float32, torch.bfloat16) + ((torch.float16,) if device.type == "cuda" else ())
    tiny_x, tiny_w = torch.randn(1, 8, device=device), torch.randn(8, 8, device=device)
    call = _time(lambda: tplayers.backend.gemm(tiny_x, tiny_w), device, reps)
    flops = {}
    for dtype in dtypes:
        w = torch.randn(k, k, device=device, dtype=dtype)
        xs = [torch.randn(m, k, device=device, dtype=dtype) for m in sizes["gemm_rows"]]
        times = [_time(lambda x=x, w=w: tplayers.backend.gemm(x, w), device, reps) for x in xs]
        flops[str(dtype).removeprefix("torch.")] = 1.0 / _fit_line([2.0 * x.shape[0] * k * k for x in xs], times)[1]
    # One row against a large weight: the GEMM reads the weight, its FLOPs are nothing.
    big = 4 * k
    w, x = torch.randn(big, big, device=device), torch.randn(1, big, device=device)
    memory = 4.0 * big * big / max(_time(lambda: tplayers.backend.gemm(x, w), device, reps) - call, 1e-9)
    nbytes = sizes["bytes"]
    starts = [_ring_step(b // 4, device) for b in nbytes]
    steps = [_time(lambda start=start: _wait(start()), device, reps) for start in starts]
    p2p_latency, seconds_per_byte = steps[0], _fit_line(nbytes[1:], steps[1:])[1]
    collectives = {}
    for kind, build in _COLLECTIVES.items():
        # Each rank's link carries `ring_bytes`: buffers sized so that it is each of `nbytes`.
        cases = [build(b, n, device) for b in nbytes]
        times = [_time(fn, device, reps) for fn in cases]
        collectives[kind] = (times[0], 1.0 / _fit_line(nbytes[1:], times[1:])[1])
    costs = cost_model.OverlapCosts(
        collectives=collectives,
        p2p_latency_s=p2p_latency,
        p2p_bytes_per_s=1.0 / seconds_per_byte,
        gemm_flops_per_s=flops,
        memory_bytes_per_s=memory,
        gemm_call_s=call,
        hidden=dict.fromkeys(cost_model.OPS, 0.0),
    )
    hidden = {op: _hidden_share(op, costs, device, reps) for op in cost_model.OPS}
    return replace(costs, hidden=hidden)


def _balanced_shape(op, costs, n, device):
    """(m, k, n_out) of `op` whose ring steps' GEMM chunk and transfer take about equally long
    (each about 5 ms on CPU, 0.5 ms on a GPU): there, how much of them overlap matters most."""
    target = 5e-3 if device.type != "cuda" else 5e-4
    inner = 1024 if device.type != "cuda" else 4096
    flops, bandwidth = costs.flops_per_s("float32"), costs.p2p_bytes_per_s
    # A step sends rows x (k for all_gather_matmul, n_out for the others) fp32 values and
    # multiplies rows x k x n_out: the two take equally long when the other dim is 4 F / (2 bw).
    balanced = int(min(max(4.0 * flops / (2 * bandwidth), 16), 8192))
    sent = inner
    rows = int(min(max((target - costs.p2p_latency_s) * bandwidth / (4 * sent), 1), 1 << 20))
    if op == "all_gather_matmul":
        return n * rows, inner, balanced
    return n * rows, balanced, inner


def _hidden_share(op, costs, device, reps) -> float:
    """The `hidden` share that makes the model's ring time equal the measured one at a balanced
    shape: the ring time is linear in (1 - hidden) (cost_model.predict)."""
    from tplayers.functional.overlap import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

    n, group = dist.get_world_size(), dist.group.WORLD
    m, k, n_out = _balanced_shape(op, costs, n, device)
    w = torch.randn(n_out, k, device=device)
    if op == "all_gather_matmul":
        x = torch.randn(1, m // n, k, device=device)
        ring = lambda: all_gather_matmul(x, w, group, overlap=True)  # noqa: E731
    elif op == "matmul_reduce_scatter":
        x = torch.randn(1, m, k, device=device)
        ring = lambda: matmul_reduce_scatter(x, w, group, overlap=True)  # noqa: E731
    else:
        x = torch.randn(m, k, device=device)
        ring = lambda: matmul_all_reduce(x, w, group, overlap=True)  # noqa: E731
    measured = _time(ring, device, reps)
    backend = dist.get_backend(group)

    def predicted(hidden):
        with_hidden = replace(costs, hidden={**costs.hidden, op: hidden})
        return cost_model.predict(op, n, m, k, n_out, "float32", with_hidden, backend=backend)[0]

    perfect, none = predicted(1.0), predicted(0.0)
    if none <= perfect:  # nothing to hide at this shape
        return 0.0
    return min(max(1.0 - (measured - perfect) / (none - perfect), -2.0), 1.0)


def _device():
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def median_costs(runs):
    """Each constant's median over several calibration runs (a noisy machine's outliers go)."""
    med = statistics.median

    def per_key(dicts):
        return {key: med(d[key] for d in dicts) for key in dicts[0]}

    return cost_model.OverlapCosts(
        collectives={
            kind: tuple(med(run.collectives[kind][i] for run in runs) for i in (0, 1)) for kind in runs[0].collectives
        },
        p2p_latency_s=med(run.p2p_latency_s for run in runs),
        p2p_bytes_per_s=med(run.p2p_bytes_per_s for run in runs),
        gemm_flops_per_s=per_key([run.gemm_flops_per_s for run in runs]),
        memory_bytes_per_s=med(run.memory_bytes_per_s for run in runs),
        gemm_call_s=med(run.gemm_call_s for run in runs),
        hidden=per_key([run.hidden for run in runs]),
    )


def _worker(rank, world_size, reps, threads, rounds=3):
    torch.set_num_threads(threads)
    device = _device()
    tplayers.set_backend("auto" if device.type == "cuda" else "torch")  # the interpreter is not a GEMM
    costs = median_costs([measure(device, reps) for _ in range(rounds)])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return costs, dist.get_backend(), name


def _save(costs, backend, device_name, ranks, threads, path):
    costs = replace(costs, source=f"calibrated: {backend} on {device_name}, {ranks} ranks x {threads} thread(s)")
    written = cost_model.write_costs(costs, backend, device_name, path)
    forget_choices()
    print(f"{costs.source}\n  {costs}\nwrote {written} (entry {cost_model.file_key(backend, device_name)!r})")
    return written


def run(args) -> int:
    """`tplayers bench --calibrate`: local CPU ranks (gloo); on GPUs use torchrun (see the docstring)."""
    if args.tp < 2:
        raise ValueError(f"--calibrate needs at least 2 ranks, got --tp {args.tp}")
    costs, backend, name = tplayers.launch(_worker, args.tp, args.reps or 20, args.threads, args.rounds)[0]
    _save(costs, backend, name, args.tp, args.threads, args.costs_file)
    return 0


def main(argv=None) -> int:
    """Under torchrun: `torchrun --nproc-per-node N -m tplayers.tools.calibrate [--costs-file PATH]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs-file", type=str, default=None, help=f"default: ${cost_model.COSTS_ENV} or "
                        f"{cost_model.DEFAULT_COSTS_FILE}")  # fmt: skip
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="calibration runs; each constant's median is kept")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        costs, backend, name = _worker(
            dist.get_rank(), dist.get_world_size(), args.reps, torch.get_num_threads(), args.rounds
        )
        if dist.get_rank() == 0:
            _save(costs, backend, name, dist.get_world_size(), torch.get_num_threads(), args.costs_file)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
