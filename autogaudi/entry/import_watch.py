"""Run a callback right after a module finishes importing, without importing it first.

autogaudi must not import torch in a process that never does (``AUTOGAUDI=1 python -c pass``),
so patching waits for the user's own ``import torch``. wrapt's ``when_imported`` would do this, but
importing wrapt costs 110-150 ms here (it pulls in asyncio and importlib.metadata) against a
start-up budget of 20 ms for every Python process under ``AUTOGAUDI=1``; this one-shot finder costs
nothing until torch is imported, and wrapt is loaded only then, when patching starts. What must
precede the Gaudi bridge runs as the first of torch and the bridge *starts* importing
(:func:`call_before_import`). The callbacks' time is autogaudi's start (the report counts it).
"""

from __future__ import annotations

import sys
import time

from autogaudi.measure import timeline

_RUNNING = [0]  # callbacks under way: one run inside another (an import the session makes) counts once


def _timed(callback, *args) -> None:
    started = time.perf_counter()
    _RUNNING[0] += 1
    try:
        callback(*args)
    finally:
        _RUNNING[0] -= 1
        if not _RUNNING[0]:
            timeline.add_start_up(time.perf_counter() - started)


class _NotifyingLoader:
    """Delegates to the real loader and reports the module once it has executed successfully."""

    def __init__(self, loader, on_loaded):
        self._loader = loader
        self._on_loaded = on_loaded

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        # The module should look exactly as if nobody had watched it being imported (by one
        # watcher or several: each wraps the loader the one before it found).
        loader = self._loader
        while isinstance(loader, _NotifyingLoader):
            loader = loader._loader
        module.__loader__ = loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = loader
        _timed(self._on_loaded, module)


def _found_by_the_others(leaving, fullname, path, target):
    """``fullname``'s spec from the finders after ``leaving`` takes itself off the path, or None. A
    finder that took itself off while Python's import walks the path would make the walk skip the
    next finder (a user's own, maybe the only one that finds the module), so the one leaving asks the
    rest itself, on a copy: one of them may leave too."""
    if leaving in sys.meta_path:
        sys.meta_path.remove(leaving)
    for finder in list(sys.meta_path):
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(fullname, path, target) if find_spec else None
        if spec is not None:
            return spec
    return None


class _ImportWatcher:
    """A meta-path finder that only ever answers for one module name, and only once."""

    def __init__(self, name: str, on_loaded):
        self.name = name
        self.on_loaded = on_loaded

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        spec = _found_by_the_others(self, fullname, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _NotifyingLoader(spec.loader, self.on_loaded)
        return spec


def call_after_import(name: str, on_loaded) -> None:
    """Call ``on_loaded(module)`` now if ``name`` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        _timed(on_loaded, module)
        return
    if not any(isinstance(f, _ImportWatcher) and f.name == name and f.on_loaded == on_loaded for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportWatcher(name, on_loaded))


def forget_after_import(name: str, on_loaded) -> None:
    """Undo :func:`call_after_import` where ``name`` has not been imported since."""
    sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, _ImportWatcher) and f.on_loaded == on_loaded)]


class _BeforeImport:
    """A meta-path finder that calls back once, at the start of the first import of one of ``names``,
    then leaves the finding to the others."""

    def __init__(self, names: tuple, callback):
        self.names = names
        self.callback = callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)
        _timed(self.callback)
        return _found_by_the_others(self, fullname, path, target)


def call_before_import(names: tuple, callback) -> bool:
    """Call ``callback()`` once, as the first of ``names`` starts importing; False (and no call) if
    one of them is imported already."""
    if any(name in sys.modules for name in names):
        return False
    for finder in [f for f in sys.meta_path if isinstance(f, _BeforeImport) and f.names == names]:
        sys.meta_path.remove(finder)
    sys.meta_path.insert(0, _BeforeImport(names, callback))
    return True
