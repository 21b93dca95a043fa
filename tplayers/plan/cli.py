"""`tplayers plan`: estimate one layout, rank every layout (`--search`), or check the estimator
against measurements on local CPU ranks (`--validate`). Bad input exits with code 2.

    tplayers plan --model llama3-70b --cluster h100-80gb --gpus 512 \\
        --tp 8 --pp 4 --dp 16 --zero 1 --micro-batch 1 --num-microbatches 32 \\
        --sequence-parallel --recompute selective --schedule 1f1b
    tplayers plan --model llama3-8b --cluster a100-80gb --gpus 64 --search --global-batch 512
    tplayers plan --num-params 1e9 --cluster a100-80gb --gpus 1        # model states only
    tplayers plan --validate
"""

import argparse
import csv
from pathlib import Path

from tplayers import plan

MODEL_DIMS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len")
# a mixture of experts' fields (ModelSpec.experts, ...): with explicit dimensions, or overriding a config's
EXPERT_DIMS = ("experts", "experts_per_token", "expert_ffn", "shared_ffn", "dense_layers")


def add_arguments(parser) -> None:
    model = parser.add_argument_group("model (one of --model, --hf-config, explicit dimensions, --num-params)")
    model.add_argument("--model", help="preset: " + ", ".join(sorted(plan.MODEL_PRESETS)))
    model.add_argument("--hf-config", help="a HuggingFace config.json (or its folder)")
    for dim in (*MODEL_DIMS, *EXPERT_DIMS):
        model.add_argument(f"--{dim.replace('_', '-')}", type=int, dest=dim)
    model.add_argument("--num-params", type=float, help="parameter count only: model-state memory questions")
    model.add_argument(
        "--plain-mlp", action="store_true",
        help="explicit dimensions: a GPT-style 2-matrix GeLU MLP (default: gated SwiGLU, as Llama)",
    )  # fmt: skip
    model.add_argument("--dropout", action="store_true", help="explicit dimensions: the model trains with dropout")

    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--cluster", default="h100-80gb", help="preset: " + ", ".join(sorted(plan.CLUSTER_PRESETS)))
    cluster.add_argument("--gpus", type=int, default=None, help="number of GPUs (default: tp*pp*dp)")

    layout = parser.add_argument_group("layout")
    layout.add_argument(
        "--tp", type=tp_size, default=None,
        help="default 1; RxC: a 2-D grid (tp_r x tp_c, e.g. 4x4); with --search: only this size or grid",
    )  # fmt: skip
    layout.add_argument("--pp", type=int, default=None, help="default 1; with --search: only this size")
    layout.add_argument("--dp", type=int, default=None, help="default 1; with --search: only this size")
    layout.add_argument("--zero", type=int, default=None, dest="zero_stage", help="ZeRO stage 0-3 (default 0)")
    layout.add_argument(
        "--compress", default=None,
        help="gradient compression over the replicas: bf16 | int8 | topk:<fraction> | powersgd:rank=<r>[,start=<s>]",
    )  # fmt: skip
    layout.add_argument("--ep", type=int, default=None, help="expert parallelism over the dp replicas (default 1; "
                        "with --search: only this size)")  # fmt: skip
    layout.add_argument("--routing-imbalance", type=float, default=1.0,
                        help="MoE: the most loaded expert-parallel rank's pairs over the mean (default 1)")  # fmt: skip
    layout.add_argument("--micro-batch", type=int, default=1)
    layout.add_argument("--num-microbatches", type=int, default=1)
    layout.add_argument("--sequence-parallel", action="store_true")
    layout.add_argument("--recompute", default="none", help="none | selective | full")
    layout.add_argument("--schedule", default="1f1b", help="gpipe | 1f1b | interleaved")
    layout.add_argument("--virtual-stages", type=int, default=1, help="interleaved schedule: chunks per stage")
    layout.add_argument("--precision", default="mixed-adam", help="preset: " + ", ".join(plan.PRECISION_PRESETS))
    layout.add_argument(
        "--implementation", default="megatron", choices=plan.IMPLEMENTATION_CHOICES,
        help="whose layers to price: Megatron-LM's (the published analyses) or tplayers' own",
    )  # fmt: skip

    mode = parser.add_argument_group("mode")
    mode.add_argument(
        "--search", action="store_true", help="rank every valid layout for --gpus GPUs (--tp / --pp / --zero narrow it)"
    )
    mode.add_argument("--global-batch", type=int, help="sequences per step (--search)")
    mode.add_argument("--top", type=int, default=10, help="--search: rows shown")
    mode.add_argument("--show-rejected", action="store_true", help="--search: also list rejected layouts and why")
    mode.add_argument("--validate", action="store_true", help="compare predictions with measurements on CPU ranks")
    mode.add_argument("--csv", help="write the estimate(s) as CSV rows here")


