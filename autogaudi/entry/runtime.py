"""The one process-wide guard behind ``python -m autogaudi``, ``enable()`` and ``AUTOGAUDI=1``.

All three entry points land in :func:`enable_with_source`, so autogaudi is configured once per
process however many of them fire (the launcher's process also has ``AUTOGAUDI=1`` and the ``.pth``
file; a script under the launcher may call ``enable()`` too). Nothing heavy happens here: the
session that detects the backend and applies the units starts when torch is imported, or at once
if it already is.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import gc
import sys

from autogaudi.core.options import Options
from autogaudi.entry import children
from autogaudi.entry.import_watch import call_after_import, call_before_import, forget_after_import

BRIDGE = "habana_frameworks.torch"  # the Gaudi bridge, which torch >= 2.5 loads during its own import

# Sources that mean "the user asked for autogaudi in this very process": the exit report is printed
# for them even if no training step was seen. Environment-only processes (workers, helpers) print
# it only once they have trained, so DataLoader or compile workers stay silent.
EXPLICIT_SOURCES = ("launcher", "enable")


class _Runtime:
    def __init__(self):
        self.lock = _thread.RLock()  # not `threading`: its import costs ~5 ms at every start-up
        self.options = None  # Options while enabled, None while disabled
        self.sources = []  # the entry points that enabled autogaudi, in order (for the report)
        self.session = None  # the live Session once torch is imported
        self.starting = False  # a session is being started (its backend probe may import the bridge)
        self.decided_before_bridge = (
            None  # autogaudi.entry.before_bridge.decide's, taken as torch or the bridge began importing
        )
        self.last_session = None  # kept after disable() so report() still answers
        self.exit_hook_registered = False


_STATE = _Runtime()


def enable(**options) -> None:
    """Switch autogaudi on in this process; keywords override the environment (see ``--help``).

    Calling it again with the same options does nothing; with different options it reapplies every
    unit under the new ones. Raises :class:`autogaudi.OptionsError` for an unknown option, unit
    name or bad value, before anything is patched.
    """
    enable_with_source(options, "enable")


def enable_with_source(overrides: dict, source: str) -> None:
    with _STATE.lock, collector_paused():
        base = _STATE.options if _STATE.options is not None else Options.from_env()
        options = base.replace(**overrides) if overrides else base
        if options.report is not None:  # checked now, written at exit: a script may change folder
            from autogaudi.reporting import output_file as report_file

            report_file.check(options.report)
            options = options.replace(report=report_file.resolved(options.report))
        if source not in _STATE.sources:
            _STATE.sources.append(source)
        if _STATE.options is not None:
            if options == _STATE.options:
                return
            _stop_session()
        _STATE.options = options
        _STATE.decided_before_bridge = None
        if not _STATE.exit_hook_registered:
            atexit.register(report_at_exit)
            _STATE.exit_hook_registered = True
        call_before_import(("torch", "habana_frameworks"), _decide_before_bridge)
        call_after_import(BRIDGE, _on_torch_imported)
        call_after_import("torch", _on_torch_imported)


def disable() -> None:
    """Undo everything autogaudi changed: every patched attribute is the original object again."""
    with _STATE.lock:
        _stop_session()
        _STATE.options = None
        forget_after_import(BRIDGE, _on_torch_imported)  # the waits for torch and the bridge, where still pending


def is_enabled() -> bool:
    return _STATE.options is not None


def settled() -> bool:
    """True once autogaudi has made every decision for this run (the step is profiled, no trial is
    running or queued); False while it is still measuring, and while it is disabled or torch has not
    been imported. Benchmarks time a run's steady state from here; ``report().steps`` says at which
    step it happened (``decisions_settled_at_step``)."""
    with _STATE.lock:
        return _STATE.session is not None and _STATE.session.settled()


def active_options():
    """The options in force, or None while autogaudi is disabled."""
    return _STATE.options


def report():
    """The report of the current session (or the last one after ``disable()``).

    ``print(autogaudi.report())`` shows the table; ``.as_dict()`` gives the JSON form. Before torch
    is imported there is nothing to report yet and the result says so.
    """
    from autogaudi.reporting.record import Report  # here: an AUTOGAUDI=1 process that never asks skips it

    with _STATE.lock:
        session = _STATE.session or _STATE.last_session
        return session.report() if session is not None else Report.not_started(_STATE.options)


@contextlib.contextmanager
def collector_paused():
    """Python's garbage collector held off while autogaudi starts, and left as the user had it.

    Why: importing torch leaves the collector a few thousand allocations short of a full collection
    (85-97 ms on the 2-core CPU). autogaudi's start allocates about 11,000 objects; collected as they
    come, they move its counters on by a generation and bring that full collection into a short run
    that plain PyTorch ends without. Held off, they cost one young-generation pass at the next
    allocation, and the user's allocations meet the collector where plain PyTorch's would."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _decide_before_bridge() -> None:
    """At the start of the script's import of torch or of the Gaudi bridge, whichever comes first:
    what the bridge reads when it loads (:mod:`autogaudi.entry.before_bridge`, which imports no torch)."""
    with _STATE.lock:
        if _STATE.options is None:
            return
        try:
            from autogaudi.entry import before_bridge

            _STATE.decided_before_bridge = before_bridge.decide(_STATE.options)
        except Exception as error:  # the session decides again, later; the import goes on
            sys.stderr.write(f"autogaudi: could not prepare for the Gaudi bridge: {error!r}\n")


