"""`search`: every layout of a cluster for a global batch, validated, estimated and ranked by step time."""

from __future__ import annotations

import itertools
from dataclasses import replace

from tplayers.data_parallel.compress import Compression
from tplayers.plan.estimate import Estimate, _estimate
from tplayers.plan.layout import Assumptions, Layout
from tplayers.plan.rules import validate_layout
from tplayers.plan.specs import (
    RECOMPUTE_CHOICES,
    SCHEDULE_CHOICES,
    ZERO_STAGES,
    ClusterSpec,
    ModelSpec,
    Precision,
    _choice,
    _positive_int,
)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidate_layouts(cluster: ClusterSpec, global_batch: int, include_invalid: bool, options: dict):
    """Every layout of the option grid, skipping equivalent duplicates: ZeRO stages with dp = 1,
    schedules with pp = 1, sequence parallelism with tp = 1."""
    n = cluster.num_gpus
    tps = options["tp_sizes"]
    grids = options["tp_grids"]
    if tps is None:
        tps = [d for d in _divisors(n) if d <= cluster.gpus_per_node]
    elif grids is None:  # sizes asked for: grids only where asked for too
        grids = ()
    for tp in [*tps, *_grids(cluster, grids)]:
        size = tp[0] * tp[1] if isinstance(tp, tuple) else tp
        pps = options["pp_sizes"] or _divisors(max(1, n // size))
        for pp, cp in itertools.product(pps, options["cp_sizes"]):
            if cp > 1 and (isinstance(tp, tuple) or size * pp * cp > n):
                continue
            dp = max(1, n // (size * pp * cp))  # an explicit tp / pp that does not divide n stays invalid
            for mb in options["micro_batches"]:
                if global_batch % (dp * mb) and not include_invalid:
                    continue
                m = max(1, global_batch // (dp * mb))
                yield from _variants(tp, pp, dp, mb, m, options, cp)


def _grids(cluster: ClusterSpec, grids):
    """The grids to try: `grids` as given, or every r x c with r, c >= 2 whose rows fit in a node
    and whose size divides the cluster."""
    if grids is not None:
        return [tuple(g) for g in grids]
    n, per_node = cluster.num_gpus, cluster.gpus_per_node
    return [(size // c, c) for size in _divisors(n) for c in _divisors(size)
            if c >= 2 and size // c >= 2 and c <= per_node and (n <= per_node or per_node % c == 0)]  # fmt: skip


def _variants(tp, pp, dp, mb, m, options, cp=1):
    zero_stages = options["zero_stages"] if dp > 1 else (0,)
    sps = options["sequence_parallel"] if tp != 1 and (not isinstance(tp, tuple) or tp[0] > 1) else (False,)
    schedules = [
        (s, v) for s in options["schedules"] for v in (options["virtual_stages"] if s == "interleaved" else (1,))
    ]
    if pp == 1:
        schedules = [("1f1b", 1)]
    compressions = options["compress"] if dp > 1 else (None,)
    eps = [e for e in options["ep_sizes"] if dp % e == 0 and (cp == 1 or e == 1)]
    for zero, compress, ep in itertools.product(zero_stages, compressions, eps):
        if compress is not None and zero >= 2 and Compression.parse(compress).kind != "bf16":
            continue  # refused by data_parallel (only bf16 at ZeRO 2-3)
        for recompute in options["recompute"]:
            for sp in sps:
                for schedule, v in schedules:
                    for order in options["rank_orders"]:
                        yield Layout(
                            tp=tp,
                            pp=pp,
                            dp=dp,
                            zero_stage=zero,
                            micro_batch=mb,
                            num_microbatches=m,
                            sequence_parallel=sp,
                            recompute=recompute,
                            schedule=schedule,
                            virtual_stages=v,
                            rank_order=order,
                            compress=compress,
                            ep=ep,
                            cp=cp,
                        )


def search(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    precision: Precision | None = None,
    *,
    zero_stages=ZERO_STAGES,
    recompute=RECOMPUTE_CHOICES,
    micro_batches=(1, 2, 4, 8),
    schedules=("1f1b", "interleaved"),
    virtual_stages=(2, 4),
    sequence_parallel=(False, True),
    tp_sizes=None,
    tp_grids=None,
    pp_sizes=None,
    rank_orders=("tp-dp-pp",),
    compress=(None,),
    ep_sizes=None,
    cp_sizes=(1,),
    include_invalid: bool = False,
    assumptions: Assumptions | None = None,
) -> list[tuple[Layout, Estimate]]:
    """All layouts of `cluster.num_gpus` GPUs for `global_batch` sequences per step, ranked.

    tp runs over the divisors of num_gpus up to gpus_per_node (or `tp_sizes`), then the 2-D
    grids (`tp_grids`: (r, c) pairs; default, when `tp_sizes` is not given, every r x c with
    r, c >= 2 whose tp_c rows fit in a node; `()` for none), pp over the divisors of
    num_gpus / tp (or `pp_sizes`), dp = num_gpus / (tp*pp), and num_microbatches =
    global_batch / (dp * micro_batch); `compress` the gradient compressions to try where dp > 1
    (each at the ZeRO stages that take it), and for a mixture of experts expert parallelism over
    every divisor of dp (or `ep_sizes`; dense models: 1 only); context parallelism over
    `cp_sizes` (1 only by default; e.g. (1, 2, 4, 8) for long sequences). Returns (layout,
    estimate) pairs, fitting layouts first by step time (fastest first). With `include_invalid`,
    the invalid and non-fitting ones follow (global batches that do not divide included), each
    with its `reasons`.
    """
    if not model.has_dims:
        raise ValueError("search ranks by step time, which needs the model's dimensions (not just num_params)")
    _positive_int("search", "global_batch", global_batch)
    for name, values in (("micro_batches", micro_batches), ("virtual_stages", virtual_stages),
                         ("tp_sizes", tp_sizes or ()), ("pp_sizes", pp_sizes or ())):  # fmt: skip
        for value in values:
            _positive_int("search", name, value)
    for grid in tp_grids or ():
        Layout(tp=tuple(grid))  # a clear error for a bad grid
    for value in zero_stages:
        if value not in ZERO_STAGES:
            raise ValueError(f"unknown zero_stage {value!r}; valid: 0, 1, 2, 3")
    for value in recompute:
        _choice(value, RECOMPUTE_CHOICES, "recompute")
    for value in schedules:
        _choice(value, SCHEDULE_CHOICES, "schedule")
    for value in compress:
        Compression.parse(value)  # a clear error for a bad spec
    for value in ep_sizes or ():
        _positive_int("search", "ep_sizes", value)
    for value in cp_sizes:
        _positive_int("search", "cp_sizes", value)
    if ep_sizes is None:
        ep_sizes = range(1, cluster.num_gpus + 1) if model.experts else (1,)
    options = dict(
        ep_sizes=tuple(ep_sizes),
        cp_sizes=tuple(cp_sizes),
        compress=tuple(compress),
        zero_stages=tuple(zero_stages),
        recompute=tuple(recompute),
        micro_batches=tuple(micro_batches),
        schedules=tuple(schedules),
        virtual_stages=tuple(virtual_stages),
        sequence_parallel=tuple(sequence_parallel),
        tp_sizes=tp_sizes,
        tp_grids=tp_grids,
        pp_sizes=pp_sizes,
        rank_orders=tuple(rank_orders),
    )
    good, bad = [], []
    for layout in _candidate_layouts(cluster, global_batch, include_invalid, options):
        reasons = validate_layout(model, cluster, layout, global_batch=global_batch)
        if reasons and not include_invalid:
            continue
        est = _estimate(model, cluster, layout, precision, assumptions)
        if reasons:
            est = replace(est, reasons=tuple(dict.fromkeys((*reasons, *est.reasons))), valid=False)
        (good if est.fits else bad).append((layout, est))
    good.sort(key=lambda pair: pair[1].step_time_s)
    bad.sort(key=lambda pair: (pair[1].step_time_s is None, pair[1].step_time_s or 0.0))
    return good + bad if include_invalid else good
