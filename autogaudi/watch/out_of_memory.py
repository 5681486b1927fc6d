"""Out-of-memory errors of a training step: telling them apart, and putting a forward back as it was.

Why: a step that runs out of device memory in its forward has left nothing of the step behind but
its random draws and the buffers it updated (BatchNorm's running statistics, a step counter):
with those put back (every buffer, by content) and the memory freed, the forward can run again,
checkpointed, as if it had never run. The matcher is accelerate's (CUDA, XPU, MPS, the CPU allocator), with torch's
``OutOfMemoryError`` by type, and the Gaudi bridge's allocation failures, whose messages name the
memory module that failed (``MODULE:PT_DEVMEM``, ``MODULE:DEVMEM/SYNHELPER``): accelerate knows
only the first.
"""

from __future__ import annotations

import gc
import re

import torch

from autogaudi.watch import forward_state

# The Gaudi bridge's: "FATAL ERROR :: MODULE:DEVMEM/SYNHELPER Allocation failed for size::..."
_GAUDI = re.compile(r"MODULE:[\w/]*DEVMEM[\w/]* Allocation failed")


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error.args[0]) if error.args else ""
    if _GAUDI.search(text):
        return True
    try:
        from accelerate.utils.memory import should_reduce_batch_size
    except ImportError:  # a broken install: the device's own messages are still known
        return False
    return should_reduce_batch_size(error)


def release() -> None:
    """Free what the failed call left: the garbage (the forward's frames and tensors) and the
    allocator's cached blocks (accelerate's ``clear_device_cache``; on Gaudi the bridge keeps its
    pool, and only the garbage goes). Never raises: by now the failed call's error is let go."""
    gc.collect()
    try:
        from accelerate.utils.memory import clear_device_cache

        clear_device_cache()
    except Exception:  # noqa: BLE001 - freeing the cache is best effort: the call is run again regardless
        pass


class CallState:
    """What a forward changes besides its output, taken before each call so it can be put back: the
    random generators' states (torch's, the accelerator's, Python's and NumPy's) and the model's
    buffers and attributes (:class:`~autogaudi.watch.forward_state.ModuleState`: every buffer, compared by
    content, since BatchNorm's kernel and ``.data`` updates move no version counter)."""

    def __init__(self, backend_name: str):
        self._device = getattr(torch, backend_name, None) if backend_name != "cpu" else None
        self._cpu = None
        self._accelerator = None
        self._python = None
        self._module = None

    def take(self, model) -> None:
        self._cpu = torch.get_rng_state()
        get = getattr(self._device, "get_rng_state_all", None) if self._device is not None else None
        self._accelerator = get() if get is not None else None
        self._python = forward_state.python_random_states()
        self._module = forward_state.ModuleState(model)

    def put_back(self) -> int:
        """The state as it was taken; the number of buffers the failed forward had changed."""
        torch.set_rng_state(self._cpu)
        if self._accelerator is not None:
            self._device.set_rng_state_all(self._accelerator)
        forward_state.set_python_random_states(self._python)
        module, self._module = self._module, None
        return module.put_back()

    def drop(self) -> None:
        """The call completed: nothing of it is kept."""
        self._module = None