def _importing(name: str) -> bool:
    """Whether ``name``'s import has begun and not finished (a module half-imported)."""
    module = sys.modules.get(name)
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _on_torch_imported(module) -> None:
    """Start the session once torch is imported and the Gaudi bridge is not half-imported: a script
    that imports the bridge first (which imports torch) starts it when the bridge's import is
    complete; torch's autoloading of the bridge, when torch's is."""
    # Runs inside the user's import: whatever goes wrong here must not break that import.
    others = [name for name in ("torch", BRIDGE) if name != getattr(module, "__name__", None)]
    if "torch" not in sys.modules or any(_importing(name) for name in others):
        return  # the other import's completion calls again
    with _STATE.lock, collector_paused():
        if _STATE.options is None or _STATE.session is not None or _STATE.starting:
            return  # starting: the bridge's import, by the backend probe of the session being started
        _STATE.starting = True
        try:
            from autogaudi.core.session import Session

            session = Session(_STATE.options, tuple(_STATE.sources), _STATE.decided_before_bridge)
            session.start()
            children.start(fork_session, report_at_exit)
        except Exception as error:
            sys.stderr.write(f"autogaudi: could not start, running plain PyTorch: {error!r}\n")
            return
        finally:
            _STATE.starting = False
        _STATE.session = session
        from autogaudi.entry import before_bridge  # loaded by the session already

        if not before_bridge.bridge_installed():  # its watch would only cost every later import a call
            forget_after_import(BRIDGE, _on_torch_imported)


def _stop_session() -> None:
    session, _STATE.session = _STATE.session, None
    if session is not None:
        session.stop()
        _STATE.last_session = session
    children.stop()


def fork_session():
    """In a child just forked: the session it inherited (or None), and a lock of its own (a thread of
    the parent may have held the parent's at the fork, and that thread is not in the child)."""
    _STATE.lock = _thread.RLock()
    return _STATE.session


def report_at_exit() -> None:
    """The exit report (``atexit``; a forked ``multiprocessing`` child calls it from its exit
    function): a child process writes its part for the parent (:mod:`autogaudi.entry.children`), the
    parent prints the report with its children's parts in it."""
    # Only a session still enabled reports: after disable() the user has opted out.
    with _STATE.lock:
        session = _STATE.session
        try:
            if session is None:
                return
            if children.is_child():
                children.write_part(session)
                return
            explicit = any(source in EXPLICIT_SOURCES for source in _STATE.sources) or bool(children.gathered())
            session.finish(explicit=explicit)
        except Exception as error:  # never turn a clean exit into a crash
            sys.stderr.write(f"autogaudi: could not write the report: {error!r}\n")
        finally:
            children.stop()
