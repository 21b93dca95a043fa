"""Rows of one weight that several tensor-parallel ranks hold: the key / value heads that the
query heads of more than one rank read (fewer key / value heads than ranks, or query heads that
do not split with them). Each rank holds only the heads its query heads read, as Megatron does,
and each head's gradient is the sum of the gradients of the ranks holding it.

    SharedRows(held, group)   the plan: rank r holds the unsharded rows `held[r]` (sorted)
    share_rows(w, b, plan)    fwd identity; bwd each row's gradient summed over its holders
                              (one all-to-all of the shared rows, or one all-reduce where every
                              rank holds the same rows), in rank order, so every holder ends
                              with the same bits
"""

import torch
import torch.distributed as dist

from tplayers.functional import comm


class SharedRows:
    """Which unsharded rows each rank of `group` holds (`held[r]`, sorted, unique), and what this
    rank exchanges: with rank s, the rows both hold, in increasing order, at local positions
    `sent[s]` (the same positions on the way back). `counted`: the local rows [a, b) no lower
    rank holds, which this rank counts in norms (each row once over the group)."""

    def __init__(self, held: list[torch.Tensor], group):
        self.group = group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        if len(held) != n:
            raise ValueError(f"SharedRows: {len(held)} row sets for a group of {n} ranks")
        self.held = [torch.as_tensor(h, dtype=torch.long) for h in held]
        mine = self.held[r]
        if mine.numel() and not bool((mine[1:] > mine[:-1]).all()):
            raise ValueError("SharedRows: each rank's rows must be sorted and unique")
        self.same = all(torch.equal(h, mine) for h in self.held)
        self.sent = [
            torch.zeros(0, dtype=torch.long) if s == r else torch.isin(mine, self.held[s]).nonzero().flatten()
            for s in range(n)
        ]
        lower = torch.cat([torch.zeros(0, dtype=torch.long), *self.held[:r]])
        first_new = (~torch.isin(mine, lower)).nonzero().flatten()
        start = int(first_new[0]) if first_new.numel() else mine.numel()
        if first_new.numel() != mine.numel() - start:  # the rows lower ranks hold come first
            raise ValueError("SharedRows: the rows this rank shares with lower ranks are not its first ones")
        self.counted = (start, mine.numel())
        self._index = torch.cat(self.sent)
        self._devices: dict = {}

    def __deepcopy__(self, memo):
        return self  # a plan over the same ranks (a deep copy of a layer computes over them too)

    def index(self, device) -> torch.Tensor:
        if device not in self._devices:
            self._devices[device] = self._index.to(device)
        return self._devices[device]

    def sum_over_holders(self, grad: torch.Tensor) -> torch.Tensor:
        """Each row of `grad` (this rank's rows' gradients) summed over every rank holding it, in
        rank order (0 + g_first + g_next + ...: the same bits on every holder)."""
        if dist.get_world_size(self.group) == 1:
            return grad
        grad = grad.contiguous()
        if self.same:
            out = grad.clone()
            comm.all_reduce(out, self.group)
            return out
        index = self.index(grad.device)
        received = torch.empty((index.numel(), *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        counts = [i.numel() for i in self.sent]
        comm.all_to_all(received, grad.index_select(0, index), counts, self.group)
        out, offset, r = torch.zeros_like(grad), 0, dist.get_rank(self.group)
        for s, rows in enumerate(self.sent):
            if s == r:
                out += grad
            elif rows.numel():
                out.index_add_(0, index[offset : offset + rows.numel()], received[offset : offset + rows.numel()])
            offset += rows.numel()
        return out


class _ShareRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, weight, bias):
        ctx.plan, ctx.has_bias, ctx.weight_shape = plan, bias is not None, weight.shape
        return weight.view_as(weight), (bias.view_as(bias) if bias is not None else None)

    @staticmethod
    def backward(ctx, d_weight, d_bias):
        if d_weight is None and d_bias is None:
            return None, None, None
        if not ctx.has_bias:
            return None, ctx.plan.sum_over_holders(d_weight), None
        # weight and bias rows travel together: one exchange per layer
        d_weight = d_weight if d_weight is not None else d_bias.new_zeros(ctx.weight_shape)
        d_bias = d_bias if d_bias is not None else d_weight.new_zeros(d_weight.shape[0])
        both = ctx.plan.sum_over_holders(torch.cat([d_weight, d_bias[:, None].to(d_weight.dtype)], 1))
        return None, both[:, :-1], both[:, -1].to(d_bias.dtype)


def share_rows(weight, bias, plan: SharedRows):
    """(weight, bias) as they are; in backward each row's gradient summed over the ranks holding it."""
    return _ShareRows.apply(plan, weight, bias)
