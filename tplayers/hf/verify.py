"""`parallelize(verify=...)`: the self-check that the sharded model computes what the full one did.

Before sharding, the full model runs on a small fixed batch (eval mode, no gradients, the same
token ids on every rank from a fixed seed); after sharding, the sharded model runs on the same
batch and its logits are compared with the one tolerance table. The verdict is agreed over the
group (one tiny all-reduce), so every rank raises, or none does.
"""

import torch
from torch import nn

from tplayers.functional.collectives import all_gather_any, all_gather_dim
from tplayers.tolerances import tolerance

PROBE_BATCH = 2
PROBE_TOKENS_PER_RANK = 4  # a multiple of the TP size, so sequence parallelism can split it


class VerifyError(RuntimeError):
    """The sharded model's logits differ from the unsharded model's beyond the tolerance table."""


def _token_model(model) -> bool:
    """An HF-style model: a config and an nn.Embedding input embedding to draw token ids for."""
    get = getattr(model, "get_input_embeddings", None)
    return getattr(model, "config", None) is not None and callable(get) and isinstance(get(), nn.Embedding)


def probe_input(model, verify, n):
    """The batch to verify with, or None where the check is off.

    verify: None (default) checks whenever every weight is materialised (not on the meta
    device) and the model takes token ids; True insists; False turns it off; a tensor is the
    input itself (the same on every rank)."""
    if verify is False:
        return None
    if isinstance(verify, torch.Tensor):
        return verify
    if verify is not None and verify is not True:
        raise TypeError(f"parallelize: verify must be None, True, False or an input tensor, got {type(verify)}")
    materialised = not any(p.is_meta for p in model.parameters())
    if not (materialised and _token_model(model)):
        if verify is None:
            return None
        why = "its weights are on the meta device" if not materialised else "it has no token-id input embedding"
        raise ValueError(f"parallelize(verify=True): cannot run the self-check: {why}; pass verify=<input tensor>")
    emb = model.get_input_embeddings()
    config = model.config
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq = PROBE_TOKENS_PER_RANK * n
    if max_positions and seq > max_positions:
        seq = max(n, max_positions // n * n)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, emb.num_embeddings, (PROBE_BATCH, seq), generator=generator)
    return ids.to(emb.weight.device)


def logits(model, ids):
    """The model's logits for `ids` in eval mode without gradients; training flags restored."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            kwargs = {"use_cache": False} if getattr(model, "config", None) is not None else {}
            out = model(ids, **kwargs)
    finally:
        for m, mode in modes.items():
            m.training = mode
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, tuple | list) else out


def check(reference, sharded, *, group, vocab_parallel):
    """Raise VerifyError on every rank if any rank's sharded logits differ from the reference."""
    if vocab_parallel:
        sharded = all_gather_any(sharded.contiguous(), sharded.dim() - 1, group)  # any vocabulary
    tol = tolerance(reference.dtype)
    if sharded.shape != reference.shape:
        excess = torch.tensor([float("inf")])
    else:
        diff = (sharded.float() - reference.float()).abs()
        allowed = tol["atol"] + tol["rtol"] * reference.float().abs()
        excess = (diff - allowed).max().reshape(1).cpu()
        excess = torch.where(torch.isnan(excess), torch.tensor([float("inf")]), excess)
    worst = all_gather_dim(excess, 0, group).amax()  # MAX over the group (comm has no MAX all-reduce)
    if worst.item() > 0:
        largest = (sharded.float() - reference.float()).abs().max().item() if sharded.shape == reference.shape else None
        raise VerifyError(
            "parallelize(verify): the sharded model's logits differ from the unsharded model's on the probe batch "
            f"beyond the tolerance for {reference.dtype} (rtol {tol['rtol']}, atol {tol['atol']}): "
            f"largest excess over the tolerance {worst.item():.3g} (this rank's largest |difference|: {largest}, "
            f"shapes {tuple(sharded.shape)} vs {tuple(reference.shape)}). Either a module was sharded wrongly or the "
            "full model was not the same on every rank. The model was sharded in place and is not usable; "
            "parallelize(verify=False) skips this check"
        )
