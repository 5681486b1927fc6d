"""Enable autogaudi from the environment: the entry shared by the ``.pth`` file and sitecustomize.

Runs during interpreter start-up of every Python process that has ``AUTOGAUDI`` set, so it must be
cheap (no torch, no wrapt) and must never break the process for a reason other than a bad option.
"""

from __future__ import annotations

import os
import sys


def enable_from_environment(source: str) -> None:
    """Enable autogaudi if ``AUTOGAUDI`` says so; a bad value stops the process with exit code 2."""
    from autogaudi import runtime
    from autogaudi.errors import OptionsError
    from autogaudi.options import parse_bool

    try:
        if parse_bool("AUTOGAUDI", os.environ.get("AUTOGAUDI", "")):
            runtime.enable_with_source({}, source)
    except OptionsError as error:
        # The user's script has not started yet: refuse to run it with settings they did not ask for.
        sys.stderr.write(f"autogaudi: error: {error}\n")
        sys.stderr.flush()
        os._exit(2)
    except Exception as error:  # fail open: the user's program runs as plain PyTorch
        sys.stderr.write(f"autogaudi: disabled, could not start: {error!r}\n")
