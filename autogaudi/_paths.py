"""Where the child-process bootstrap folder (holding ``sitecustomize.py``) lives."""

from __future__ import annotations

import os

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def bootstrap_dir() -> str:
    """The folder the launcher puts first on ``PYTHONPATH`` so that child processes bootstrap.

    A built wheel carries it inside the package (``autogaudi/_sitecustomize``); a source checkout
    or editable install has it at the repository's top level (``sitecustomize/``).
    """
    for candidate in (
        os.path.join(_PACKAGE_DIR, "_sitecustomize"),
        os.path.join(os.path.dirname(_PACKAGE_DIR), "sitecustomize"),
    ):
        if os.path.isfile(os.path.join(candidate, "sitecustomize.py")):
            return candidate
    raise RuntimeError(f"autogaudi's sitecustomize bootstrap is missing next to {_PACKAGE_DIR}")
