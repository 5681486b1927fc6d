"""activation_checkpointing: under a --memory-limit of 60% of the test GPT's measured peak, the fewest
blocks are checkpointed from the second step, the step's peak comes under the limit as forecast, and
the losses are plain's bitwise; a step that fits, a model without repeated blocks and disable() are
left as they were."""

import pytest
import torch

import autogaudi
from autogaudi.backends.base import GB
from autogaudi.optimizations.activation_checkpointing import repeated_blocks
from autogaudi.watch import model_call
from tests.gpt_model import TinyGPT, train

ONLY = "step_profiler,activation_checkpointing"  # no unit that rounds otherwise


@pytest.fixture(scope="module")
def measured_peak():
    """The test GPT's step peak without checkpointing, as the step memory measures it."""
    autogaudi.enable(device="cpu", memory_limit=1.0, only=ONLY)
    try:
        train(steps=3)
        return autogaudi.report().as_dict()["memory"]["peak_bytes"]
    finally:
        autogaudi.disable()


def unit_row():
    return autogaudi.report().unit("activation_checkpointing")


def test_under_60_percent_of_its_peak_the_gpt_trains_as_plain_with_blocks_checkpointed(measured_peak):
    plain, _ = train()
    limit = 0.6 * measured_peak
    autogaudi.enable(device="cpu", memory_limit=limit / GB, only=ONLY)
    losses, model = train()
    row, memory = unit_row(), autogaudi.report().as_dict()["memory"]
    assert losses == plain  # bitwise: the recomputation draws the same dropout masks
    assert row["status"] == "applied" and row["reason_code"] == "checkpointed"
    assert row["reason_params"]["step"] == 1  # the first step measured, as the script wrote it
    blocks = row["figures"]["blocks_checkpointed"]
    assert blocks and set(blocks) <= {f"blocks.{index}" for index in range(len(model.blocks))}
    assert memory["predicted_peak_bytes"] <= limit
    assert memory["peak_bytes"] <= limit
    assert abs(memory["predicted_peak_bytes"] - memory["peak_bytes"]) <= 0.1 * memory["peak_bytes"]
    assert row["figures"]["forecast_peak_bytes_plain"] > limit
    assert row["figures"]["recompute_ms_per_step"] > 0
    assert row["numerics"] == []
    fewer = blocks[:-1]  # one block fewer would not have been enough
    assert not fewer or row["figures"]["forecast_peak_bytes"] <= limit
    autogaudi.disable()
    assert all(model_call.route_of(block) is None for block in model.blocks)


def test_a_step_that_fits_is_left_alone():
    autogaudi.enable(device="cpu", memory_limit=1.0, only=ONLY)
    _, model = train(steps=2)
    row = unit_row()
    assert row["status"] == "not needed" and row["reason_code"] == "fits"
    assert all(model_call.route_of(block) is None for block in model.blocks)


def test_without_a_budget_it_is_not_needed():
    autogaudi.enable(device="cpu", only=ONLY)
    train(steps=2)
    assert unit_row()["reason_code"] == "no_budget"
    assert unit_row()["status"] == "not needed"


def test_a_model_without_repeated_blocks_is_left_alone():
    autogaudi.enable(device="cpu", memory_limit=1e-6, only=ONLY)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert unit_row()["reason_code"] == "no_blocks"


def test_the_blocks_are_the_largest_list_of_one_class():
    assert repeated_blocks(TinyGPT(blocks=3)) == ("blocks", ("blocks.0", "blocks.1", "blocks.2"))
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    assert repeated_blocks(mixed) == ("", ())


def test_the_checkpointed_model_saves_and_copies_as_a_plain_one(measured_peak):
    import copy
    import pickle

    autogaudi.enable(device="cpu", memory_limit=0.6 * measured_peak / GB, only=ONLY)
    _, model = train(steps=2)
    assert unit_row()["figures"]["blocks_checkpointed"]
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all("_compiled_call_impl" not in vars(sub) for sub in twin.modules())
    assert b"autogaudi" not in pickle.dumps(model)
