"""Whether a folder or file of the cache could hold another user's code: the cache's trust rule.

Why: what the cache holds steers runs, and saved compiles and inductor's cache are pickles, so
loading them runs code. A path is this user's when it is theirs and nobody else can change what it
names: the path itself is owned by the user and writable by nobody else (the rule of pip's cache and
Python's bytecode), and every folder above it, up to ``/``, as given and as its links resolve, is
owned by the user or root and writable by nobody else, or sticky as ``/tmp`` is (there only an
entry's owner may rename it). A folder above writable by its group counts as the user's where that
group is the user's own private group (the ``umask 002`` convention: a group of one, named as the
user). Otherwise anyone who can write a folder above could swap the cache for a folder of theirs
in the middle of a run, and a check made once at the start would not see it; the cache checks at
every read and write (:meth:`autogaudi.store.cache.Cache.trusted`), and this rule makes a swap
impossible in the first place. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import os
import stat
import tempfile


def distrust(path: str, follow: bool = True):
    """Why a folder or file of the cache could hold another user's code, or None: it is not owned by
    this user, or group or others can write it; a link where ``follow`` is False."""
    if not hasattr(os, "geteuid"):  # Windows: no owners or modes to read this way
        return None
    try:
        found = os.stat(path) if follow else os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # not there (yet): nothing in it to read
        return None
    if stat.S_ISLNK(found.st_mode):
        return f"{path} is a symbolic link"
    if found.st_uid != os.geteuid():
        return f"{path} is owned by another user (uid {found.st_uid})"
    if found.st_mode & 0o022:
        return f"{path} can be written by {'others' if found.st_mode & 0o002 else 'its group'}"
    return None


def distrust_above(path: str):
    """Why a folder above ``path`` would let another user replace it, or None (the rule above)."""
    if not hasattr(os, "geteuid"):
        return None
    user = os.geteuid()
    for folder in folders_above(path):
        try:
            link, found = os.lstat(folder), os.stat(folder)
        except (FileNotFoundError, NotADirectoryError):  # made later, by this user
            continue
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (user, 0):
            return f"{folder}, above the cache, is a symbolic link owned by another user (uid {link.st_uid})"
        if found.st_uid not in (user, 0):
            return f"{folder}, above the cache, is owned by another user (uid {found.st_uid}), who could replace it"
        shared = found.st_mode & (0o002 if _private_group(found.st_gid) else 0o022)
        if shared and not found.st_mode & stat.S_ISVTX:
            writers = "others" if found.st_mode & 0o002 else "its group"
            return f"{folder}, above the cache, can be written by {writers} and is not sticky: they could replace it"
    return None


def folders_above(path: str) -> list:
    """Every folder above ``path`` up to ``/``: as given, then as its links resolve."""
    found = []
    for chain in (os.path.abspath(path), os.path.realpath(path)):
        folder = os.path.dirname(chain)
        while folder not in found:
            found.append(folder)
            folder = os.path.dirname(folder)
    return found


@functools.cache
def _private_group(gid: int) -> bool:
    """Whether ``gid`` is this user's own group: their primary group, named as they are, no other member."""
    try:
        import grp
        import pwd

        user = pwd.getpwuid(os.geteuid())
        group = grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def inductor_cache_distrust(environ):
    """Where torch.compile's cache (``TORCHINDUCTOR_CACHE_DIR``, else torch's default in the temporary
    folder) could hold another user's code: {"variable", "path", "why"}, or None."""
    variable = "TORCHINDUCTOR_CACHE_DIR"
    path = environ.get(variable)
    if not path:
        import getpass
        import re

        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # as torch names it
        path = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
        variable = f"torch's default, {variable} unset"
    why = distrust(path) or distrust_above(path)
    return None if why is None else {"variable": variable, "path": path, "why": why}
