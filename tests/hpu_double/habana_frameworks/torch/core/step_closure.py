"""mark_step and step closures: in lazy mode a mark flushes the queued graph and runs closures."""

from habana_frameworks.torch._calls import record
from habana_frameworks.torch._device import run_graph

_CLOSURES = []


def add_step_closure(closure, args=()):
    _CLOSURES.append((closure, args))


def mark_step(device_str="", sync=False):
    record("mark_step", sync=sync)
    run_graph()
    while _CLOSURES:
        closure, args = _CLOSURES.pop(0)
        closure(*args)


def iter_mark_step():
    mark_step()
