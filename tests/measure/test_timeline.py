"""autogaudi's start, counted once: each session of a process reports the start not already reported."""

import torch

import autogaudi
from autogaudi.entry import runtime
from autogaudi.measure import timeline


def test_a_session_enabled_again_counts_its_own_start_not_the_first_ones(monkeypatch):
    autogaudi.enable(device="cpu", only="throughput_meter")
    timeline.add_start_up(5.0)  # as if the first session's start had taken 5 s
    first = runtime._STATE.session.steps.timeline
    autogaudi.disable()
    assert first.start_up_s >= 5.0
    autogaudi.enable(device="cpu", only="throughput_meter")
    torch.ones(1)
    second = runtime._STATE.session.steps.timeline
    try:
        assert second.start_up_s < 5.0
        before = first.start_up_s
        timeline.add_start_up(1.0)
        assert first.start_up_s == before  # a later start is not the ended session's
    finally:
        autogaudi.disable()
