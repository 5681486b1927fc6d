"""The candidate lifecycle (autogaudi/core/candidate.py), through channels_last on a clock the test moves:
its states as the trial runs and decides, a release that keeps nothing set up or referenced, and no
trial that would change the numbers unless asked for."""

import torch
from torch import nn

import autogaudi
from autogaudi.core.candidate import State
from autogaudi.core.status import Status
from autogaudi.entry import runtime
from tests.optimizations.test_channels_last import cnn
from tests.optimizations.test_step_profiler import STEPS


def run(step_clock, faster: bool, **options):
    autogaudi.enable(device="cpu", only="step_profiler,channels_last", **{"trial": "channels_last", **options})
    model = cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    nhwc, states = [], []
    model[0].register_forward_pre_hook(
        lambda _m, args: nhwc.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    for _ in range(STEPS + 40):
        nn.functional.cross_entropy(model(torch.randn(4, 3, 8, 8)), torch.randint(0, 4, (4,))).backward()
        step_clock.advance(0.001 if nhwc[-1] == faster else 0.002)
        optimizer.step()
        optimizer.zero_grad()
        unit = runtime._STATE.session.unit("channels_last")  # not asked for by name: loaded at the profile
        states.append(unit.candidate.state if unit is not None else State.WAITING)
    return unit, model, states


def test_a_candidate_goes_from_waiting_through_its_trial_to_on(step_clock):
    unit, model, states = run(step_clock, faster=True)
    assert states[0] is State.WAITING and State.TRIAL in states and states[-1] is State.ON
    assert [s for i, s in enumerate(states) if i == 0 or s is not states[i - 1]] == [
        State.WAITING,
        State.TRIAL,
        State.ON,
    ]
    assert unit.status() is Status.APPLIED and unit.candidate.model is model
    autogaudi.disable()
    assert unit.candidate.state is State.RELEASED and unit.candidate.model is None
    assert model[0].weight.is_contiguous()


def test_a_kept_candidates_headline_gives_its_trials_speedup_and_whose_trial_it_was(step_clock):
    unit, _model, _states = run(step_clock, faster=True)
    speedup = unit.report.figures["speedup"]
    [headline] = unit.changes()
    assert speedup > 1 and headline.endswith(f"{speedup}x per step in its trial")
    unit.report.figures["remembered_from_run"] = 7  # as a run that followed run 7's decision has it
    assert unit.changes()[0].endswith(f"{speedup}x per step in run 7's trial")
    del unit.report.figures["speedup"]  # kept without a trial (--force): no speedup to give
    assert "per step" not in unit.changes()[0]


def test_a_rejected_candidate_is_released_with_nothing_held(step_clock):
    unit, _model, states = run(step_clock, faster=False)
    candidate = unit.candidate
    assert states[-1] is State.RELEASED and not candidate.on
    assert candidate.scope is None and candidate.model is None and candidate.optimizer is None
    assert unit.changes() == [] and unit.status() is Status.NOT_NEEDED
    assert unit.report.reason.code == "rejected"


def test_under_the_defaults_a_candidate_that_changes_the_numbers_is_not_tried(step_clock):
    """Its trial would run the user's steps with it from a step the profile's timings set: a seeded
    run's numbers would move with the machine's load."""
    unit, _model, states = run(step_clock, faster=True, trial=())
    assert states[-1] is State.REFUSED and State.TRIAL not in states
    assert unit.report.reason.code == "changes_numbers" and unit.candidate.scope is None
    assert runtime._STATE.session.trials.records == []
