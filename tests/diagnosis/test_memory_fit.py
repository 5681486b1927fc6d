"""The doctor's memory projection: the observed step's forecast peak on named devices, the largest
batch that fits each (with and without the blocks checkpointed), and a finding with its levers
where the observed batch does not fit a device."""

import pytest

from autogaudi.diagnosis import memory_fit
from tests.diagnosis.test_command import diagnose, only


def test_the_projection_names_each_device_and_the_largest_batch_that_fits_it():
    diagnosis = diagnose("gpt_memory.py", steps=3)
    projected = diagnosis.figures["memory"]
    assert projected["batch"] == 16 and projected["blocks"] == 4 and projected["optimizer"] == "AdamW"
    assert projected["per_sample_bytes"] > 0 and projected["checkpointed_peak_bytes"] < projected["peak_bytes"]
    assert {"Gaudi2", "Gaudi3", "H100", "this machine"} <= set(projected["devices"])
    h100, gaudi3 = projected["devices"]["H100"], projected["devices"]["Gaudi3"]
    assert h100["fits"] and h100["largest_batch"] > 16
    assert gaudi3["largest_batch"] > h100["largest_batch"]
    assert h100["largest_batch_checkpointed"] > h100["largest_batch"]
    assert only(diagnosis, "memory") == []  # it fits everywhere: advice, no finding


@pytest.fixture
def small_device(monkeypatch):
    """A device holding 60% of the test GPT's step peak at batch 16 (over 0.9, the plannable share)."""
    plain = diagnose("gpt_memory.py", steps=3).figures["memory"]
    monkeypatch.setattr(memory_fit, "DEVICES", {"small": int(0.6 * plain["peak_bytes"] / 0.9)})
    return plain


def test_a_step_that_does_not_fit_a_device_is_a_finding_with_its_levers(small_device):
    diagnosis = diagnose("gpt_memory.py", steps=3)
    (finding,) = only(diagnosis, "memory")
    assert finding.severity == "high" and finding.fixed_by == "activation_checkpointing"
    assert finding.evidence["largest_batch_small"] < 16
    row = diagnosis.figures["memory"]["devices"]["small"]
    assert not row["fits"] and row["largest_batch_checkpointed"] >= 16
    assert diagnosis.figures["memory"]["eight_bit_optimizer_saves_bytes"] > 0
