"""What a module's forward changes besides its output, taken before and put back after.

Why: a forward that runs again — a checkpointed block's recomputation in backward, a training forward
run again after it ran out of memory — must leave the run as one forward left it. Its buffers are
the part torch's own tools miss: BatchNorm updates its running statistics and counter in its kernel
and an EMA codebook through ``.data``, neither bumping a version counter, so they are compared and
put back by content (and by object, where the forward assigned a new tensor). Its modules' plain
attributes (a call counter, a cache rebound) are put back by object, and Python's and NumPy's global
random generators (stochastic depth draws from ``random``) are saved and set like torch's.
"""

from __future__ import annotations

import random
import sys

import torch


def python_random_states() -> tuple:
    """Python's global random state and NumPy's (None where the script has not imported NumPy)."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None)


def set_python_random_states(states: tuple) -> None:
    python, numpy_state = states
    random.setstate(python)
    numpy = sys.modules.get("numpy")
    if numpy is not None and numpy_state is not None:
        numpy.random.set_state(numpy_state)


class ModuleState:
    """The buffers (each tensor and a copy of its content) and the plain attributes of ``module`` and
    every submodule, as they are when taken."""

    def __init__(self, module):
        modules = tuple(module.modules())
        with torch.no_grad():
            self._buffers = [
                (owner, name, tensor, tensor.detach().clone())
                for owner in modules
                for name, tensor in owner._buffers.items()
                if tensor is not None
            ]
        self._attributes = [(owner, dict(vars(owner))) for owner in modules]

    def put_back(self) -> int:
        """Everything as it was taken; the number of buffers that had changed."""
        for owner, saved in self._attributes:
            current = vars(owner)
            for key in [key for key in current if key not in saved]:
                del current[key]
            for key, value in saved.items():
                if current.get(key, _MISSING) is not value:
                    current[key] = value
        changed = 0
        with torch.no_grad():
            for owner, name, tensor, copy in self._buffers:
                moved = owner._buffers.get(name) is not tensor
                if moved:
                    owner._buffers[name] = tensor
                if tensor.shape != copy.shape or tensor.dtype != copy.dtype:
                    owner._buffers[name] = copy
                    changed += 1
                elif not torch.equal(tensor, copy):
                    tensor.copy_(copy)
                    changed += 1
                else:
                    changed += moved
        return changed


_MISSING = object()
