"""How much slower this process runs now than on an idle machine: what other processes take of the
cores it may use.

Why: a compile's one-off is estimated from what compiles took on this machine, and step times are
compared with what an earlier run measured; both move with the load (a capture estimated at 8 s
took 60-100 s beside six to nine runnable processes on two cores). The load average counts every
runnable process, this one included; the rest share the cores with it.
"""

from __future__ import annotations

import os


def physical_cores() -> int:
    """The machine's physical cores (its logical ones where that is not known)."""
    import psutil  # not at start: about 7 ms of every run's start-up, where no core count is asked

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def slowdown() -> float:
    """The factor by which work that keeps one core busy (a compile, a step) runs slower now than on
    the idle machine: 1.0 while this process and the others fit on the usable cores, else their
    count over the cores. Read from the last minute's load average; 1.0 where none is known."""
    try:
        runnable = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 1.0
    return round(max(1.0, runnable / usable_cores()), 2)  # this process is one of the runnable
