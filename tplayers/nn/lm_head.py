"""ParallelLMHead: the LM head, split over the vocabulary, whose logits may be left uncomputed.

It is ColumnParallelLinear(gather_output=True): weight (V_r, H) this rank's slice of the
vocabulary, input (..., H) the same on every rank, output the full (..., V) logits. While
`defer_logits` is set (tplayers.hf sets it for a training forward given labels), its forward
computes nothing: it returns a placeholder of the logits' shape (no memory) and keeps its input
for `loss(placeholder, target, ...)`, which scores the rows with the fused LM-head cross-entropy
(tplayers.functional.linear_cross_entropy): no rank holds the (tokens x V) logits, in any dtype.

The placeholder is a meta tensor of a subclass that lets through only what the caller said the
model does to its logits before the loss (`logit_transforms`: a scale, a division, a tanh, which
the loss applies itself; and `.float()` / `.contiguous()`), each returning the placeholder
itself; any other use raises, naming the op: never numbers computed from nothing.
"""

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import Shard

from tplayers.functional.collectives import gather_from_tp_region
from tplayers.functional.linear import column_parallel_linear
from tplayers.functional.linear_cross_entropy import linear_cross_entropy
from tplayers.nn.linear import ColumnParallelLinear, autocast_operands, check_input


@dataclass
class _Pending:
    """What a placeholder stands for: the head and its GEMM operands (None once scored), the
    transforms the forward is expected to apply, and how many it has applied so far."""

    ref: weakref.ref
    head: "ParallelLMHead | None"
    operands: tuple | None  # (x, weight, bias) as the head's GEMM takes them
    transforms: tuple
    seen: int = 0


# id(placeholder) -> its _Pending, dropped when the placeholder is freed (also after a forward that
# failed in between). By identity: a tensor key would be compared with `==`, elementwise.
_PENDING: dict[int, _Pending] = {}


def _entry(placeholder) -> _Pending | None:
    entry = _PENDING.get(id(placeholder)) if isinstance(placeholder, torch.Tensor) else None
    return entry if entry is not None and entry.ref() is placeholder else None


def is_deferred(logits) -> bool:
    """Whether `logits` is a placeholder a ParallelLMHead returned instead of its logits."""
    return _entry(logits) is not None


def is_scored(logits) -> bool:
    """Whether `logits` is a placeholder whose loss `ParallelLMHead.loss` has computed."""
    entry = _entry(logits)
    return entry is not None and entry.head is None


# What a model may do to its logits before its loss, as the placeholder sees it: (op, torch functions).
_TRANSFORMS = {
    "mul": {torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.mul},
    "div": {torch.Tensor.div, torch.Tensor.__truediv__, torch.div, torch.true_divide},
    "tanh": {torch.Tensor.tanh, torch.tanh},
}
_UNCHANGED = {torch.Tensor.float, torch.Tensor.contiguous}


class DeferredLogitsError(RuntimeError):
    """A forward used the logits the LM head deferred in a way the fused loss was not told of.
    (Not a TypeError: Python's binary operators turn a TypeError into NotImplemented.)"""


