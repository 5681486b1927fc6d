"""The ``--report`` file: checked before the script starts, written so it never lands elsewhere.

Why: a report path is named at the start of a run and written at its end, perhaps hours later. A
folder that does not exist must stop the run before it trains, not lose its report after. The
report goes only to a regular file or a new name: a device (``/dev/null``, which a run as root
would otherwise replace), a FIFO (whose reader would wait forever), a socket or ``-`` (a file
named so, where stdout was meant) is refused before the script starts. A symbolic link planted at
the path or on the way to it (in a shared, sticky folder) must not make the run write where it
points: the folder is fixed when the run starts (its links resolved then) and opened at the end
one level at a time, following no link. A write that fails half-way must not leave half a JSON
file where the last good one was: the report is written beside the target under a fresh name and
renamed over it, and readers see the old file or the new. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import stat

from autogaudi.core.errors import OptionsError
from autogaudi.store.cache import WRITING, write_atomically

ACCEPTED = "--report takes a regular file, or a new name in an existing folder"
KINDS = {stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device", stat.S_ISFIFO: "a FIFO (named pipe)"}
KINDS[stat.S_ISSOCK] = "a socket"


def resolved(path):
    """``path`` made absolute against the folder the run starts in (a script may change folder), its
    folder's links resolved now: the write at the end follows none."""
    if path is None:
        return None
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(os.path.realpath(folder), name)


def check(path) -> None:
    """Raise :class:`OptionsError` naming ``path`` unless the report can be written there."""
    if path is None:
        return
    if os.fspath(path) == "-":
        raise OptionsError(f"report='-' would be a file named '-', not standard output; {ACCEPTED}")
    folder = os.path.dirname(os.path.abspath(path)) or os.curdir
    if not os.path.isdir(folder):
        raise OptionsError(f"report={path!r}: the folder {folder!r} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OptionsError(f"report={path!r}: the folder {folder!r} is not writable by this user; choose another path")
    if os.path.islink(path):
        raise OptionsError(f"report={path!r} is a symbolic link; the report replaces files, never follows links")
    if os.path.isdir(path):
        raise OptionsError(f"report={path!r} is a folder; name a file in it")
    kind = _not_a_file(os.lstat(path).st_mode) if os.path.lexists(path) else None
    if kind:
        raise OptionsError(f"report={path!r} is {kind}, which the report would replace; {ACCEPTED}")


def _not_a_file(mode: int):
    """What a path's mode says it is where it is not a regular file (a link: the caller's), or None."""
    return next((kind for test, kind in KINDS.items() if test(mode)), None)


def write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder, synced and renamed over it."""
    if os.open not in os.supports_dir_fd:  # Windows: no folder descriptors; the rename still replaces a link
        write_atomically(os.path.abspath(path), text.encode("utf-8"), before_replace=lambda _temporary: _entry(path))
        return
    folder, name = os.path.split(os.path.abspath(path))
    descriptor = _open_folder(folder)
    import secrets  # only where a report file is written: not every start's cost

    temporary = f"{WRITING}{secrets.token_hex(8)}"
    try:
        _entry(name, descriptor)
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=descriptor)
        try:  # 0o666 less the umask: as readable as open() would make it
            data = text.encode("utf-8")
            while data:
                data = data[os.write(handle, data) :]
            os.fsync(handle)
        finally:
            os.close(handle)
        _entry(name, descriptor)  # what may have been planted meanwhile
        os.replace(temporary, name, src_dir_fd=descriptor, dst_dir_fd=descriptor)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=descriptor)
        raise
    finally:
        os.close(descriptor)


def _open_folder(folder: str) -> int:
    """A descriptor of ``folder``, opened from ``/`` one level at a time, following no link."""
    descriptor = os.open(os.sep, os.O_RDONLY | os.O_DIRECTORY)
    for part in filter(None, folder.split(os.sep)):
        try:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=descriptor)
        except OSError as error:
            raise OSError(
                f"{folder} is not the folder it was when the run started ({part}: {error.strerror})"
            ) from None
        finally:
            os.close(descriptor)
        descriptor = inner
    return descriptor


def _entry(name: str, descriptor=None) -> None:
    """Raise OSError where ``name`` (in the folder ``descriptor``) is now a link or not a regular file."""
    try:
        mode = os.stat(name, dir_fd=descriptor, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    kind = "a symbolic link" if stat.S_ISLNK(mode) else _not_a_file(mode)
    if kind:
        raise OSError(f"{name} became {kind} during the run; not replaced")
