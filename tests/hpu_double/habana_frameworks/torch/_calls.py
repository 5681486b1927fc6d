"""Not part of the real bridge: the double's record of every bridge call, for the tests."""

import os
import time
import weakref

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


# Where tensors are. The double cannot hold HPU tensors: a tensor the double put "on hpu" (through the
# GPU migration's mapped calls) is a CPU tensor recorded here. HPU_DOUBLE_PLACEMENT (read at import):
# "recorded" counts only those as on the device; unset, every CPU tensor stands for an HPU one, as the
# tests written before placement was modelled assume.
PLACED = {}  # id -> weak reference (a WeakSet would compare tensors with ==)
RECORDED_PLACEMENT = os.environ.get("HPU_DOUBLE_PLACEMENT") == "recorded"


def place(tensor):
    PLACED[id(tensor)] = weakref.ref(tensor)
    return tensor


def placed(tensor) -> bool:
    held = PLACED.get(id(tensor))
    return held is not None and held() is tensor


def device_type_of(tensor) -> str:
    """autogaudi.placement's probe, answered as the double's device would: "hpu" for a tensor the
    double holds on the device."""
    if tensor.device.type == "cpu" and (not RECORDED_PLACEMENT or placed(tensor)):
        return "hpu"
    return tensor.device.type
