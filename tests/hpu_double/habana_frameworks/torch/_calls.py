"""Not part of the real bridge: the double's record of every bridge call, for the tests."""

import time

CALLS = []
MEMORY = {
    "Limit": 96 * 1024**3,
    "InUse": 0,
    "MaxInUse": 0,
    "NumAllocs": 0,
    "NumFrees": 0,
    "ActiveAllocs": 0,
    "MaxAllocSize": 0,
    "TotalSystemAllocs": 0,
    "TotalSystemFrees": 0,
    "TotalActiveAllocs": 0,
}


# Timing hook: how long hpu.synchronize() waits, as if the device were still busy (the double runs
# everything on the CPU, at once); tests set it to model device-bound and host-bound steps. WAIT is
# how it waits: asleep, or on a test's simulated clock (``WAIT[0] = clock.advance``).
DEVICE_SECONDS = [0.0]
WAIT = [time.sleep]


def record(name, **details):
    CALLS.append((name, details))


def names():
    return [name for name, _ in CALLS]


def reset():
    CALLS.clear()
    DEVICE_SECONDS[0] = 0.0
    WAIT[0] = time.sleep
