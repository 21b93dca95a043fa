"""`logits_of`: the logits of a model's forward, also where it computed its loss without them.

A parallelized causal LM in train mode given `labels=` scores them with the fused LM-head loss and
returns `logits=None` (`tplayers.hf.fused_loss`); a test that compares logits too runs the same
forward again without labels, without gradient, for them.
"""

import torch


def logits_of(model, out, *args, **kwargs):
    """`out.logits`, else those of `model(*args, **kwargs)` with `labels` dropped (no gradient)."""
    if out.logits is not None:
        return out.logits
    with torch.no_grad():
        return model(*args, **{k: v for k, v in kwargs.items() if k not in ("labels", "num_items_in_batch")}).logits
