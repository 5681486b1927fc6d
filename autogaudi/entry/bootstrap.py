"""Enable autogaudi from the environment: the entry shared by the ``.pth`` file and sitecustomize.

Runs during interpreter start-up of every Python process that has ``AUTOGAUDI`` set, so it must be
cheap (no torch, no wrapt) and must never break the process for a reason other than a bad option.
"""

from __future__ import annotations

import os
import sys


def enable_from_environment(source: str) -> None:
    """Enable autogaudi if ``AUTOGAUDI`` says so; a bad value stops the process with exit code 2
    once it imports torch (:func:`_refuse`)."""
    from autogaudi.core.errors import OptionsError
    from autogaudi.core.options import parse_bool
    from autogaudi.entry import runtime
    from autogaudi.measure import timeline

    try:
        if parse_bool("AUTOGAUDI", os.environ.get("AUTOGAUDI", "")):
            runtime.enable_with_source({}, source)
            timeline.entered_until_now()
    except OptionsError as error:
        from autogaudi.entry.import_watch import call_after_import

        call_after_import("torch", _Refusal(str(error)))
    except Exception as error:  # fail open: the user's program runs as plain PyTorch
        sys.stderr.write(f"autogaudi: disabled, could not start: {error!r}\n")


class _Refusal:
    """Stops a process that imports torch under a bad setting, before its code goes on: it would
    train without the settings the user asked for. Every other process of the environment (pip, a
    tool that never trains) runs as it would without autogaudi, whatever the variables say."""

    def __init__(self, message: str):
        self.message = message

    def __eq__(self, other):  # the .pth file and sitecustomize both refuse: once is enough
        return isinstance(other, _Refusal)

    __hash__ = None

    def __call__(self, _torch) -> None:
        sys.stdout.flush()
        sys.stderr.write(f"autogaudi: error: {self.message}\n")
        sys.stderr.flush()
        raise SystemExit(2)
