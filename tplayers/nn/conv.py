"""`ChannelParallelConv1d`: the depthwise causal convolution of a state-space or linear-attention
mixer (Mamba's over [x; B; C], Gated DeltaNet's over [q; k; v]) split by channel with its heads.

A depthwise convolution mixes no channels, so each rank convolves its own heads' channels and
nothing is exchanged. Channels that every rank needs (B / C of a group that spans every head)
are held whole by each: each rank's heads give part of their gradient, which parallelize sums
over the group."""

import torch
from torch import nn
from torch.distributed.tensor import Shard

from tplayers.distributed import resolve_group
from tplayers.placement import PlacedModule


class ChannelParallelConv1d(PlacedModule):
    """This rank's `channels` (unsharded channel indices, in the order its forward reads them) of
    a depthwise nn.Conv1d. Those marked in `whole` every rank holds (`whole_weight`, placement
    Replicate, their gradient summed over the group by parallelize); the rest are this rank's own
    (`split_weight`, Shard(0)). `weight` and `bias` are
    the local (channels, 1, kernel) and (channels,) tensors in the forward's order, as
    transformers' mixers read them (`self.conv1d.weight.squeeze(1)`)."""

    # the whole channels are tagged by whoever sums their gradient (parallelize: Replicate, summed)
    _placements = {"split_weight": Shard(0), "split_bias": Shard(0)}

    def __init__(self, conv: nn.Conv1d, channels: torch.Tensor, whole: torch.Tensor, *, group=None):
        super().__init__()
        if conv.groups != conv.in_channels or conv.in_channels != conv.out_channels:
            raise ValueError(f"ChannelParallelConv1d: {conv} is not depthwise")
        self.group = resolve_group(group)
        self.kernel_size, self.stride, self.padding, self.dilation = (
            conv.kernel_size, conv.stride, conv.padding, conv.dilation,
        )  # fmt: skip
        self.in_channels = self.out_channels = self.groups = channels.numel()
        self.total_channels = conv.in_channels
        self.channels, whole = channels, whole.to(torch.bool)
        device = conv.weight.device

        def part(t, mask):
            return nn.Parameter(t.detach()[channels[mask].to(device)].clone(), requires_grad=t.requires_grad)

        self.split_weight = part(conv.weight, ~whole)
        self.whole_weight = part(conv.weight, whole) if whole.any() else None
        self.split_bias = part(conv.bias, ~whole) if conv.bias is not None else None
        self.whole_bias = part(conv.bias, whole) if conv.bias is not None and whole.any() else None
        # local channel i is row order[i] of cat([split, whole])
        positions = torch.cat([(~whole).nonzero().flatten(), whole.nonzero().flatten()])
        # a buffer stays real on a model built on meta (as transformers' own buffers do)
        real = device if device.type != "meta" else torch.device("cpu")
        self.register_buffer("order", torch.argsort(positions).to(real), persistent=False)
        self._keep_placements()

    def _local(self, split, whole):
        if whole is None:
            return split
        return torch.cat([split, whole])[self.order]

    @property
    def weight(self):
        return self._local(self.split_weight, self.whole_weight)

    @property
    def bias(self):
        return None if self.split_bias is None else self._local(self.split_bias, self.whole_bias)

    def forward(self, x):
        return nn.functional.conv1d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self):
        whole = 0 if self.whole_weight is None else self.whole_weight.shape[0]
        return (f"{self.in_channels} of {self.total_channels} channels ({whole} held by every rank), "
                f"kernel_size={self.kernel_size}, padding={self.padding}")  # fmt: skip
