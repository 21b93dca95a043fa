"""`count_ops()`: the torch ops a block runs, as a GPU would launch them.

    with count_ops() as ops:
        model(ids, labels=ids).loss.backward()
    ops.launches   # ops that run a kernel (views, reshapes and other metadata ops left out)
    ops.syncs      # ops that make the host wait for the device (.item(), bool(), nonzero)
    ops.by_name    # Counter of every op, by name

Counted on CPU tensors with the same dispatcher a CUDA run goes through, so the per-step and
per-layer counts are a device-free measure of launch overhead (the backward's ops included:
autograd runs them through the same dispatcher).
"""

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# Ops that only make another view of the same storage or read metadata: no kernel on a GPU.
METADATA = frozenset({
    "view", "_unsafe_view", "reshape", "slice", "select", "unsqueeze", "squeeze", "t", "transpose", "permute",
    "expand", "as_strided", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk", "narrow",
    "view_as", "_reshape_alias", "lift_fresh", "diagonal", "unflatten", "flatten", "movedim", "split_tensor",
    "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "promote_types", "is_same_size",
    "_to_copy_noop", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous", "dim", "size",
    "stride", "_has_compatible_shallow_copy_type", "_local_scalar_dense_noop", "result_type",
})  # fmt: skip
# Ops whose result the host reads: each one waits for the device to finish everything queued.
SYNCS = frozenset({"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"})


class count_ops(TorchDispatchMode):
    """A context counting the ops run inside it (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.by_name = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_name[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        return sum(n for name, n in self.by_name.items() if name not in METADATA)

    @property
    def syncs(self) -> int:
        return sum(n for name, n in self.by_name.items() if name in SYNCS)
