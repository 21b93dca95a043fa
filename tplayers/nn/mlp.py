"""`ParallelMLP`: the tensor-parallel feed-forward block, SwiGLU (Llama) or GeLU (GPT-2).

n = TP size, H = hidden_size, F = ffn_hidden_size, f = this rank's share of F (F/n, or as
torch.chunk splits an F that does not divide: `tplayers.placement.shard_sizes`). Built on the
column / row layers, so all communication (and its overlap with the GEMMs) is theirs:

    SwiGLU:  x (..., H) -> in_proj: ColumnParallelLinear(H, 2F), local weight (2f, H), rows
             alternating gate, up -> one GEMM whose epilogue gives h (..., f) = silu(gate) * up
             (tplayers/functional/swiglu.py) -> out_proj: RowParallelLinear(F, H) -> (..., H)
    GeLU:    x -> in_proj: ColumnParallelLinear(H, F) -> gelu -> out_proj: RowParallelLinear(F, H)

Fused gate|up layout. Rank r's in_proj weight interleaves its rows of gate_proj.weight and of
up_proj.weight row by row (bias likewise), so every GEMM output tile holds matching gate and up
columns and the shard is local and contiguous. Its placement is Shard(0) of a virtual
(2F, H) weight whose rows alternate gate, up (what concatenating the shards along dim 0 gives):
`fuse_gate_up` builds it from the unsharded pair, `unfuse_gate_up` maps it back, and
`ParallelMLP.unfused_shards()` gives each rank's slices in the unsharded gate / up / down layout.
With sequence_parallel=True, x and the output are (B, S/n, H), sharded along the sequence (or
(T/n, H), sharded along the tokens). On a 2-D mesh (`tplayers.nn.grid`) they are (B, S, H/c),
or (B, S/r, H/c) with sequence_parallel=True.
"""

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from tplayers.distributed import is_grid, resolve_group
from tplayers.functional.auto_overlap import check_overlap
from tplayers.functional.swiglu import column_parallel_swiglu
from tplayers.nn.grid import GridLinear
from tplayers.nn.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    _full_linear_init,
    autocast_operands,
    check_input,
    refuse_own_forward,
    tokens_as_sequence,
)
from tplayers.placement import SharesGroups

ACTIVATIONS = ("swiglu", "gelu", "gelu_tanh")


