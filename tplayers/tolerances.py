"""The one per-dtype tolerance table (see `tplayers.testing.numerics` for why these values).

A foundation, so that `parallelize(verify=...)` and the test helpers compare with the same table.
"""

import torch

TOLERANCES = {
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=6e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=5e-2),
}


def tolerance(dtype: torch.dtype, *, exact: bool = False) -> dict:
    """rtol / atol for a reference of `dtype` (zero for exact comparisons)."""
    if exact:
        return dict(rtol=0.0, atol=0.0)
    return TOLERANCES[dtype]


# A result past the table is fp32 rounding the model amplifies (Gemma 4 at random init, RWKV), not a
# wrong shard, where it is within this factor as far from the fp64 result as the unsharded fp32 one is
# (a second fp32 computation, its sums in another order, was seen up to 3x as far; a wrong shard is off by
# the size of the result): the self-check's fp64 arbiter (tplayers.hf.verify) and the test helper
# `assert_close_or_rounding`
ARBITER_FACTOR = 4
