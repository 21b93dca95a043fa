"""Which GEMM implementation runs: the Triton kernel or its pure-torch reference.

`set_backend("auto" | "triton" | "torch")`, or env `TPLAYERS_BACKEND`. `auto` picks Triton for
CUDA tensors and the reference otherwise. The kernel module is imported only when Triton is
chosen, so `import tplayers` never imports triton.
"""

import os

BACKENDS = ("auto", "triton", "torch")
_backend = os.environ.get("TPLAYERS_BACKEND", "auto")


def set_backend(name: str) -> None:
    """Select the GEMM backend for every tplayers layer in this process."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    if _backend not in BACKENDS:
        raise ValueError(f"TPLAYERS_BACKEND must be one of {BACKENDS}, got {_backend!r}")
    return _backend


def uses_triton(tensor) -> bool:
    backend = get_backend()
    return backend == "triton" or (backend == "auto" and tensor.is_cuda)


def gemm(a, b, **epilogue):
    """`matmul(a, b, **epilogue)` on the selected backend (see kernels/matmul.py for the contract)."""
    if uses_triton(a):
        from tplayers.kernels.matmul import matmul
    else:  # the reference module does not import triton
        from tplayers.kernels.matmul_ref import matmul_ref as matmul
    return matmul(a, b, **epilogue)


def unscale_and_stats_(tensors, inv_scale):
    """`unscale_and_stats_` (kernels/grad_stats.py) on the selected backend: multiplies `tensors`
    in place by `inv_scale` (None: no write) and returns per tensor [sum |g|, sum g^2, max |g|]
    (fp32, (len(tensors), 3)) and the found-inf flag (fp32, (1,))."""
    if tensors and uses_triton(tensors[0]):
        from tplayers.kernels.grad_stats import unscale_and_stats_ as fused
    else:
        from tplayers.kernels.grad_stats_ref import unscale_and_stats_ref as fused
    return fused(tensors, inv_scale)
