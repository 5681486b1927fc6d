"""habana_frameworks.torch.core: mark_step & co.; in eager mode mark_step is a no-op that warns once."""

import warnings

import habana_frameworks.torch.hpu  # noqa: F401  (importing core loads the bridge too)
from habana_frameworks.torch import _native_library_loaded  # noqa: F401  (fails while the bridge is half-imported)
from habana_frameworks.torch.core.step_closure import add_step_closure, iter_mark_step
from habana_frameworks.torch.core.step_closure import mark_step as _lazy_mark_step
from habana_frameworks.torch.utils.internal import is_lazy

if is_lazy():
    mark_step = _lazy_mark_step
else:
    _warned = []

    def mark_step(device_str="", sync=False):
        if not _warned:
            warnings.warn("mark_step is a no-op in eager mode (PT_HPU_LAZY_MODE=0)", stacklevel=2)
            _warned.append(True)


__all__ = ["add_step_closure", "is_lazy", "iter_mark_step", "mark_step"]
