"""Watching a module's import without changing how it is found or what it looks like afterwards."""

import importlib.abc
import importlib.util
import sys

import pytest

from autogaudi.entry import import_watch

NAME = "autogaudi_watched_module"


class OnlyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A user's own finder, the only one that can find ``NAME``."""

    def __init__(self):
        self.asked = 0

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        self.asked += 1
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.value = 42


@pytest.fixture
def finder():
    finder = OnlyFinder()
    meta_path = list(sys.meta_path)
    sys.meta_path.insert(0, finder)
    yield finder
    sys.meta_path[:] = meta_path
    sys.modules.pop(NAME, None)


@pytest.mark.parametrize("before_first", [True, False], ids=["before-registered-first", "after-registered-first"])
def test_a_finder_after_autogaudis_is_still_asked_when_autogaudis_finders_leave(finder, before_first):
    """autogaudi's finders sit first on the path and take themselves off as the import starts: while
    Python's import walks the path, or the watcher asks the rest. The finder after them must still be
    asked, whichever of autogaudi's was registered first."""
    events = []
    registrations = [
        lambda: import_watch.call_before_import((NAME,), lambda: events.append(("before", finder.asked))),
        lambda: import_watch.call_after_import(NAME, lambda module: events.append(("after", module.value))),
    ]
    for register in registrations if before_first else reversed(registrations):
        register()

    module = importlib.import_module(NAME)

    assert module.value == 42 and finder.asked == 1
    assert events == [("before", 0), ("after", 42)]
    assert module.__loader__ is finder and module.__spec__.loader is finder  # as if nobody had watched
    assert not any(isinstance(f, (import_watch._ImportWatcher, import_watch._BeforeImport)) for f in sys.meta_path)


def test_a_module_imported_already_is_called_back_at_once_and_not_before(finder):
    importlib.import_module(NAME)
    seen = []
    import_watch.call_after_import(NAME, lambda module: seen.append(module.value))
    assert seen == [42]
    assert import_watch.call_before_import((NAME,), lambda: seen.append("before")) is False
    assert seen == [42]
