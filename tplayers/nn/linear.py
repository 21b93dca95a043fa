"""Column- and row-parallel linear layers.

Weights follow nn.Linear's (out, in) layout; rank r of the TP group holds the r-th contiguous
slice: ColumnParallelLinear splits `out` (weight (out/n, in), bias (out/n,)), RowParallelLinear
splits `in` (weight (out, in/n), bias (out,) replicated). A size that does not divide splits as
torch.chunk splits it (`tplayers.placement.shard_sizes`: ceil(size / n) each, the last rank
the rest, a rank may hold none); the ranks still take part in every collective. Each parameter carries its placement
(tplayers.placement). Inputs are batch-first (B, S, H); with sequence_parallel=True the
activations outside the TP region are sharded along dim 1, or, for a flattened (tokens, H) input
(OPT's MLP, MoE blocks), along the tokens: each rank's tokens are treated as a (1, T/n, H)
sequence, so the gathered tokens are every rank's in rank order and the output returns to
this rank's own. The math and the communication
per mode are in tplayers/functional/linear.py.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from tplayers.distributed import refuse_grid, resolve_group
from tplayers.functional import comm
from tplayers.functional.auto_overlap import check_overlap
from tplayers.functional.collectives import (
    all_gather_dim,
    gather_from_tp_region,
    own_slice,
    reduce_scatter_dim,
    scatter_to_tp_region,
)
from tplayers.functional.linear import column_parallel_linear, row_parallel_linear
from tplayers.functional.rng import enter_sharded_region, leave_sharded_region
from tplayers.placement import PlacedModule, check_sizes, shard_sizes

_DEFERRED: list | None = None  # (group, sizes, what), while splits_checked_together() collects them


def _split(total: int, unit: int, sizes, group, what: str) -> tuple[int, ...]:
    """Every rank's share of a dimension of `total`, in whole units of `unit`: the explicit
    `sizes` (checked here, and against the other ranks': one tiny all-gather at construction, or
    one for all layers built inside `splits_checked_together`, so a rank told another split than
    its peers fails on every rank, not silently in the reductions), else as torch.chunk splits the units."""
    n = dist.get_world_size(group)
    if sizes is None:
        return tuple(shard_sizes(total // unit, n))
    sizes = check_sizes(sizes, total // unit, n, what)
    if n > 1 and _DEFERRED is not None:
        _DEFERRED.append((group, sizes, what))
    elif n > 1:
        _check_told(group, [(sizes, what)])
    return sizes


@contextlib.contextmanager
def splits_checked_together():
    """Layers built inside check that every rank was told the same splits all at once when it
    ends: two collectives per group, not one per layer (a model's sharding pass builds hundreds,
    and a collective costs milliseconds on gloo). Where the body raises, this rank stops there."""
    global _DEFERRED
    outer, _DEFERRED = _DEFERRED, []
    try:
        yield
        pending = _DEFERRED
    finally:
        _DEFERRED = outer
    if outer is not None:
        outer.extend(pending)
        return
    by_group: dict = {}
    for group, sizes, what in pending:  # groups in order of first use: the same on every rank
        by_group.setdefault(group, []).append((sizes, what))
    for group, told in by_group.items():
        _check_told(group, told)


def _check_told(group, told: list) -> None:
    """Every rank of `group` was told the same `told` ([(sizes, what)], in build order)."""
    n, device = dist.get_world_size(group), comm.control_device(group)
    mine = torch.tensor([s for sizes, _ in told for s in sizes], dtype=torch.int64, device=device)
    lengths = torch.empty(n, dtype=torch.int64, device=device)
    comm.all_gather_into(lengths, torch.tensor([mine.numel()], device=device), group, record=False)
    widest = int(lengths.max())
    rows = torch.empty(n, widest, dtype=torch.int64, device=device)
    comm.all_gather_into(rows, torch.cat([mine, mine.new_full((widest - mine.numel(),), -1)]), group, record=False)
    if len(set(lengths.tolist())) > 1:
        raise ValueError(f"the ranks built different layers (split sizes told, rank by rank: {lengths.tolist()})")
    start = 0
    for sizes, what in told:  # the first layer whose split the ranks disagree on
        block = rows[:, start : start + len(sizes)]
        if not bool((block == block[0]).all()):
            raise ValueError(f"{what}: the ranks were told different splits (rank by rank: {block.tolist()})")
        start += len(sizes)


def refuse_own_forward(module, base, what):
    """A subclass of `base` with its own forward computes something tplayers does not know
    (a scale, a quantisation, LoRA): sharding it as a plain `base` would be silently wrong."""
    if type(module).forward is not base.forward:
        raise TypeError(
            f"{what}: {type(module).__name__} overrides {base.__name__}.forward; its math is not known to "
            f"tplayers, so it is not replaced (pass a plain {base.__name__}, or keep the module replicated)"
        )


def _full_linear_init(in_features, out_features, bias, device, dtype):
    """Weights exactly as nn.Linear(in, out) would draw them on the CPU, so a TP layer built under
    a seed holds the shards of the CPU nn.Linear built under the same seed. The full weight
    exists briefly on every rank; device="meta" skips it (then load or use `from_linear`)."""
    init_device = "meta" if device is not None and torch.device(device).type == "meta" else "cpu"
    full = nn.Linear(in_features, out_features, bias=bias, device=init_device, dtype=dtype)
    return full.weight.detach(), (full.bias.detach() if bias else None)


def autocast_operands(layer, x):
    """(x, weight, bias) as the layer's GEMM takes them: under `torch.autocast` (HF Trainer's and
    accelerate's bf16 / fp16) all three in autocast's dtype, as torch's own linear takes them;
    the parameters stay in their dtype and get their gradients through the cast."""
    weight, bias = layer.weight, layer.bias
    device = x.device.type if isinstance(x, torch.Tensor) else "cpu"
    autocasting = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    if not (autocasting and weight.is_floating_point()):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    cast = lambda t: t if t is None or t.dtype == dtype else t.to(dtype)
    return cast(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, cast(weight), cast(bias)


def check_input(layer, x, expected_last_dim, sequence_parallel, weight=None):
    """The checks every rank makes on its input before any collective (all ranks see the same
    shapes, so all raise together instead of one hanging in a collective). `weight`: what the
    GEMM multiplies by (autocast's copy), default the layer's."""
    name = type(layer).__name__
    weight = layer.weight if weight is None else weight
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: input must be a Tensor, got {type(x).__name__}")
    if x.dtype != weight.dtype:
        raise TypeError(f"{name}: input dtype {x.dtype} does not match the weight dtype {weight.dtype}")
    if x.device != layer.weight.device:
        raise ValueError(f"{name}: input is on {x.device} but the weight is on {layer.weight.device}")
    if x.dim() == 0 or x.shape[-1] != expected_last_dim:
        raise ValueError(f"{name}: input last dim {tuple(x.shape)[-1:]} does not match the layer's {expected_last_dim}")
    if sequence_parallel and x.dim() not in (2, 3):
        raise ValueError(
            f"{name}: sequence_parallel needs a (batch, seq, hidden) or (tokens, hidden) input, got {tuple(x.shape)}"
        )


def tokens_as_sequence(forward):
    """Under sequence parallelism, run a (tokens, H) input as the (1, tokens, H) sequence."""

    def wrapped(self, x):
        if self.sequence_parallel and isinstance(x, torch.Tensor) and x.dim() == 2:
            return forward(self, x.unsqueeze(0)).squeeze(0)
        return forward(self, x)

    wrapped.__doc__, wrapped.__name__ = forward.__doc__, forward.__name__
    return wrapped


class _ParallelLinear(PlacedModule):
    """What both layers share: building from an nn.Linear, and keeping each parameter's
    placement attached when parameters are replaced (load_state_dict(assign=True)) or copied."""

    _placements: dict  # parameter name -> Shard(dim) / Replicate(), set by the subclass
    _on_a_grid = "GridLinear"  # the layer to build on a 2-D mesh instead

    def __init__(self, in_features, out_features, *, group, sequence_parallel, overlap):
        super().__init__()
        refuse_grid(group, type(self).__name__, self._on_a_grid)
        self.group = resolve_group(group)
        self.tp_size = dist.get_world_size(self.group)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.overlap = sequence_parallel, check_overlap(overlap, type(self).__name__)

    def _init_parameters(self, bias, device, dtype):
        """Draw the full nn.Linear weights, keep this rank's shards, keep placements attached."""
        weight, bias_full = _full_linear_init(self.in_features, self.out_features, bias, device, dtype)
        self._set_shards(weight, bias_full, device)
        self._keep_placements()

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group=None, device=None, dtype=None, **kwargs):
        """The layer holding this rank's slice of `linear` (which is left unchanged), optionally
        moved to `device` / cast to `dtype`."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear needs an nn.Linear, got {type(linear).__name__}")
        refuse_own_forward(linear, nn.Linear, cls.__name__)
        dtype = dtype or linear.weight.dtype
        layer = cls(
            linear.in_features, linear.out_features, linear.bias is not None, group=group,
            device="meta", dtype=dtype, **kwargs,
        )  # fmt: skip
        weight = linear.weight.detach().to(dtype)
        bias = linear.bias.detach().to(dtype) if linear.bias is not None else None
        layer._set_shards(weight, bias, device or linear.weight.device)
        return layer


class ColumnParallelLinear(_ParallelLinear):
    """y = x A^T + b with A split along its output features over `group`.

    Input (..., in_features) replicated over the group (sequence_parallel: (B, S/n, in)
    seq-sharded, all-gathered inside the GEMM). Output (..., out_features/n), or the whole
    (..., out_features) with gather_output=True (under sequence_parallel too: an LM head that
    turns the sequence shards into every rank's full logits). reduce_input_grad=False leaves the
    input gradient as this rank's partial sum, for several column layers sharing one input whose
    gradient the caller sums once (see tplayers.functional.copy_to_tp_region).
    """

    def __init__(
        self, in_features, out_features, bias=True, *, group=None, gather_output=False,
        sequence_parallel=False, overlap="auto", reduce_input_grad=True, split_unit=1, split_sizes=None,
        device=None, dtype=None,
    ):  # fmt: skip
        super().__init__(in_features, out_features, group=group, sequence_parallel=sequence_parallel, overlap=overlap)
        if out_features % split_unit:
            raise ValueError(
                f"ColumnParallelLinear: split_unit {split_unit} needs out_features ({out_features}) in whole units"
            )
        if (split_unit > 1 or split_sizes is not None) and gather_output:
            raise ValueError("ColumnParallelLinear: split_unit / split_sizes need gather_output=False")
        self.split_unit = split_unit  # rows split in whole units (ParallelMLP's gate / up pairs: 2)
        # units per rank: torch.chunk's split unless given (attention heads: as even as they go)
        self.split_sizes = _split(out_features, split_unit, split_sizes, self.group, "ColumnParallelLinear")
        self.out_features_per_rank = self.split_sizes[dist.get_rank(self.group)] * split_unit
        if sequence_parallel and not reduce_input_grad:
            raise ValueError("ColumnParallelLinear: reduce_input_grad=False applies only without sequence_parallel")
        self.gather_output, self.reduce_input_grad = gather_output, reduce_input_grad
        self._init_parameters(bias, device, dtype)

    _placements = {"weight": Shard(0), "bias": Shard(0)}
    _on_a_grid = "GridLinear(..., out_axis='tp_r')"

    def _set_shards(self, weight, bias, device):
        """Keep this rank's rows of the full weight / bias."""
        unit, sizes = self.split_unit, self.split_sizes
        self.weight = nn.Parameter(own_slice(weight, 0, self.group, unit, sizes).to(device=device, copy=True))
        if bias is not None:
            bias = nn.Parameter(own_slice(bias, 0, self.group, unit, sizes).to(device=device, copy=True))
        self.register_parameter("bias", bias)
        self._tag_parameters()

    @tokens_as_sequence
    def forward(self, x):
        x, weight, bias = autocast_operands(self, x)
        check_input(self, x, self.in_features, self.sequence_parallel, weight)
        y = column_parallel_linear(
            x, weight, bias, self.group, sequence_parallel=self.sequence_parallel, overlap=self.overlap,
            reduce_input_grad=self.reduce_input_grad, widest=self.widest,
        )  # fmt: skip
        if self.gather_output:
            return gather_from_tp_region(y, self.group, dim=-1, total=self.out_features)
        if self.training and self.tp_size > 1:  # this rank's features: its dropout draws of its own
            enter_sharded_region(y.device, self.group)
        return y

    @property
    def widest(self) -> int:
        """The largest rank's output features (the overlap choice is asked about it on every rank)."""
        return max(self.split_sizes) * self.split_unit

    def extra_repr(self):
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_features_per_rank} per rank of {self.tp_size}), bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}, overlap={self.overlap}"
        )