class _Placeholder(torch.Tensor):
    """Deferred logits: a meta tensor that passes through the transforms it was told of and
    refuses everything else (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__":  # shape, dtype, device, ...: metadata reads
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        me = args[0] if args and isinstance(args[0], _Placeholder) else None
        others = [a for a in (*args[1:], *kwargs.values()) if a is not me]
        if me is not None and func in _UNCHANGED and not others:
            return me
        entry = _entry(me) if me is not None else None
        if entry is not None and entry.seen < len(entry.transforms):
            op, value = entry.transforms[entry.seen]
            if func in _TRANSFORMS[op] and [a for a in others if not isinstance(a, str)] == (
                    [] if op == "tanh" else [value]):  # fmt: skip
                entry.seen += 1
                return me
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        raise DeferredLogitsError(
            f"the LM head's logits of a training forward given labels are not computed (the loss is fused, "
            f"tplayers.hf.fused_loss), but the forward ran {name} on them; parallelize(..., training_logits=True) "
            "keeps the logits"
        )


class ParallelLMHead(ColumnParallelLinear):
    """ColumnParallelLinear over the vocabulary with its output gathered, whose logits can be
    deferred to a fused loss (see the module docstring)."""

    defer_logits = False  # set per forward by whoever knows the logits will only be scored
    # what the model's forward does to the logits before its loss, in order: ("mul" | "div", number)
    # or ("tanh", None); the placeholder lets these through and the loss applies them
    logit_transforms: tuple = ()
    forward_reading = None  # what tplayers.hf.fused_loss read of the forward that calls this head

    def __init__(self, in_features, out_features, bias=True, *, gather_output=True, **kwargs):
        if not gather_output:
            raise ValueError("ParallelLMHead: the head's logits are gathered (gather_output=True)")
        super().__init__(in_features, out_features, bias, gather_output=True, **kwargs)

    def forward(self, x):
        if not self.defer_logits:
            return super().forward(x)
        x, weight, bias = autocast_operands(self, x)
        check_input(self, x, self.in_features, False, weight)
        meta = torch.empty((*x.shape[:-1], self.out_features), dtype=torch.float32, device="meta")
        placeholder = torch.Tensor._make_subclass(_Placeholder, meta, False)
        operands, transforms = (x, weight, bias), tuple(self.logit_transforms)
        _PENDING[id(placeholder)] = _Pending(weakref.ref(placeholder), self, operands, transforms)
        weakref.finalize(placeholder, _PENDING.pop, id(placeholder), None)
        return placeholder

    @staticmethod
    def loss(placeholder, target, *, ignore_index=-100, divisor=None):
        """The cross-entropy of the logits `placeholder` stands for against `target` (its shape
        without the vocabulary dim; global ids): the mean over rows not `ignore_index`, or their
        sum over `divisor`. An fp32 scalar, the same on every rank of the head's group."""
        entry = _entry(placeholder)
        if entry is None or entry.head is None:
            raise ValueError("ParallelLMHead.loss: not a placeholder of deferred logits, or one scored already")
        head, (x, weight, bias), transforms = entry.head, entry.operands, entry.transforms
        if entry.seen != len(transforms):
            raise ValueError(
                f"ParallelLMHead.loss: the forward applied {entry.seen} of the {len(transforms)} logit transforms "
                f"{list(transforms)} it was expected to; the fused loss would score other logits"
            )
        entry.head = entry.operands = None  # still a placeholder, scored; its operands freed
        if tuple(target.shape) != tuple(placeholder.shape[:-1]):
            raise ValueError(
                f"ParallelLMHead.loss: labels {tuple(target.shape)} do not match the logits {tuple(placeholder.shape)}"
            )
        return linear_cross_entropy(
            x, weight, bias, target.to(x.device), group=head.group, vocab_size=head.out_features,
            ignore_index=ignore_index, divisor=divisor, transforms=transforms,
        )  # fmt: skip


class ScaledLogitsHead(ColumnParallelLinear):
    """An LM head that scales each vocabulary entry's logit by a learned factor, in fp32 (Dory's:
    `linear(x).float() * (logit_scale.float() * logit_scale_factor)`): ColumnParallelLinear over the
    vocabulary, `logit_scale` split with its rows (Shard(0)), each rank scaling its own logits before
    they are gathered: the unsharded head's operations on each element. Its logits are always
    computed (no fused loss reads the scale)."""

    _placements = {**ColumnParallelLinear._placements, "logit_scale": Shard(0)}

    def __init__(self, in_features, out_features, bias=True, *, factor: float = 1.0, **kwargs):
        super().__init__(in_features, out_features, bias, **kwargs)
        self.factor = factor

    def _set_shards(self, weight, bias, device):
        """This rank's rows of the weight / bias, and its entries of the scale (ones until given)."""
        super()._set_shards(weight, bias, device)
        local = self.out_features_per_rank
        self.logit_scale = nn.Parameter(torch.ones(local, device=device, dtype=weight.dtype))
        self._tag_parameters()

    def forward(self, x):
        x, weight, bias = autocast_operands(self, x)
        check_input(self, x, self.in_features, False, weight)
        local = column_parallel_linear(x, weight, bias, self.group, overlap=self.overlap, widest=self.widest)
        local = local.float() * (self.logit_scale.float() * self.factor)
        return gather_from_tp_region(local, self.group, dim=-1, total=self.out_features)
