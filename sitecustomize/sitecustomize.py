"""autogaudi's bootstrap for child processes (torchrun workers, subprocesses of the user's script).

``python -m autogaudi`` puts this folder first on ``PYTHONPATH`` and sets ``AUTOGAUDI=1``, so any
Python process started below it enables autogaudi before its own code runs, even where autogaudi's
``.pth`` file is not active. A user's own ``sitecustomize`` is then imported as it would have been
without us: this module steps out of the way, imports the next one on ``sys.path`` and leaves it
as ``sys.modules["sitecustomize"]``.
"""

import os
import sys


def _enable_autogaudi():
    if not os.environ.get("AUTOGAUDI"):
        return
    try:
        from autogaudi.entry.bootstrap import enable_from_environment
    except ImportError as error:
        # Another interpreter (a system python the script runs) inherits our PYTHONPATH but not
        # autogaudi: it runs as it would without us, and a caller parsing its stderr sees nothing.
        if os.environ.get("AUTOGAUDI_VERBOSE", "").strip().lower() in ("1", "true", "yes", "on"):
            sys.stderr.write(f"autogaudi: not importable in this interpreter ({error}); running without it\n")
        return
    enable_from_environment("sitecustomize")


def _import_users_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    # Our folder only needs to be on PYTHONPATH (for grandchildren), not on this sys.path: leaving
    # it out lets the import below find the user's sitecustomize and keeps sys.path as it would be.
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401  (the user's own, if any)
    except ImportError as error:
        if error.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours


_enable_autogaudi()
_import_users_sitecustomize()
