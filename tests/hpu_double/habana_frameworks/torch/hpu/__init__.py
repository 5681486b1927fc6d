"""habana_frameworks.torch.hpu (torch.hpu once loaded): device, memory, streams, and, in lazy mode
only, the HPU-graph API. One Gaudi 2 device with 96 GiB is simulated; the memory figures come from
the double's MEMORY table so tests can set them."""

import contextlib

import torch

from habana_frameworks.torch import _calls
from habana_frameworks.torch._calls import MEMORY, record
from habana_frameworks.torch.utils.internal import is_lazy


def is_available():
    return True


def device_count():
    return 1


def current_device():
    return 0


def set_device(device):
    record("set_device", device=device)


def init():
    record("init")


def _lazy_init():
    """Called by torch before a tensor is made on hpu (the double makes none: its mode maps them)."""


def get_device_name(device=None):
    return "GAUDI2"


def synchronize():
    if is_lazy():
        # The bridge's synchronize marks a step (flushing the queued graph, draining the host
        # pipeline) before it waits: hpu/csrc/bindings.cpp, read 2026-11-23.
        from habana_frameworks.torch.core.step_closure import mark_step

        mark_step()
    record("synchronize")
    if _calls.DEVICE_SECONDS[0]:
        _calls.WAIT[0](_calls.DEVICE_SECONDS[0])


def get_rng_state(device="hpu"):
    """The device generator's state (torch.hpu.random): the double's HPU ops draw from the CPU's."""
    return torch.get_rng_state()


def set_rng_state(new_state, device="hpu"):
    torch.set_rng_state(new_state)


def is_bf16_supported():
    return True


_DYNAMIC_SHAPES = [True]


def enable_dynamic_shape():
    _DYNAMIC_SHAPES[0] = True


def disable_dynamic_shape():
    _DYNAMIC_SHAPES[0] = False


def get_dynamic_shape_status():
    return _DYNAMIC_SHAPES[0]


_RECOMPUTE_SDP = [False]


def enable_recompute_sdp(enable):
    _RECOMPUTE_SDP[0] = bool(enable)


def recompute_sdp_enabled():
    return _RECOMPUTE_SDP[0]


@contextlib.contextmanager
def sdp_kernel(enable_recompute=True):
    previous = _RECOMPUTE_SDP[0]
    _RECOMPUTE_SDP[0] = enable_recompute
    try:
        yield
    finally:
        _RECOMPUTE_SDP[0] = previous


def memory_stats(device=None):
    return dict(MEMORY)


def memory_allocated(device=None):
    return MEMORY["InUse"]


def max_memory_allocated(device=None):
    return MEMORY["MaxInUse"]


def memory_reserved(device=None):
    return MEMORY["Limit"]


def reset_peak_memory_stats(device=None):
    MEMORY["MaxInUse"] = MEMORY["InUse"]


def mem_get_info(device=None):
    return MEMORY["Limit"] - MEMORY["InUse"], MEMORY["Limit"]


def memory_summary(device=None):
    return "\n".join(f"{key}: {value}" for key, value in MEMORY.items())


class Stream:
    def __init__(self, device=None, priority=0):
        self.device = device
        self.priority = priority

    def synchronize(self):
        record("stream_synchronize")


_DEFAULT_STREAM = Stream()


def default_stream(device=None):
    return _DEFAULT_STREAM


def current_stream(device=None):
    return _DEFAULT_STREAM


@contextlib.contextmanager
def stream(s):
    yield s


class Event:
    def __init__(self, enable_timing=False):
        self.enable_timing = enable_timing

    def record(self, stream=None):
        record("event_record")

    def synchronize(self):
        record("event_synchronize")


from habana_frameworks.torch.hpu import metrics  # noqa: E402,F401

if is_lazy():
    from habana_frameworks.torch.hpu.graphs import (  # noqa: E402,F401
        HPUGraph,
        ModuleCacher,
        graph,
        make_graphed_callables,
        wrap_in_hpu_graph,
    )
