"""autogaudi: make unmodified PyTorch training scripts fast on Intel Gaudi, CUDA and CPU.

Three ways in, one behaviour: ``python -m autogaudi train.py``, ``autogaudi.enable()``, or
``AUTOGAUDI=1`` in the environment. Importing this package is cheap and never imports torch; the
optimizations are applied when torch is imported (or at once if it already is).
"""

# first: autogaudi's start is timed from this import
from autogaudi.measure import timeline as _timeline  # noqa: F401

# isort: split
from autogaudi._version import __version__
from autogaudi.core.errors import OptionsError
from autogaudi.entry.runtime import active_options, disable, enable, is_enabled, report, settled


def doctor(script: str, *args: str, steps: int = 20, module: bool = False):
    """Diagnose ``script`` (a path, or a module name with ``module=True``) run with ``args`` for at
    most ``steps`` optimizer steps in this process, observing only; returns a
    :class:`~autogaudi.diagnosis.result.Diagnosis` (``.findings``, ``.format()``, ``.as_dict()``).
    ``sys.argv``, ``__main__`` and ``sys.path[0]`` are restored afterwards. See ``python -m autogaudi doctor``."""
    from autogaudi.diagnosis.command import diagnose  # here: the doctor loads only when called

    return diagnose(script, list(args), steps=steps, is_module=module)[0]


__all__ = [
    "OptionsError",
    "__version__",
    "active_options",
    "disable",
    "doctor",
    "enable",
    "is_enabled",
    "report",
    "settled",
]
