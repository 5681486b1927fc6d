"""``python steady_trial_steps.py ARGS`` runs ``python -m autogaudi ARGS`` on a clock that reads the
training step's number, so that every training step lasts ``STEP_S`` and nothing inside one takes any
time: tests of remembered decisions know what a check finds (it matches the step time its trial
measured) and what a trial decides (rejected: no arm is faster), whatever the machine's load. The
script (a torch training script) and the report are real."""

import runpy
import sys

from autogaudi.entry import runtime
from autogaudi.measure import clock

STEP_S = 0.01


def steady_clock() -> float:
    """``STEP_S`` for each training step the session has counted (0 before it starts)."""
    session = runtime._STATE.session
    return 0.0 if session is None else STEP_S * session.steps.steps


clock.now = steady_clock
sys.argv = ["autogaudi", *sys.argv[1:]]
runpy.run_module("autogaudi", run_name="__main__", alter_sys=True)
