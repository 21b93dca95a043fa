"""Memory, communication and time estimates for TP x PP x DP x ZeRO training layouts.

Pure Python (no torch): `estimate` prices one `Layout` of a `ModelSpec` on a `ClusterSpec`;
`search` enumerates layouts for a global batch and ranks the valid ones that fit by step time.

Modules, each importing only those listed above it:

    presets    the named models, precision recipes and GPUs, as the classes' fields
    hf_config  a config.json read into ModelSpec's fields, what cannot be priced refused by name
    specs      ModelSpec (dimensions, parameter counts, `preset`, `from_hf_config`), Precision,
               ClusterSpec, the choice constants and argument checks
    layout     Layout, Assumptions
    experts    a mixture of experts: what a rank holds, computes, stores and sends for its experts
               under expert parallelism (Layout.ep), at a stated routing balance
    memory     model-state bytes under ZeRO, activation bytes per layer and at the edges
    schedule   pipeline schedules: micro-batches in flight, the bubble
    flops      matmul FLOPs per token and per step
    comm       bytes of ring collectives, DP and TP traffic, the link of each parallel group
    grid       2-D tensor parallelism (Layout(tp=(r, c))): a grid rank's tensors, activations,
               FLOPs and bytes per axis, as `tplayers.hf.grid` lays out a Llama-style model
    rules      validate_layout: why a layout cannot run a model on a cluster
    results    MemoryBreakdown, StageEstimate, Estimate
    estimate   estimate: memory, FLOPs, communication and time of one layout, stage by stage
    search     search: every layout for a global batch, ranked by step time
    report     estimate_to_dict, format_estimate, format_ranking
    cli        `tplayers plan`
    validate   `tplayers plan --validate`: the estimates against one real training step
    measure    its cases, and the step measured on local CPU ranks

What may be imported here: the estimator modules (all but `cli`, `validate`, `measure`) are pure Python,
the standard library and each other, never torch, so the planner runs on any machine.
`validate` / `measure` measure on local CPU ranks: it may import torch (and transformers) and any lower
tplayers layer (`tplayers.hf`, `tplayers.train`, `tplayers.nn`, `tplayers.functional`, the
foundations such as `tplayers.distributed`), never `tplayers.tools`. This `__init__` imports
neither `cli` nor `validate`; `cli` imports `validate` only for `--validate`.

Conventions (read these before the numbers)
-------------------------------------------
* Memory (`Estimate.memory`, `MemoryBreakdown`): bytes **per GPU**, for the pipeline stage
  that needs the most (`MemoryBreakdown.stage`; every stage is in `Estimate.stages`). That is
  the one that decides whether a layout fits. Under 1F1B it is usually stage 0 (most
  micro-batches in flight, plus the embedding); with a large vocabulary and few layers per
  stage it can be the last (LM head and fp32 logits).
* FLOPs (`Estimate.model_flops`, `Estimate.hardware_flops`): per optimizer step for the
  **whole job** (all GPUs), the Megatron / PaLM convention; divide by `num_gpus` for an
  average per GPU. Model FLOPs count forward + backward (3 passes of matmuls, no
  recomputation, true vocabulary); hardware FLOPs add the recomputed forward and the padded
  vocabulary.
* Communication (`Estimate.comm_bytes`): bytes **sent per GPU per step**, ring algorithms,
  split by link class ("intra_node" NVLink, "inter_node" network) and, in
  `Estimate.comm_bytes_by_group`, by parallelism ("tp", "pp", "dp"), for the critical stage.
* Time (`Estimate.step_time_s`): seconds per optimizer step of the slowest pipeline stage
  (`Estimate.critical_stage`); `Estimate.time_breakdown` splits it.
* `bubble_fraction` is pipeline bubble time / ideal (bubble-free) time, as in Narayanan et al.
  2021 Sec. 2.2; bubble / total is `b / (1 + b)`.

Parallel layout conventions
---------------------------
* Ranks are ordered tp fastest, then dp, then pp (`rank_order="tp-dp-pp"`, Megatron-LM's
  default), or tp, pp, dp (`"tp-pp-dp"`, the order of `tplayers.init_mesh`'s ("dp", "pp", "tp")
  mesh). A group runs over the network ("inter_node") as soon as any of its groups spans two
  nodes; TP must stay within a node.
* Pipeline stages hold `layers / pp` transformer layers each; stage 0 also holds the word (and
  learned position) embedding, stage pp-1 the final norm and the LM head. Tied embeddings keep
  a second copy of the word embedding on the last stage when pp > 1 (Megatron does, and
  all-reduces the two gradients).
* The vocabulary is padded to a multiple of `Assumptions.vocab_divisible_by * tp` (Megatron's
  `--make-vocab-size-divisible-by 128`), so any tp is valid for any vocabulary.
* 2-D grids (`Layout(tp=(r, c))`, `tplayers.plan.grid`): tp = r x c ranks, tp_c fastest. A
  grid row (tp_c, c consecutive ranks) stays within a node; its columns (tp_r, r ranks c apart)
  cross nodes once r x c exceeds one, each axis' bytes timed on its own link
  (`Estimate.comm_bytes_by_axis`: "tp_r", "tp_c" and "tp_all", the vocabulary-parallel edges
  over all r x c). Priced as tplayers runs it whatever `Assumptions.implementation` says
  (Megatron has no grid), the attention core repeated on the c ranks of a row; sequence
  parallelism on a grid splits the sequence over tp_r (the residual stream T / r x H / c).
* Mixtures of experts (`ModelSpec.experts`, `tplayers.plan.experts`): `Layout(ep=E)` spreads
  each MoE layer's experts whole over E consecutive dp replicas (`tplayers.init_mesh(dp=, ep=)`),
  their gradients reduced over the dp / E replicas holding the same experts; E divides dp. The
  dispatch and combine all-to-alls are priced per token and destination rank at uniform routing
  (`destinations`) scaled by `Assumptions.routing_imbalance` for the most loaded rank, and timed
  exposed on the "ep" group's link (`Estimate.comm_bytes_by_group["ep"]`, `time_breakdown["ep"]`);
  the routed experts' grouped GEMMs run at `Assumptions.grouped_gemm_efficiency`.
* Key / value heads: split with the query heads where both divide; otherwise each rank holds
  the key/value heads its whole query heads read (`specs.kv_heads_read`, as `tplayers.hf`'s
  SharedKVProjection holds them), and the gradients of the heads several ranks share are summed
  over those ranks in backward (`specs.kv_rows_exchanged`: the shared rows sent to each sharer,
  or one all-reduce where every rank holds the same single head).

What is left out (see each function): the optimizer's temporary buffers, NCCL / CUDA context
memory (covered by `Assumptions.hbm_reserve_fraction`), allocator fragmentation, the
sequence-parallel re-gather of stored inputs in backward, and layer-norm / softmax FLOPs.
"""

