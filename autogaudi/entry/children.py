"""What autogaudi did in the child processes a script starts (Hogwild trainers forked or spawned by
``multiprocessing``, a script run by the script), for the parent's report.

Why files: a forked ``multiprocessing`` child ends with ``os._exit`` (no ``atexit``), a child may
end after its parent stopped listening, and children share no process group with the parent (the
ranks of a torchrun job do, and :mod:`autogaudi.entry.ranks` gathers those; a rank is never a child
here). So the first process of a run to start a session names a folder in ``AUTOGAUDI_CHILD_REPORTS``; a
process below it that trained makes it (private to the user) and writes its part there at exit,
instead of printing a second report onto the user's stderr; the parent reads the parts into its own
report and removes the folder. The folder is made only by a child that has a part: most runs start
no child, and making, listing and removing a folder would cost every start and exit.
"""

from __future__ import annotations

import os
import sys

ENV = "AUTOGAUDI_CHILD_REPORTS"
PREFIX = "autogaudi-children-"  # then the owner's pid, then mkdtemp's random part
# Counts a forked child inherits from its parent: its part holds what it counted itself.
COUNTS = ("steps", "backward_passes", "optimizer_steps", "evaluation_forward_passes")


class _Parts:
    def __init__(self):
        self.folder = None  # where parts are written (a child) or read from (the parent)
        self.owner = False  # this process made the folder: it reads the parts and removes them
        self.started_by = None  # a child: "fork" (inherits the session) or "spawn" (a fresh interpreter)
        self.inherited = {}  # a forked child: the counts its parent's session had at the fork
        self.written = False
        self.previous_env = None  # the owner's: what ENV said before it was set here
        self.at_fork_registered = False
        # the runtime's, given at start (this module imports nothing of autogaudi's): the session a
        # forked child inherited, and the report written at a process's exit
        self.fork_session = None
        self.report_at_exit = None


_PARTS = _Parts()


def _is_rank() -> bool:
    """A process of a torchrun (or accelerate) job: its report is gathered through the process group."""
    return "RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def start(fork_session, report_at_exit) -> None:
    """At a session's start: a process started below a run writes its part into the run's folder;
    any other process (the run's first, a rank) makes a folder for the processes it starts.
    ``fork_session()`` gives a forked child the session it inherited; ``report_at_exit`` writes its
    part when ``multiprocessing`` ends it."""
    parts = _PARTS
    parts.fork_session, parts.report_at_exit = fork_session, report_at_exit
    named = os.environ.get(ENV)
    if named and not _is_rank() and parts.folder is None:
        parts.folder, parts.owner, parts.started_by = named, False, "spawn"
    elif parts.folder is None:
        import tempfile  # here, not at the top: the runtime imports this module in every process

        name = f"{PREFIX}{os.getpid()}-{os.urandom(4).hex()}"  # named now, made by the first child with a part
        parts.folder, parts.owner = os.path.join(tempfile.gettempdir(), name), True
        parts.previous_env = named
        os.environ[ENV] = parts.folder
    if not parts.at_fork_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forked)
        parts.at_fork_registered = True


def _remove_stale_folders(temp: str) -> None:
    """The folders of this user's runs that ended without removing theirs (SIGKILL, SIGTERM, a
    crash): their owner's pid is in the name, and a folder goes once nothing runs under that pid."""
    import re
    import shutil

    pattern = re.compile(re.escape(PREFIX) + r"(\d+)-[A-Za-z0-9_]{8}")
    try:
        names = os.listdir(temp)
    except OSError:
        return
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(temp, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or _running(int(match.group(1))):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: running
        return True
    return True


def stop() -> None:
    """At the owner's end (exit or ``disable()``): the folder goes, and ``ENV`` is what it was."""
    parts = _PARTS
    if not parts.owner:
        return
    if os.path.isdir(parts.folder):  # a child wrote a part: the folder goes, with those of killed runs
        import shutil

        shutil.rmtree(parts.folder, ignore_errors=True)
        _remove_stale_folders(os.path.dirname(parts.folder))
    if os.environ.get(ENV) == parts.folder:
        if parts.previous_env is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = parts.previous_env
    parts.folder, parts.owner = None, False


def is_child() -> bool:
    return _PARTS.folder is not None and not _PARTS.owner


def _forked() -> None:
    """In a forked child of a process with a folder: it is a child now, with its parent's session.
    ``multiprocessing`` ends a forked child with ``os._exit``: its exit function (which runs its
    finalizers) is where the part is written then."""
    parts = _PARTS
    if parts.folder is None:
        return
    parts.owner, parts.started_by, parts.written, parts.previous_env = False, "fork", False, None
    session = parts.fork_session()
    figures = session.steps.figures() if session is not None else {}
    parts.inherited = {key: figures.get(key, 0) for key in COUNTS}
    util = sys.modules.get("multiprocessing.util")
    if util is not None:  # runs in the child's Process._bootstrap, after it clears the finalizers
        util.register_after_fork(parts, _finalize_at_multiprocessing_exit)


def _finalize_at_multiprocessing_exit(parts) -> None:
    from multiprocessing import util

    util.Finalize(None, parts.report_at_exit, exitpriority=0)


def write_part(session) -> None:
    """A child's part: its counts (its own, in a forked child), what its units changed and their
    decisions; once per process, and only by a child that trained (not a DataLoader worker)."""
    parts = _PARTS
    if parts.written or not is_child():
        return
    parts.written = True
    figures = session.steps.figures()
    steps = {key: figures.get(key, 0) - parts.inherited.get(key, 0) for key in COUNTS}
    if not (steps["backward_passes"] or steps["optimizer_steps"]):
        return
    report = session.report().as_dict()
    part = {
        "pid": os.getpid(),
        "started_by": parts.started_by,
        "steps": steps,
        "changed": report["changed"],
        "numerics": report["numerics"],
        "statuses": {row["name"]: row["status"] for row in report["units"]},
    }
    import json

    path = os.path.join(parts.folder, f"{os.getpid()}.json")
    try:
        _make_folder(parts.folder)
        with open(path + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(part, handle, default=str)
        os.replace(path + ".tmp", path)
    except OSError:  # the parent is gone and took its folder with it: nobody to tell
        pass


def _make_folder(folder: str) -> None:
    """The run's folder, made by the first child to write (readable by this user only); one that
    exists must be a folder of this user's, not a link: another user's would receive the part."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        found = os.lstat(folder)
        if not os.path.isdir(folder) or os.path.islink(folder) or found.st_uid != os.getuid():
            raise OSError(f"{folder} is not this user's folder") from None


def gathered():
    """The parts the children of this run wrote so far (the owner's), by pid; None elsewhere."""
    import json

    parts = _PARTS
    if not parts.owner:
        return None
    found = []
    try:
        names = sorted(name for name in os.listdir(parts.folder) if name.endswith(".json"))
    except FileNotFoundError:  # no child wrote a part
        return []
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(parts.folder, name), encoding="utf-8") as handle:
                found.append(json.load(handle))
        except (OSError, ValueError):  # a part being written right now: the next read has it
            continue
    return sorted(found, key=lambda part: part["pid"])