def tp_size(text: str):
    """--tp: an int, or RxC for a 2-D grid."""
    parts = text.lower().split("x")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or min(values, default=0) < 1:
        raise argparse.ArgumentTypeError(f"--tp takes a size (8) or a grid RxC (4x4), got {text!r}")
    return values[0] if len(values) == 1 else tuple(values)


def _model(args) -> plan.ModelSpec:
    dims = {d: getattr(args, d) for d in (*MODEL_DIMS, *EXPERT_DIMS) if getattr(args, d) is not None}
    given = [name for name, used in (("--model", args.model), ("--hf-config", args.hf_config),
                                     ("--num-params", args.num_params)) if used is not None]  # fmt: skip
    if len(given) > 1 or (given and given[0] == "--num-params" and dims):
        raise ValueError(f"give the model one way: {', '.join(given + [f'--{d}' for d in dims])}")
    if args.model is not None:
        return plan.ModelSpec.preset(args.model, **dims)
    if args.hf_config is not None:
        return plan.ModelSpec.from_hf_config(args.hf_config, **dims)
    if args.num_params is not None:
        return plan.ModelSpec(num_params=args.num_params)
    if not dims:
        raise ValueError("no model: give --model PRESET, --hf-config PATH, the dimensions, or --num-params")
    return plan.ModelSpec(**dims, gated_mlp=not args.plain_mlp, dropout=args.dropout)


def _layout(args) -> plan.Layout:
    return plan.Layout(
        tp=args.tp or 1, pp=args.pp or 1, dp=args.dp or 1, zero_stage=args.zero_stage or 0,
        micro_batch=args.micro_batch,
        num_microbatches=args.num_microbatches, sequence_parallel=args.sequence_parallel,
        recompute=args.recompute, schedule=args.schedule, virtual_stages=args.virtual_stages,
        compress=args.compress, ep=args.ep or 1,
    )  # fmt: skip


def _write_csv(path, estimates) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=plan.ESTIMATE_FIELDS)
        writer.writeheader()
        writer.writerows(plan.estimate_to_dict(est) for est in estimates)
    print(f"wrote {path}")


def _validate(args) -> int:
    from tplayers.plan.validate import format_validation, validate

    rows = validate()
    print(format_validation(rows))
    return 0 if all(row.ok for row in rows) else 1


def run(args) -> int:
    if args.validate:
        return _validate(args)
    model = _model(args)
    precision = plan.Precision.preset(args.precision)
    assumptions = plan.Assumptions(implementation=args.implementation, routing_imbalance=args.routing_imbalance)
    layout = _layout(args)
    gpus = args.gpus if args.gpus is not None else layout.tp * layout.pp * layout.dp
    cluster = plan.ClusterSpec.preset(args.cluster, num_gpus=gpus)
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if not args.search and args.global_batch is not None:
        raise ValueError("--global-batch is for --search (one layout's batch is dp * micro-batch * num-microbatches)")
    if args.search:
        if args.global_batch is None:
            raise ValueError("--search needs --global-batch (sequences per step)")
        if args.gpus is None:
            raise ValueError("--search needs --gpus (the number of GPUs to lay out)")
        narrow = dict(
            tp_sizes=(() if isinstance(args.tp, tuple) else (args.tp,)) if args.tp else None,
            tp_grids=(args.tp,) if isinstance(args.tp, tuple) else None,
            pp_sizes=(args.pp,) if args.pp else None,
            ep_sizes=(args.ep,) if args.ep else None,
            **({"zero_stages": (args.zero_stage,)} if args.zero_stage is not None else {}),
            **({"compress": (args.compress,)} if args.compress is not None else {}),
        )
        ranked = plan.search(
            model, cluster, args.global_batch, precision,
            include_invalid=args.show_rejected, assumptions=assumptions, **narrow,
        )  # fmt: skip
        fitting = [pair for pair in ranked if pair[1].fits]
        print(f"{len(fitting)} layouts fit {model.name or 'the model'} on {gpus} x {cluster.name}")
        print(plan.format_ranking(ranked if args.show_rejected else fitting, top=args.top))
        if args.show_rejected:
            for layout_, est in ranked[len(fitting) :][: args.top]:
                print(f"rejected {layout_.describe()}: {'; '.join(est.reasons)}")
        if args.csv:
            _write_csv(args.csv, [est for _, est in ranked])
        if not fitting:
            print("no layout fits")
            return 1
        return 0
    est = plan.estimate(model, cluster, layout, precision, assumptions=assumptions)
    print(plan.format_estimate(est))
    if args.csv:
        _write_csv(args.csv, [est])
    return 0