from tplayers.plan import presets as _presets
from tplayers.plan.comm import (
    all_gather_bytes,
    all_reduce_bytes,
    dp_bytes_per_step,
    group_link,
    reduce_scatter_bytes,
    tp_bytes_per_layer,
)
from tplayers.plan.estimate import BACKWARD_SHARE as BACKWARD_SHARE
from tplayers.plan.estimate import DP_BUCKET_PARAMS as DP_BUCKET_PARAMS
from tplayers.plan.estimate import DP_BUCKET_PARAMS_PER_RANK as DP_BUCKET_PARAMS_PER_RANK
from tplayers.plan.estimate import estimate
from tplayers.plan.experts import destinations, ep_bytes_per_layer
from tplayers.plan.flops import training_flops
from tplayers.plan.layout import Assumptions, Layout
from tplayers.plan.memory import LOGITS_BYTES as LOGITS_BYTES
from tplayers.plan.memory import MASK_BYTES as MASK_BYTES
from tplayers.plan.memory import layer_activation_bytes, model_state_bytes
from tplayers.plan.presets import CLUSTER_PRESETS as CLUSTER_PRESETS
from tplayers.plan.report import ESTIMATE_FIELDS, estimate_to_dict, format_estimate, format_ranking
from tplayers.plan.results import Estimate, MemoryBreakdown, StageEstimate
from tplayers.plan.rules import validate_layout
from tplayers.plan.schedule import bubble_fraction, microbatches_in_flight
from tplayers.plan.search import search
from tplayers.plan.specs import GROUPS as GROUPS
from tplayers.plan.specs import IMPLEMENTATION_CHOICES as IMPLEMENTATION_CHOICES
from tplayers.plan.specs import LINK_CLASSES as LINK_CLASSES
from tplayers.plan.specs import NORM_CHOICES as NORM_CHOICES
from tplayers.plan.specs import POSITION_CHOICES as POSITION_CHOICES
from tplayers.plan.specs import RANK_ORDER_CHOICES as RANK_ORDER_CHOICES
from tplayers.plan.specs import RECOMPUTE_CHOICES as RECOMPUTE_CHOICES
from tplayers.plan.specs import SCHEDULE_CHOICES as SCHEDULE_CHOICES
from tplayers.plan.specs import ZERO_STAGES as ZERO_STAGES
from tplayers.plan.specs import ClusterSpec, ModelSpec, ParamCounts, Precision, count_params, padded_vocab
from tplayers.plan.specs import GiB as GiB

# The named models and precision recipes, built (presets.py keeps their fields, free of specs)
MODEL_PRESETS = {name: ModelSpec.preset(name) for name in _presets.MODEL_PRESETS}
PRECISION_PRESETS = {name: Precision.preset(name) for name in _presets.PRECISION_PRESETS}

# The `X as X` imports: the single-module planner's other public names, importable from here as before.
__all__ = [
    "Assumptions",
    "ClusterSpec",
    "Estimate",
    "ESTIMATE_FIELDS",
    "Layout",
    "MemoryBreakdown",
    "ModelSpec",
    "ParamCounts",
    "Precision",
    "StageEstimate",
    "all_gather_bytes",
    "all_reduce_bytes",
    "bubble_fraction",
    "count_params",
    "destinations",
    "ep_bytes_per_layer",
    "dp_bytes_per_step",
    "estimate",
    "estimate_to_dict",
    "format_estimate",
    "format_ranking",
    "group_link",
    "layer_activation_bytes",
    "microbatches_in_flight",
    "model_state_bytes",
    "padded_vocab",
    "reduce_scatter_bytes",
    "search",
    "tp_bytes_per_layer",
    "training_flops",
    "validate_layout",
]
