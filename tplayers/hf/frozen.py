"""What the user froze stays frozen. The sharding pass builds new parameters for the modules it
replaces; each takes the `requires_grad` of the HF parameters it holds (by the export records'
pieces), so a frozen embedding, a frozen vision tower, peft's frozen base under prompt tuning or
BitFit's frozen weights are not trained after `parallelize` (before, every replaced parameter came
back trainable, and the optimizer updated what the user had frozen, silently)."""

from torch import nn


def trainable_flags(model) -> dict[str, bool]:
    """Each parameter's requires_grad, by its name (every name of a tied one)."""
    return {name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)}


def split_where_mixed(model) -> frozenset[str]:
    """Linear siblings (a gated MLP's gate_proj / up_proj) frozen apart: the sharding pass must not
    fuse them into one parameter, which could not be half frozen."""
    mixed = set()
    for name, parent in model.named_modules():
        linears = {child: m for child, m in parent.named_children() if isinstance(m, nn.Linear)}
        flags = {(m.weight.requires_grad, m.bias is None or m.bias.requires_grad) for m in linears.values()}
        if len(flags) > 1:
            mixed.update(f"{name}.{child}" if name else child for child in linears)
    return frozenset(mixed)


def keep_frozen(flags: dict[str, bool], exports) -> None:
    """Give each parameter the export records hold the requires_grad of the HF parameters it holds
    (`flags`: `trainable_flags` of the model before sharding, under the records' names)."""
    held = {}
    for record in exports:
        for piece in record.pieces():
            key = f"{record.prefix}.{piece.key}"
            if key in flags:
                held.setdefault(id(piece.param), (piece.param, {}))[1][key] = flags[key]
    for param, keys in held.values():
        if len(set(keys.values())) > 1:
            frozen = sorted(k for k, trainable in keys.items() if not trainable)
            raise ValueError(
                f"parallelize: {sorted(keys)} are held in one parameter, but only {frozen} are frozen; freeze them "
                "alike"
            )
        param.requires_grad_(next(iter(keys.values())))
