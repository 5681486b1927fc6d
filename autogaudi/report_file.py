"""The ``--report`` file: checked before the script starts, written so it never lands elsewhere.

Why: a report path is named at the start of a run and written at its end, perhaps hours later. A
folder that does not exist must stop the run before it trains, not lose its report after; a
symbolic link planted at the path (in a shared, sticky folder) must not make the run overwrite the
file it points to; and a write that fails half-way must not leave half a JSON file where the last
good one was. So the file is written beside the target under a fresh name and renamed over it:
a rename replaces a link itself, never what it points to, and readers see the old file or the new.
Nothing here imports torch.
"""

from __future__ import annotations

import os

from autogaudi.cache import write_atomically
from autogaudi.errors import OptionsError


def resolved(path):
    """``path`` made absolute against the folder the run starts in (a script may change folder)."""
    return None if path is None else os.path.abspath(path)


def check(path) -> None:
    """Raise :class:`OptionsError` naming ``path`` unless the report can be written there."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path)) or os.curdir
    if not os.path.isdir(folder):
        raise OptionsError(f"report={path!r}: the folder {folder!r} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OptionsError(f"report={path!r}: the folder {folder!r} is not writable by this user; choose another path")
    if os.path.islink(path):
        raise OptionsError(f"report={path!r} is a symbolic link; the report replaces files, never follows links")
    if os.path.isdir(path):
        raise OptionsError(f"report={path!r} is a folder; name a file in it")


def write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder, synced and renamed over it."""

    def finish(temporary):
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        if os.path.islink(path):
            raise OSError(f"{path} became a symbolic link during the run; not replaced")
        os.chmod(temporary, 0o666 & ~_umask())

    write_atomically(os.path.abspath(path), text.encode("utf-8"), before_replace=finish)


def _umask() -> int:
    """The process's umask (mkstemp creates 0600; a report is as readable as ``open()`` would make it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
