"""``python steady_trial_steps.py ARGS`` runs ``python -m autogaudi ARGS`` with trials that time every
step at the same length, so that tests of remembered decisions know what a check finds (it matches the
step time its trial measured) and what a trial decides (rejected: no arm is faster), whatever the
machine's load. Only the trials' clock is steady: the script, the profile and the report are real."""

import runpy
import sys

from autogaudi.measure import trials

STEP_S = 0.01


def steady_clock() -> float:
    """Each reading is one step later than the last: every timed step lasts ``STEP_S``."""
    steady_clock.now += STEP_S
    return steady_clock.now


steady_clock.now = 0.0
trials.clock = steady_clock
sys.argv = ["autogaudi", *sys.argv[1:]]
runpy.run_module("autogaudi", run_name="__main__", alter_sys=True)
