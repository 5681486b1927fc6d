"""The one clock every measurement of the user's steps reads: step boundaries, batch waits, a
trial's arms, a fused update timed on copies, the step profile's census.

Why one: a trial's arms and the step times the profiler and the units read are set against each
other, so they must come from one source; and a test decides them all on given times by replacing
:func:`now` alone (the ``step_clock`` fixture), never by sleeping.
"""

import time


def now() -> float:
    """Seconds, monotonic (``time.perf_counter``)."""
    return time.perf_counter()
