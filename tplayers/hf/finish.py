"""The closing steps every parallelize takes, whichever layout it sharded (`parallelize` on a 1-D
group, `parallelize_grid` on a 2-D mesh, `parallelize_peft` around peft's adapters): the model's
State (`tplayers.state`: its export records, its keys before, its tied weights, the group its
sequence is split over), its placement records sealed, the self-check against the unsharded
probe, failures named, the user's frozen parameters kept frozen, and the same-inputs check armed
for the user's first forward."""

from __future__ import annotations

from tplayers.hf import verify as verification
from tplayers.hf.frozen import keep_frozen
from tplayers.hf.same_inputs import check_same_inputs
from tplayers.placement import seal
from tplayers.state import set_state


def finish(
    model, probe, *, group, exports, original_keys, tied, sequence_group, vocab_parallel=False,
    expert_group=None, inputs_checked_on=None, inputs_group=None, trainable=None,
):  # fmt: skip
    """Finish `model`'s parallelize. `probe`: what `verification.before` took of the unsharded model;
    `group`: the group the self-check gathers over; `inputs_checked_on` / `inputs_group`: the module
    whose inputs are compared across `inputs_group` (default: the model over `group`; a group of
    None re-arms the check already installed); `trainable`: the unsharded parameters' requires_grad
    (`tplayers.hf.frozen.trainable_flags`), given to the parameters the records hold."""
    if trainable is not None:
        keep_frozen(trainable, exports)
    set_state(model, exports=exports, original_keys=tuple(original_keys), tied=dict(tied),
              sequence_group=sequence_group)  # fmt: skip
    seal(model)
    verification.after(probe, model, group=group, vocab_parallel=vocab_parallel, expert_group=expert_group)
    verification.name_failures(model)
    if inputs_checked_on is None:
        check_same_inputs(model, group)  # armed after the self-check: the user's first forward is checked
    else:
        check_same_inputs(inputs_checked_on, inputs_group)
    return model
