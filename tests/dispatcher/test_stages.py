"""The stages of a dispatch and the dispatcher's value of the dispatch in flight are frozen:
a step returns a new value, nothing writes into one (docs/DESIGN.md, "State")."""

import dataclasses

import pytest
import torch

from megatron_moe_ext.dispatcher.common import stages
from megatron_moe_ext.dispatcher.hybridep.manager import DenseRouting

T = torch.zeros(2, 2)
VALUES = [
    stages.TopKRouting(T, T),
    DenseRouting(T.bool(), T),
    stages.Dispatched(None, T, T, [1, 1]),
    stages.FixedDispatched(None, T, T, T, 2, 4, None),
    stages.Permuted(None, [1, 1], T),
    stages.FixedPermuted(None, T, T, 4, T),
    stages.InFlight(stages.Step.TOKEN_DISPATCH, stages.TopKRouting(T, T), torch.Size([2, 2]), False, False),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_every_field_of_a_stage_is_frozen(value):
    for field in dataclasses.fields(value):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field.name, None)


def test_a_step_replaces_the_value():
    """What the dispatcher does at each step (and Megatron's hooks through it): a new value."""
    flight = VALUES[-1]
    moved = dataclasses.replace(flight, next=stages.Step.DISPATCH_POSTPROCESS, num_rows=3)
    assert (flight.next, flight.num_rows) == (stages.Step.TOKEN_DISPATCH, None)
    assert (moved.next, moved.num_rows, moved.stage) == (stages.Step.DISPATCH_POSTPROCESS, 3, flight.stage)
