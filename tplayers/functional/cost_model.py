"""The cost model behind overlap="auto": how long each path of an overlap-engine op should take.

Both paths of an op do the same arithmetic; they differ in how the communication is issued:

    plain (overlap=False)  the GEMM(s), then one collective: latency + ring bytes / bandwidth
    ring  (overlap=True)   n - 1 point-to-point steps, each a GEMM chunk with a transfer in flight

A ring step costs max(g, c) + (1 - hidden) * min(g, c) + step: the GEMM chunk g and the transfer
c overlap, but only the `hidden` share of the shorter one disappears (on CPU gloo's transfer
threads compete with the GEMM for the same cores; on GPU NCCL's kernels take SMs), and each step
pays a fixed cost (Python, the exchange call, waking the transfer threads). So the ring wins when
the GEMM chunks and transfers are both long enough to hide each other, and loses at small shapes
(decode: a few rows), where n - 1 step latencies replace one collective latency.

Constants are per backend and device (`OverlapCosts`): defaults for gloo on CPU (measured on the
2-core CI machine) and NCCL on H100 / A100 (published link and GEMM figures), replaced by the
numbers `tplayers bench --calibrate` measures and writes to a JSON file (env
`TPLAYERS_OVERLAP_COSTS`, default `~/.cache/tplayers/overlap_costs.json`). The same file keeps
the paths overlap="auto" timed on real calls, per backend / device / op / shape bucket
(`read_measured`, `write_measured`; see auto_overlap.py). Everything here is a pure function of
its arguments (or of the file): no torch.distributed, so every rank with the same file predicts
the same.
"""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
COSTS_ENV = "TPLAYERS_OVERLAP_COSTS"
DEFAULT_COSTS_FILE = Path.home() / ".cache" / "tplayers" / "overlap_costs.json"
# matmul_all_reduce on NCCL: at most this many row chunks, none below MIN_ALL_REDUCE_CHUNK_BYTES
# (a chunk's collective latency would outweigh what overlap hides). overlap.py follows them.
ALL_REDUCE_CHUNKS = 4
MIN_ALL_REDUCE_CHUNK_BYTES = 1 << 20
_ELEMENT_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
# The ring is taken only when predicted at least this much faster: its n - 1 steps are each
# exposed to scheduling noise on busy cores, so a near tie goes to the one collective.
RING_MARGIN = 0.95


@dataclass(frozen=True)
class OverlapCosts:
    """The constants of one backend on one device (seconds, bytes / s, FLOP / s).

    collectives           per kind ("all_gather", "reduce_scatter", "all_reduce"): (latency_s,
                          bytes_per_s), bytes being what the ring algorithm puts on each rank's
                          link ((n-1)/n of the gathered / scattered buffer, 2(n-1)/n for an
                          all-reduce), so a well-implemented backend has one bandwidth for all
                          three (NCCL); gloo's reduce-scatter and all-reduce are slower than its
                          point-to-point transfers, which is a reason the ring pays on CPU
    p2p_latency_s         fixed cost of one ring step's send + receive (the step's own Python
                          and call overhead included)
    p2p_bytes_per_s       point-to-point bandwidth per rank
    gemm_flops_per_s      sustained GEMM throughput per dtype name ("float32", "bfloat16", ...)
    memory_bytes_per_s    the GEMM's memory bandwidth: a GEMM of few rows (decode) reads its
                          weight at this rate instead of computing at the FLOP rate (roofline)
    gemm_call_s           fixed cost of one GEMM call (launch, Python)
    hidden                per op: the share of the shorter of a ring step's GEMM and transfer
                          that running them together hides, as measured on the engine's own
                          ring: 1 perfect overlap, 0 none, below 0 they slow each other down
                          (CPU ranks whose transfer threads share the GEMM's cores)
    source                where the numbers come from (a default's name or the calibration run)
    """

    collectives: dict
    p2p_latency_s: float
    p2p_bytes_per_s: float
    gemm_flops_per_s: dict = field(default_factory=dict)
    memory_bytes_per_s: float = float("inf")
    gemm_call_s: float = 0.0
    hidden: dict = field(default_factory=dict)
    source: str = ""

    def __post_init__(self):
        missing = [
            *(f"collectives[{k!r}]" for k in COLLECTIVES if k not in self.collectives),
            *(f"hidden[{op!r}]" for op in OPS if op not in self.hidden),
            *(["gemm_flops_per_s['float32']"] if "float32" not in self.gemm_flops_per_s else []),
        ]
        if missing:
            raise TypeError(f"OverlapCosts needs {', '.join(missing)}")

    def flops_per_s(self, dtype_name: str) -> float:
        """Throughput for `dtype_name`, falling back to float32's."""
        rates = self.gemm_flops_per_s
        return rates.get(dtype_name) or rates["float32"]

    def gemm_s(self, m, k, n, dtype_name) -> float:
        """(m, k) @ (k, n): the slower of its FLOPs and its bytes (inputs read, output written)."""
        moved = (m * k + k * n + m * n) * _ELEMENT_SIZE[dtype_name]
        return self.gemm_call_s + max(2.0 * m * k * n / self.flops_per_s(dtype_name), moved / self.memory_bytes_per_s)

    def collective_s(self, kind, ring_bytes) -> float:
        """One collective of `kind` that puts `ring_bytes` on each rank's link."""
        latency, bandwidth = self.collectives[kind]
        return latency + ring_bytes / bandwidth

    def send_s(self, nbytes) -> float:
        return self.p2p_latency_s + nbytes / self.p2p_bytes_per_s

    def overlapped_s(self, op, gemm_s, transfer_s) -> float:
        """A GEMM and a transfer in flight together, in `op`'s ring."""
        return max(gemm_s, transfer_s) + (1.0 - self.hidden[op]) * min(gemm_s, transfer_s)


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def _same_for_all(latency_s, bytes_per_s):
    return {kind: (latency_s, bytes_per_s) for kind in COLLECTIVES}


