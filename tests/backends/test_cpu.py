"""The CPU backend starts inductor's vector-instruction check beside the trace, leaving its result
torch's own; an error in it stays in its thread (torch raises it again where it calls the check)."""

import threading

import pytest
from torch import nn

from autogaudi.backends.cpu import CpuBackend

CAPTURES = {
    "whole": lambda backend: backend.graph_forward(nn.Linear(4, 4)),
    "regional": lambda backend: backend.graph_blocks(),
}


@pytest.fixture
def checks(monkeypatch):
    """The threads that called inductor's check (stubbed), once each has ended."""
    from torch._inductor import cpu_vec_isa

    threads, called = [], threading.Event()

    def valid_vec_isa_list():
        threads.append(threading.current_thread())
        called.set()
        if getattr(valid_vec_isa_list, "fail", False):
            raise RuntimeError("no compiler")
        return []

    def ended():
        assert called.wait(timeout=30)
        for thread in threads:
            thread.join(timeout=30)
        return [thread.name for thread in threads]

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", valid_vec_isa_list)
    return valid_vec_isa_list, ended


@pytest.mark.parametrize("tier", list(CAPTURES))
def test_the_vector_isa_check_starts_in_a_thread_of_its_own_when_capture_is_set_up(checks, tier):
    _, ended = checks
    CAPTURES[tier](CpuBackend("test"))
    assert ended() == ["autogaudi-vec-isa"]


def test_an_error_in_the_check_stays_in_its_thread(checks, monkeypatch):
    check, ended = checks
    check.fail = True
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    compiled = CpuBackend("test").graph_blocks()
    assert ended() == ["autogaudi-vec-isa"] and raised == []
    assert callable(compiled)
