"""autogaudi: make unmodified PyTorch training scripts fast on Intel Gaudi, CUDA and CPU.

Three ways in, one behaviour: ``python -m autogaudi train.py``, ``autogaudi.enable()``, or
``AUTOGAUDI=1`` in the environment. Importing this package is cheap and never imports torch; the
optimizations are applied when torch is imported (or at once if it already is).
"""
from autogaudi._version import __version__
from autogaudi.errors import OptionsError
from autogaudi.runtime import active_options, disable, enable, is_enabled, report

__all__ = ["OptionsError", "__version__", "active_options", "disable", "enable", "is_enabled", "report"]