def _every_op(hidden):
    return dict.fromkeys(OPS, hidden)


# Defaults. gloo on CPU: `tplayers bench --calibrate` on the 2-core CI machine (2 ranks, one
# torch thread each, median of 3 runs), 2026-11-24: gloo's all-gather and reduce-scatter move
# bytes at a third to a fifth of its point-to-point rate, and a transfer in flight slows the
# GEMM beside it (hidden < 0: the two ranks' transfer threads share the GEMMs' two cores).
# NCCL: published figures, to be replaced by a calibration on the machine at hand: NVLink 4
# (H100 SXM) ~ 450 GB/s per direction, ~ 360 GB/s achieved by NCCL's ring; NVLink 3 (A100 SXM)
# ~ 300 / ~ 230 GB/s; dense GEMM about 70 % of peak (H100 989 TFLOP/s bf16, 67 fp32 without
# TF32; A100 312 / 19.5), HBM about 80 % of peak (3.35 / 2.0 TB/s); NCCL's small-message latency
# ~ 10-20 us within one node, a kernel launch from Python ~ 10 us; NCCL kernels share the SMs
# (hidden 0.85).
GLOO_CPU = OverlapCosts(
    collectives={
        "all_gather": (290e-6, 0.50e9),
        "reduce_scatter": (420e-6, 0.37e9),
        "all_reduce": (480e-6, 1.34e9),
    },
    p2p_latency_s=290e-6,
    p2p_bytes_per_s=1.75e9,
    gemm_flops_per_s={"float32": 91e9, "bfloat16": 216e9},
    memory_bytes_per_s=17e9,
    gemm_call_s=41e-6,
    hidden={"all_gather_matmul": -0.71, "matmul_reduce_scatter": -1.09, "matmul_all_reduce": -0.95},
    source="default: gloo on 2 CPU cores (tplayers bench --calibrate, 2 ranks x 1 thread)",
)
NCCL_H100 = OverlapCosts(
    collectives=_same_for_all(20e-6, 360e9),
    p2p_latency_s=15e-6,
    p2p_bytes_per_s=360e9,
    gemm_flops_per_s={"float32": 47e12, "bfloat16": 690e12, "float16": 690e12},
    gemm_call_s=10e-6,
    memory_bytes_per_s=2.6e12,
    hidden=_every_op(0.85),
    source="default: NCCL on H100 SXM (published figures)",
)
NCCL_A100 = OverlapCosts(
    collectives=_same_for_all(20e-6, 230e9),
    p2p_latency_s=15e-6,
    p2p_bytes_per_s=230e9,
    gemm_flops_per_s={"float32": 14e12, "bfloat16": 220e12, "float16": 220e12},
    gemm_call_s=10e-6,
    memory_bytes_per_s=1.6e12,
    hidden=_every_op(0.85),
    source="default: NCCL on A100 SXM (published figures)",
)


def default_costs(backend: str, device: str, capability=None) -> OverlapCosts:
    """The built-in constants for `backend` ("gloo" / "nccl") on `device` ("cpu" or a GPU's name);
    `capability` (major, minor) picks H100 (9.x and up) or A100 numbers for NCCL."""
    if backend == "nccl":
        return NCCL_H100 if capability is not None and capability[0] >= 9 else NCCL_A100
    return GLOO_CPU


def costs_file() -> Path:
    return Path(os.environ.get(COSTS_ENV) or DEFAULT_COSTS_FILE)


def file_key(backend: str, device: str) -> str:
    return f"{backend}/{device}"


def read_costs(backend: str, device: str, path=None):
    """The calibrated constants for (backend, device) from the costs file, or None."""
    path = Path(path) if path is not None else costs_file()
    if not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text()).get(file_key(backend, device))
    except (OSError, ValueError) as e:
        raise ValueError(f"overlap costs file {path} cannot be read ({e}): fix or delete it") from e
    if entry is None:
        return None
    try:
        entry["collectives"] = {kind: tuple(v) for kind, v in entry["collectives"].items()}
        return OverlapCosts(**entry)
    except (TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"overlap costs file {path}: entry {file_key(backend, device)!r} is malformed ({e})") from e