def fuse_gate_up(gate, up):
    """The unsharded (F, ...) gate / up weights (or biases) -> the (2F, ...) fused tensor whose rows
    alternate gate, up: row 2i is gate row i, row 2i+1 up row i. Rank r's fused shard is its slice
    in whole pairs (`own_slice(fused, 0, group, unit=2)`): its rows of each, interleaved."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    return torch.stack((gate, up), dim=1).flatten(0, 1)


def unfuse_gate_up(fused):
    """Inverse of `fuse_gate_up`: the (2F, ...) fused tensor (the shards concatenated) -> (gate, up)."""
    if fused.shape[0] % 2:
        raise ValueError(f"the fused gate|up tensor needs an even number of rows, got {fused.shape[0]}")
    return fused[0::2], fused[1::2]


def _weights(linear):
    return linear.weight.detach(), (linear.bias.detach() if linear.bias is not None else None)


class ParallelMLP(SharesGroups, nn.Module):
    """down(act(x W_in^T + b_in)) with W_in column-parallel and W_down row-parallel over `group`.

    activation="swiglu": Llama's down(silu(gate(x)) * up(x)), gate and up fused into one GEMM (see
    the module docstring for the shard layout); "gelu" (erf) / "gelu_tanh": GPT-2's
    proj(gelu(fc(x))). Input (..., H) replicated over the group, or (B, S/n, H) with
    sequence_parallel; output likewise, summed over the group. Weights are drawn as the unsharded
    nn.Linear modules would be (gate, up, down in Llama's order) under the same seed.
    """

    def __init__(
        self, hidden_size, ffn_hidden_size, *, activation="swiglu", bias=False, group=None,
        sequence_parallel=False, overlap="auto", device=None, dtype=None,
    ):  # fmt: skip
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"ParallelMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        # a 2-D mesh: in_proj / out_proj are a column-type / row-type GridLinear pair (tplayers.nn.grid)
        self.grid = is_grid(group)
        self.group = group if self.grid else resolve_group(group)
        self.tp_size = group.size() if self.grid else torch.distributed.get_world_size(self.group)
        self.hidden_size, self.ffn_hidden_size, self.activation = hidden_size, ffn_hidden_size, activation
        self.sequence_parallel = sequence_parallel
        gated = activation == "swiglu"
        kw = dict(sequence_parallel=sequence_parallel, overlap=check_overlap(overlap, "ParallelMLP"), dtype=dtype)
        in_features = 2 * ffn_hidden_size if gated else ffn_hidden_size
        # SwiGLU: the fused rows split in whole gate / up pairs, F as torch.chunk splits it
        if self.grid:
            self.in_proj = GridLinear(hidden_size, in_features, bias, mesh=group, out_axis="tp_r",
                                      out_unit=1 + gated, device="meta", **kw)  # fmt: skip
            self.out_proj = GridLinear(ffn_hidden_size, hidden_size, bias, mesh=group, out_axis="tp_c",
                                       device="meta", **kw)  # fmt: skip
        else:
            self.in_proj = ColumnParallelLinear(hidden_size, in_features, bias, group=self.group, device="meta",
                                                split_unit=1 + gated, **kw)  # fmt: skip
            self.out_proj = RowParallelLinear(ffn_hidden_size, hidden_size, bias, group=self.group, device="meta", **kw)
        if device is not None and torch.device(device).type == "meta":
            return
        full = [_full_linear_init(hidden_size, ffn_hidden_size, bias, device, dtype) for _ in range(1 + gated)]
        down = _full_linear_init(ffn_hidden_size, hidden_size, bias, device, dtype)
        self._set_full(full, down, device)

    def _set_full(self, in_weights, down, device):
        """Keep this rank's shards of the unsharded weights: `in_weights` is [(gate_w, gate_b),
        (up_w, up_b)] for SwiGLU, [(fc_w, fc_b)] for GeLU; `down` is (down_w, down_b)."""
        if len(in_weights) == 2:
            (gw, gb), (uw, ub) = in_weights
            weight, bias = fuse_gate_up(gw, uw), None
            if gb is not None:
                bias = fuse_gate_up(gb, ub)
        else:
            ((weight, bias),) = in_weights
        self.in_proj._set_shards(weight, bias, device)
        self.out_proj._set_shards(*down, device)

    @classmethod
    def _from_full(cls, in_linears, down, activation, *, group, device, dtype, **kwargs):
        ref = in_linears[0]
        for lin in (*in_linears, down):
            if not isinstance(lin, nn.Linear):
                raise TypeError(f"ParallelMLP: expected nn.Linear modules, got {type(lin).__name__}")
            refuse_own_forward(lin, nn.Linear, "ParallelMLP")
            if (lin.bias is None) != (ref.bias is None):
                raise ValueError("ParallelMLP: either every projection has a bias or none has")
        F, H = ref.weight.shape
        for lin in in_linears:
            if tuple(lin.weight.shape) != (F, H):
                raise ValueError(f"ParallelMLP: gate/up weights {tuple(lin.weight.shape)} and {(F, H)} differ")
        if tuple(down.weight.shape) != (H, F):
            raise ValueError(f"ParallelMLP: down weight must be {(H, F)}, got {tuple(down.weight.shape)}")
        dtype = dtype or ref.weight.dtype
        mlp = cls(
            H, F, activation=activation, bias=ref.bias is not None, group=group, device="meta", dtype=dtype,
            **kwargs,
        )  # fmt: skip
        cast = lambda wb: tuple(None if t is None else t.to(dtype) for t in wb)  # noqa: E731
        mlp._set_full([cast(_weights(lin)) for lin in in_linears], cast(_weights(down)), device or ref.weight.device)
        return mlp

    @classmethod
    def from_modules(cls, gate_proj, up_proj, down_proj, *, group=None, device=None, dtype=None, **kwargs):
        """The SwiGLU MLP holding this rank's slices of HF Llama's gate_proj (F, H), up_proj (F, H)
        and down_proj (H, F) nn.Linear modules (left unchanged)."""
        return cls._from_full(
            [gate_proj, up_proj], down_proj, "swiglu", group=group, device=device, dtype=dtype, **kwargs
        )

    @classmethod
    def from_linears(cls, fc, proj, *, activation="gelu_tanh", group=None, device=None, dtype=None, **kwargs):
        """The GeLU MLP holding this rank's slices of fc (F, H) and proj (H, F) nn.Linear modules."""
        if activation == "swiglu":
            raise ValueError("ParallelMLP.from_linears builds a GeLU MLP; use from_modules for SwiGLU")
        return cls._from_full([fc], proj, activation, group=group, device=device, dtype=dtype, **kwargs)

    def unfused_shards(self):
        """This rank's parameter slices in the unsharded modules' layout, as {name: (tensor, placement)}:
        names gate_proj / up_proj / down_proj (SwiGLU) or fc / proj (GeLU), each ".weight" / ".bias".
        Tensors are detached views of the parameters; concatenating each over the group along its
        Shard dim (or taking any rank's copy for Replicate) gives the unsharded tensor."""
        w, b = self.in_proj.weight.detach(), self.in_proj.bias
        out = {}
        if self.activation == "swiglu":
            for i, name in enumerate(("gate_proj", "up_proj")):  # rows alternate gate, up
                out[f"{name}.weight"] = (w[i::2], Shard(0))
                if b is not None:
                    out[f"{name}.bias"] = (b.detach()[i::2], Shard(0))
            down = "down_proj"
        else:
            out["fc.weight"] = (w, Shard(0))
            if b is not None:
                out["fc.bias"] = (b.detach(), Shard(0))
            down = "proj"
        out[f"{down}.weight"] = (self.out_proj.weight.detach(), Shard(1))
        if self.out_proj.bias is not None:
            out[f"{down}.bias"] = (self.out_proj.bias.detach(), Replicate())
        return out

    @tokens_as_sequence
    def forward(self, x):
        if self.grid:  # the gate / up pairs interleave in each rank's rows (tp_r's share of them)
            h = self.in_proj(x)
            if self.activation == "swiglu":
                h = nn.functional.silu(h[..., 0::2]) * h[..., 1::2]
            else:
                h = nn.functional.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
            return self.out_proj(h)
        if self.activation == "swiglu":  # the SwiGLU runs in the gate|up GEMM's epilogue
            layer = self.in_proj
            x, weight, bias = autocast_operands(layer, x)
            check_input(layer, x, layer.in_features, layer.sequence_parallel, weight)  # before any collective
            h = column_parallel_swiglu(
                x, weight, bias, layer.group, sequence_parallel=layer.sequence_parallel,
                overlap=layer.overlap, widest=layer.widest,
            )  # fmt: skip
        else:
            h = nn.functional.gelu(self.in_proj(x), approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.out_proj(h)

    def extra_repr(self):
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size} "
            f"({self.out_proj.in_features_per_rank} on this rank of {self.tp_size}), activation={self.activation!r}"
        )
