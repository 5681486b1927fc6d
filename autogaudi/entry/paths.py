"""Paths: where the child-process bootstrap folder (holding ``sitecustomize.py``) lives, where the
cache lives by default, and which stack frame is the user's code (the file:line the doctor and the
report point at)."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


@functools.cache
def _library_dirs() -> tuple:
    import sysconfig  # here: the launcher imports this module, and only a frame search needs it

    # located, not imported: the launcher imports this module before torch is wanted
    packages = (os.path.dirname(importlib.util.find_spec(name).origin) for name in ("torch", "wrapt"))
    return (
        *(os.path.abspath(path) + os.sep for path in packages),
        _PACKAGE_DIR + os.sep,
        sysconfig.get_paths()["stdlib"] + os.sep,
        "<frozen",
    )


def _bridge_dirs() -> tuple:
    """The Gaudi bridge's folders once it is imported: its Python (GPU migration's patches of torch)
    runs between the user's call and torch's."""
    bridge = sys.modules.get("habana_frameworks")
    return tuple(os.path.abspath(path) + os.sep for path in getattr(bridge, "__path__", ()))


def user_location(frame):
    """(file, line) of the innermost frame that is the user's code (not torch, wrapt, autogaudi, the
    Gaudi bridge or the standard library), or None."""
    libraries = _library_dirs() + _bridge_dirs()
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(libraries):
            return os.path.abspath(filename), frame.f_lineno
        frame = frame.f_back
    return None


def short_location(location) -> str:
    """``file:line``, the file relative to the working directory when it is under it."""
    path, line = location
    relative = os.path.relpath(path)
    return f"{path if relative.startswith('..') else relative}:{line}"


class NoCacheFolder(OSError):
    """Neither ``--cache-dir`` nor a home folder to put the cache in."""


def default_root(environ=None) -> str:
    """``$XDG_CACHE_HOME/autogaudi``, else ``<home>/.cache/autogaudi``. A relative ``XDG_CACHE_HOME``
    is ignored, as the XDG spec says; an empty or relative ``HOME`` is not a home (it would put the
    cache at ``/.cache``, or wherever the script runs): the password database's is taken instead."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(_home(environ), ".cache")
    return os.path.join(base, "autogaudi")


def _home(environ) -> str:
    home = environ.get("HOME", "")
    if os.path.isabs(home):
        return home
    try:
        import pwd

        home = pwd.getpwuid(os.getuid()).pw_dir
    except ImportError:  # Windows: the profile folder
        home = os.path.expanduser("~") if "HOME" not in environ else ""
    except KeyError:  # a uid the password database does not know (a container's)
        home = ""
    if not os.path.isabs(home):
        raise NoCacheFolder(
            f"no folder for the cache: HOME is {environ.get('HOME', '')!r} and the password database names no "
            "home folder for this user; pass --cache-dir, or --no-cache"
        )
    return home