def write_costs(costs: OverlapCosts, backend: str, device: str, path=None) -> Path:
    """Add or replace the (backend, device) entry of the costs file; other entries stay."""
    return _update(path, lambda entries: entries.__setitem__(file_key(backend, device), asdict(costs)))


def _update(path, change) -> Path:
    """Read the costs file, `change` its entries in place, write it back atomically (a temporary
    file of this process renamed over it: ranks of several groups may write at once; the last
    rename wins, and every entry is a cache its writer can rebuild)."""
    path = Path(path) if path is not None else costs_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        entries = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        entries = {}  # a half-written or foreign file: rewritten whole
    change(entries)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def measured_key(backend: str, device: str) -> str:
    return f"measured/{backend}/{device}"


def shape_bucket(op: str, dtype_name: str, n: int, m: int, k: int, n_out: int, side: int = 0) -> str:
    """The bucket a measured (op, shape) is kept under: each GEMM dim rounded up to a power of two
    (shapes that close take the same path, or nearly the same time on either)."""
    up = lambda x: 1 << max(0, int(x) - 1).bit_length() if x > 0 else 0  # noqa: E731
    return f"{op} {dtype_name} n{n} side{side} m{up(m)} k{up(k)} n{up(n_out)}"


def read_measured(backend: str, device: str, path=None) -> dict:
    """{shape bucket: record} of the paths overlap="auto" timed for (backend, device) (records as
    `write_measured` writes them), {} where none were."""
    path = Path(path) if path is not None else costs_file()
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text()).get(measured_key(backend, device), {})
    except (OSError, ValueError) as e:
        raise ValueError(f"overlap costs file {path} cannot be read ({e}): fix or delete it") from e
    return {bucket: record for bucket, record in entries.items() if isinstance(record, dict) and "ring" in record}


def write_measured(backend: str, device: str, bucket: str, record: dict, path=None) -> Path:
    """Keep one measured choice: `record` holds "ring" (the path taken), "ring_s" / "plain_s" (the
    slowest rank's median per path), the model's "predicted_ring_s" / "predicted_plain_s" and
    "contradicts_model"."""
    return _update(
        path, lambda entries: entries.setdefault(measured_key(backend, device), {}).__setitem__(bucket, record)
    )


def predict(op: str, n: int, m: int, k: int, n_out: int, dtype_name: str, costs: OverlapCosts, *, backend, side=0):
    """(seconds with overlap, seconds without) of `op` on `n` ranks, for the GEMM each rank runs:
    `m` rows in total (the gathered rows for all_gather_matmul, the full sequence for
    matmul_reduce_scatter), `k` inner, `n_out` output columns, `dtype_name` elements. `side`:
    matmul_all_reduce's side-work callables (weight gradients: each one GEMM of the same size).
    `backend` ("gloo" / "nccl") decides matmul_all_reduce's overlapped form (see overlap.py)."""
    if op not in OPS:
        raise ValueError(f"predict: op must be one of {OPS}, got {op!r}")
    e = _ELEMENT_SIZE[dtype_name]
    chunk_rows = m / n
    g = costs.gemm_s(chunk_rows, k, n_out, dtype_name)  # one rank's GEMM on one chunk of rows
    if op == "all_gather_matmul":
        c = costs.send_s(chunk_rows * k * e)
        ring = g + (n - 1) * costs.overlapped_s(op, g, c)
        plain = costs.collective_s("all_gather", (n - 1) * chunk_rows * k * e) + n * g
        return ring, plain
    if op == "matmul_reduce_scatter":
        c = costs.send_s(chunk_rows * n_out * e)
        ring = g + (n - 1) * costs.overlapped_s(op, g, c)
        plain = n * g + costs.collective_s("reduce_scatter", (n - 1) * chunk_rows * n_out * e)
        return ring, plain
    whole = costs.gemm_s(m, k, n_out, dtype_name)
    side_s = side * whole
    plain = whole + costs.collective_s("all_reduce", 2 * (n - 1) / n * m * n_out * e) + side_s
    if backend == "gloo":  # reduce-scatter ring, then an all-gather ring with the side work
        c = costs.send_s(chunk_rows * n_out * e)
        ring = g + (n - 1) * costs.overlapped_s(op, g, c) + costs.overlapped_s(op, side_s, (n - 1) * c)
        return ring, plain
    chunks = all_reduce_chunks(m * n_out * e)
    gc = costs.gemm_s(m / chunks, k, n_out, dtype_name)
    cc = costs.collective_s("all_reduce", 2 * (n - 1) / n * m * n_out * e / chunks)
    ring = gc + (chunks - 1) * costs.overlapped_s(op, gc, cc) + costs.overlapped_s(op, side_s, cc)
    return ring, plain


def ring_pays(ring_s, plain_s) -> bool:
    return ring_s < RING_MARGIN * plain_s


def all_reduce_chunks(nbytes) -> int:
    """Row chunks of matmul_all_reduce's NCCL form for an output of `nbytes`."""
    return max(1, min(ALL_REDUCE_CHUNKS, int(nbytes // MIN_ALL_REDUCE_CHUNK_BYTES)))
