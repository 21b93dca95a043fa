"""ParallelLMHead: the LM head, split over the vocabulary, whose logits may be left uncomputed.

It is ColumnParallelLinear(gather_output=True): weight (V_r, H) this rank's slice of the
vocabulary, input (..., H) the same on every rank, output the full (..., V) logits. While
`defer_logits` is set (tplayers.hf sets it for a training forward given labels), its forward
computes nothing: it returns a placeholder, an fp32 meta tensor of the logits' shape (no memory;
anything computed from it fails loudly instead of giving numbers), and keeps its input for
`loss(placeholder, target, ...)`, which scores the rows with the fused LM-head cross-entropy
(tplayers.functional.linear_cross_entropy): no rank holds the (tokens x V) logits, in any dtype.
fp32 and contiguous, so `.float()` and `.contiguous()` on the placeholder return it unchanged.
"""

import weakref

import torch

from tplayers.functional.linear_cross_entropy import linear_cross_entropy
from tplayers.nn.linear import ColumnParallelLinear, autocast_operands, check_input

# id(placeholder) -> (a weak reference to it, the head, its GEMM operands; None once scored),
# dropped when the placeholder is freed (also after a forward that failed in between). By
# identity: a tensor key would be compared with `==`, elementwise.
_PENDING: dict[int, tuple] = {}


def _entry(placeholder):
    entry = _PENDING.get(id(placeholder)) if isinstance(placeholder, torch.Tensor) else None
    return entry if entry is not None and entry[0]() is placeholder else None


def is_deferred(logits) -> bool:
    """Whether `logits` is a placeholder a ParallelLMHead returned instead of its logits."""
    return _entry(logits) is not None


class ParallelLMHead(ColumnParallelLinear):
    """ColumnParallelLinear over the vocabulary with its output gathered, whose logits can be
    deferred to a fused loss (see the module docstring)."""

    defer_logits = False  # set per forward by whoever knows the logits will only be scored

    def __init__(self, in_features, out_features, bias=True, *, gather_output=True, **kwargs):
        if not gather_output:
            raise ValueError("ParallelLMHead: the head's logits are gathered (gather_output=True)")
        super().__init__(in_features, out_features, bias, gather_output=True, **kwargs)

    def forward(self, x):
        if not self.defer_logits:
            return super().forward(x)
        x, weight, bias = autocast_operands(self, x)
        check_input(self, x, self.in_features, False, weight)
        placeholder = torch.empty((*x.shape[:-1], self.out_features), dtype=torch.float32, device="meta")
        _PENDING[id(placeholder)] = (weakref.ref(placeholder), self, x, weight, bias)
        weakref.finalize(placeholder, _PENDING.pop, id(placeholder), None)
        return placeholder

    @staticmethod
    def loss(placeholder, target, *, ignore_index=-100, divisor=None):
        """The cross-entropy of the logits `placeholder` stands for against `target` (its shape
        without the vocabulary dim; global ids): the mean over rows not `ignore_index`, or their
        sum over `divisor`. An fp32 scalar, the same on every rank of the head's group."""
        entry = _entry(placeholder)
        if entry is None or entry[1] is None:
            raise ValueError("ParallelLMHead.loss: not a placeholder of deferred logits, or one scored already")
        ref, head, x, weight, bias = entry
        _PENDING[id(placeholder)] = (ref, None, None, None, None)  # still a placeholder; its operands freed
        if tuple(target.shape) != tuple(placeholder.shape[:-1]):
            raise ValueError(
                f"ParallelLMHead.loss: labels {tuple(target.shape)} do not match the logits {tuple(placeholder.shape)}"
            )
        return linear_cross_entropy(
            x, weight, bias, target.to(x.device), group=head.group, vocab_size=head.out_features,
            ignore_index=ignore_index, divisor=divisor,
        )  # fmt: skip
