"""Every state of a decision's lifecycle (:class:`autogaudi.core.candidate.State`), reached by a script
and asserted as the unit's report row shows it (its status and reason code) and by what is on the
script's model. Trials are decided by the test (the contract matrix's fixtures) on the clock it moves,
so each case reaches its state whatever the machine's load."""

import sys

import pytest
import torch
from torch import nn

import autogaudi
from autogaudi.core.candidate import State
from autogaudi.entry import runtime
from autogaudi.watch import model_call
from tests.test_contract_matrix import MAX_STEPS, Training, decided_trials  # noqa: F401

TRIAL = {"only": "step_profiler,channels_last", "trial": "channels_last"}


def row(name="channels_last"):
    return autogaudi.report().unit(name)


def trained_until(reached, clock, training=None):
    """The script's training (``training``, or the contract matrix's), stepped until ``reached()``."""
    training = Training() if training is None else training
    while not reached():
        assert training.steps < MAX_STEPS, row()
        training.step()
        clock.advance(0.001)
    return training


class NoConvolution(Training):
    """The script with a model channels_last has nothing to do on: no 2-D convolution."""

    def __init__(self):
        super().__init__()
        self.model = self.inner = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=5, gamma=0.5)


def waiting(clock, **_):
    autogaudi.enable(device="cpu", **TRIAL)
    return Training()  # built; no step yet, so no profile


def checking(clock, **_):
    autogaudi.enable(device="cpu", only="step_profiler,mixed_precision", precision="auto")
    return trained_until(lambda: row("mixed_precision")["reason_code"] == "checking", clock)


def trial(clock, **_):
    autogaudi.enable(device="cpu", **TRIAL)
    return trained_until(lambda: row()["reason_code"] == "trial_running", clock)


def decided(clock, keep, decision, **options):
    keep["keep"] = decision == "kept"
    autogaudi.enable(device="cpu", **TRIAL, **options)
    return trained_until(lambda: bool(autogaudi.report().trials), clock)


def following(clock, keep, monkeypatch, tmp_path):
    """A second run of the same script, model and inputs, the first's kept decision in the cache:
    it is on at once, and this run's steps are checked against the trial's time meanwhile."""
    monkeypatch.setenv("AUTOGAUDI_NO_CACHE", "0")
    # decisions are remembered per script file: pytest's is one, an xdist worker's __main__ has none
    monkeypatch.setattr(sys.modules["__main__"], "__file__", __file__, raising=False)
    cache = {"cache_dir": str(tmp_path / "cache")}
    decided(clock, keep, "kept", **cache)
    autogaudi.disable()
    autogaudi.enable(device="cpu", **TRIAL, **cache)
    return trained_until(lambda: row()["reason_code"] == "remembered", clock)


def refused(clock, **_):
    autogaudi.enable(device="cpu", **TRIAL)
    return trained_until(lambda: row()["status"] != "watching", clock, NoConvolution())


def failed(clock, **_):
    autogaudi.enable(device="cpu", only="step_profiler,channels_last", force="channels_last")
    training = trained_until(lambda: row()["status"] == "applied", clock)
    runtime._STATE.session.unit("channels_last").failed_at_run_time(RuntimeError("what the guard reports"))
    return training


# state -> (how a script reaches it, the unit, its row's status and reason code (None: any), whether
# anything of the unit's is on the model: None where it may be either)
CASES = {
    State.WAITING: (waiting, "channels_last", "watching", "waiting_for_profile", False),
    State.CHECKING: (checking, "mixed_precision", "deciding", "checking", None),
    State.TRIAL: (trial, "channels_last", "deciding", "trial_running", None),
    State.FOLLOWING: (following, "channels_last", "deciding", "remembered", True),
    State.ON: (
        lambda clock, keep, **_: decided(clock, keep, "kept"),
        "channels_last",
        "applied",
        "measured_faster",
        True,
    ),
    State.RELEASED: (
        lambda clock, keep, **_: decided(clock, keep, "rejected"),
        "channels_last",
        "not needed",
        "rejected",
        False,
    ),
    State.REFUSED: (refused, "channels_last", "not needed", "no_conv2d", False),
    State.FAILED: (failed, "channels_last", "failed", None, False),
}


def test_every_state_has_a_case():
    assert set(CASES) == set(State)


@pytest.mark.parametrize("state", list(CASES), ids=[state.value for state in CASES])
def test_a_script_reaches_the_state_and_the_report_says_so(
    state,
    monkeypatch,
    tmp_path,
    decided_trials,  # noqa: F811
    step_clock,
):
    reach, unit, status, code, on_model = CASES[state]
    training = reach(step_clock, keep=decided_trials, monkeypatch=monkeypatch, tmp_path=tmp_path)
    reached = row(unit)
    assert reached["status"] == status and code in (None, reached["reason_code"]), reached
    if on_model is not None:
        assert (model_call.route_of(training.inner) is not None) is on_model, reached