class _GatheredRows(torch.autograd.Function):
    """This rank's rows of a weight -> the whole weight; backward: this rank's rows of the whole
    weight's gradient, first summed over the group where each rank computed only part of it."""

    @staticmethod
    def forward(ctx, rows, group, sizes, summed):
        ctx.group, ctx.sizes, ctx.summed = group, sizes, summed
        return all_gather_dim(rows, 0, group, sizes=sizes)

    @staticmethod
    def backward(ctx, grad):
        if ctx.summed and len(set(ctx.sizes)) == 1:  # even rows: one reduce-scatter, half an all-reduce's bytes
            return reduce_scatter_dim(grad.contiguous(), 0, ctx.group), None, None, None
        if ctx.summed:
            grad = grad.contiguous().clone()
            comm.all_reduce(grad, ctx.group)
        return own_slice(grad, 0, ctx.group, sizes=ctx.sizes), None, None, None


class GatheredWeightLinear(_ParallelLinear):
    """nn.Linear computed whole on every rank, its weight stored split: for a module that acts token
    by token on the whole hidden state, kept whole, whose weights are too large to hold once per
    rank (Qwen4-Exp's hyper-connection mixers: 21M a layer). Each rank stores its rows of the weight
    (and bias), Shard(0) as a column layer's; every forward all-gathers them. Input and output are
    nn.Linear's, over the tokens this rank has: every rank's the same (the gradient of the whole
    weight is then the same on every rank: backward keeps this rank's rows), or under
    `sequence_parallel` its own (each rank's gradient is from its tokens: summed over the group
    first)."""

    _placements = {"weight": Shard(0), "bias": Shard(0)}
    _set_shards = ColumnParallelLinear._set_shards  # this rank's rows, as a column layer stores them

    def __init__(self, in_features, out_features, bias=True, *, group=None, sequence_parallel=False, overlap="auto",
                 device=None, dtype=None):  # fmt: skip
        super().__init__(in_features, out_features, group=group, sequence_parallel=sequence_parallel, overlap=overlap)
        self.split_unit = 1
        self.split_sizes = _split(out_features, 1, None, self.group, "GatheredWeightLinear")
        self.out_features_per_rank = self.split_sizes[dist.get_rank(self.group)]
        self._init_parameters(bias, device, dtype)

    def forward(self, x):
        x, weight, bias = autocast_operands(self, x)
        if self.tp_size == 1:
            return nn.functional.linear(x, weight, bias)
        sizes, summed = list(self.split_sizes), self.sequence_parallel
        weight = _GatheredRows.apply(weight, self.group, sizes, summed)
        bias = _GatheredRows.apply(bias, self.group, sizes, summed) if bias is not None else None
        return nn.functional.linear(x, weight, bias)

    def extra_repr(self):
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (whole; stored "
            f"{self.out_features_per_rank} rows per rank of {self.tp_size}), bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_ParallelLinear):
    """y = x A^T + b with A split along its input features over `group`.

    Input (..., in_features/n) split over the group (input_is_parallel=False: the whole
    (..., in_features), split here). Output (..., out_features) summed over the group
    (sequence_parallel: (B, S/n, out_features), reduce-scattered along the sequence). The bias
    is replicated and added once, after the reduction.
    """

    def __init__(
        self, in_features, out_features, bias=True, *, group=None, input_is_parallel=True,
        sequence_parallel=False, overlap="auto", split_unit=1, split_sizes=None, device=None, dtype=None,
    ):  # fmt: skip
        super().__init__(in_features, out_features, group=group, sequence_parallel=sequence_parallel, overlap=overlap)
        if in_features % split_unit:
            raise ValueError(
                f"RowParallelLinear: split_unit {split_unit} needs in_features ({in_features}) in whole units"
            )
        if (split_unit > 1 or split_sizes is not None) and not input_is_parallel:
            raise ValueError("RowParallelLinear: split_unit / split_sizes need input_is_parallel=True")
        self.split_unit = split_unit  # columns split in whole units (attention's heads: head_dim)
        self.split_sizes = _split(in_features, split_unit, split_sizes, self.group, "RowParallelLinear")
        self.in_features_per_rank = self.split_sizes[dist.get_rank(self.group)] * split_unit
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.input_is_parallel = input_is_parallel
        self._init_parameters(bias, device, dtype)

    _placements = {"weight": Shard(1), "bias": Replicate()}
    _on_a_grid = "GridLinear(..., out_axis='tp_c')"

    def _set_shards(self, weight, bias, device):
        """Keep this rank's columns of the full weight; the bias is whole on every rank."""
        self.weight = nn.Parameter(
            own_slice(weight, 1, self.group, self.split_unit, self.split_sizes).to(device=device, copy=True)
        )
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias.to(device=device, copy=True)))
        self._tag_parameters()

    @tokens_as_sequence
    def forward(self, x):
        leave_sharded_region()  # the sum makes the output every rank's: drawn for alike again
        expected = self.in_features_per_rank if self.input_is_parallel else self.in_features
        x, weight, bias = autocast_operands(self, x)
        check_input(self, x, expected, self.sequence_parallel, weight)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group, dim=-1)
        return row_parallel_linear(
            x, weight, bias, self.group, sequence_parallel=self.sequence_parallel, overlap=self.overlap,
            widest=self.widest,
        )  # fmt: skip

    @property
    def widest(self) -> int:
        """The largest rank's input features (the overlap choice is asked about it on every rank)."""
        return max(self.split_sizes) * self.split_unit

    def extra_repr(self):
        return (
            f"in_features={self.in_features} ({self.in_features_per_rank} per rank of {self.tp_size}), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}, "
            f"overlap={self.overlap}"
        )
