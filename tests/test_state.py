"""`tplayers.state`: one frozen State per object under one attribute, read with `state_of` and
replaced with `set_state`; how it travels through copies and peft-style wrappers."""

import copy
import pickle

import pytest
import torch
from torch import nn

from tplayers.state import EMPTY, SLOT, State, set_state, state_of


def test_an_object_without_state_reads_the_empty_one():
    for obj in (nn.Linear(2, 2), torch.zeros(1), nn.Parameter(torch.zeros(1)), lambda: None, object()):
        assert state_of(obj) is EMPTY


def test_set_state_replaces_the_frozen_state_and_keeps_the_other_fields():
    module = nn.Linear(2, 2)
    first = set_state(module, tied_across_stages=True)
    second = set_state(module, weight_map=(0, torch.arange(2)))
    assert first is not second and not first.weight_map  # the first was never changed
    assert state_of(module).tied_across_stages and state_of(module).weight_map[0] == 0
    with pytest.raises(AttributeError):
        state_of(module).tied_across_stages = False  # frozen
    assert [k for k in vars(module) if k.startswith("_tplayers")] == [SLOT]


def test_two_tensors_sharing_a_state_after_a_shallow_copy_do_not_see_each_others_changes():
    """A meta parameter materialised copies the old one's `__dict__` (tplayers.checkpoint.hf)."""
    old, new = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.ones(2))
    set_state(old, has_master=True)
    new.__dict__.update(old.__dict__)
    set_state(new, has_master=False)
    assert state_of(old).has_master and not state_of(new).has_master


def test_deep_copies_and_pickles_carry_their_own_state():
    """A module's State goes with its deep copy (a Parameter's does not: torch's Parameter deep copy
    drops its attributes, which is why placement records are kept by the modules too)."""
    model = nn.Sequential(nn.Linear(2, 2))
    set_state(model, original_keys=("0.weight", "0.bias"))
    set_state(model[0], tied_across_stages=True)
    twin = copy.deepcopy(model)
    assert state_of(twin).original_keys == ("0.weight", "0.bias") and state_of(twin[0]).tied_across_stages
    set_state(twin, original_keys=())
    assert state_of(model).original_keys == ("0.weight", "0.bias")
    back = pickle.loads(pickle.dumps(model))
    assert state_of(back) == state_of(model)


class Wrapper(nn.Module):
    """Forwards the attributes it lacks to the model inside, as peft's PeftModel does."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


def test_a_forwarding_wrapper_reads_the_wrapped_models_state_until_it_has_its_own():
    inner = nn.Linear(2, 2)
    set_state(inner, sequence_group="tp", exports=["inner's"])
    wrapper = Wrapper(inner)
    assert state_of(wrapper) is state_of(inner)
    set_state(wrapper, exports=["wrapper's"])
    assert state_of(wrapper).sequence_group == "tp" and state_of(wrapper).exports == ["wrapper's"]
    assert state_of(inner).exports == ["inner's"]


def test_negative_control_a_field_state_does_not_declare_is_refused():
    with pytest.raises(TypeError):
        set_state(nn.Linear(2, 2), placment=None)  # a misspelt field never becomes a silent attribute
    assert State() == EMPTY
