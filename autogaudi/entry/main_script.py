"""Run a script or module as ``__main__``, as ``python script.py`` or ``python -m module`` would.

Shared by the launcher (:mod:`autogaudi.entry.launcher`) and the doctor (:mod:`autogaudi.diagnosis.command`),
which both run the user's program in their own process. The program must not be able to tell:
``sys.argv``, ``sys.path[0]``, a real ``__main__`` module (``__file__``, ``__spec__``), the exit
code, and a traceback that starts in the user's code are all what python would give. Classes
defined in the script pickle under multiprocessing's spawn start method because ``__main__`` is a
real module with ``__file__`` / ``__spec__`` that the children can re-import.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import importlib.util
import io
import os
import signal
import sys
import types

from autogaudi.entry.frames import strip_own_frames

_replaced_main_modules = []  # the caller's own __main__, kept alive after the script replaces it


def split_command_line(argv: list, value_flags):
    """Split ``argv`` into (our options, target, target's args, is_module) like python does;
    ``value_flags`` are our options that take a value (the next word).

    Our options stop at the first word that is not one of them: the script path, or ``-m module``;
    everything after belongs to the user's program untouched, even words that look like our flags.
    """
    ours = []
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "-m" or (word.startswith("-m") and not word.startswith("--")):
            module = word[2:] or (argv[index + 1] if index + 1 < len(argv) else None)
            rest = argv[index + 1 :] if word[2:] else argv[index + 2 :]
            return ours, module, rest, True
        if word == "--":
            target = argv[index + 1] if index + 1 < len(argv) else None
            return ours, target, argv[index + 2 :], False
        if not word.startswith("-") or word == "-":
            return ours, word, argv[index + 1 :], False
        ours.append(word)
        if word in value_flags and index + 1 < len(argv):
            ours.append(argv[index + 1])
            index += 1
        index += 1
    return ours, None, [], False


def run_as_main(target: str, args: list, is_module: bool, stopped_by: tuple = ()):
    """Run the script or module as ``__main__``; return its exit status for ``sys.exit``.
    An exception of a ``stopped_by`` type ends the script quietly with status 0 (the doctor stops
    scripts that way after the steps it observes)."""
    try:
        code, module = _load_module_main(target) if is_module else _load_script_main(target)
    except _CannotRun as problem:
        problem.show()
        return problem.status
    sys.argv = [target if not is_module else module.__file__, *args]
    _replaced_main_modules.append(sys.modules.get("__main__"))
    sys.modules["__main__"] = module
    return _run(code, module, stopped_by)


def _run(code, module, stopped_by=()):
    try:
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except stopped_by:
        return 0
    except BaseException as error:  # the user's exception: show it as python would, then exit 1
        strip_own_frames(error)  # the launcher's, and those of autogaudi's wrappers it passed through
        sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__  # as python does
        sys.excepthook(type(error), error, error.__traceback__)
        if isinstance(error, KeyboardInterrupt):
            _exit_like_python_on_interrupt()
        return 1
    return 0


def _exit_like_python_on_interrupt():
    """Python exits an uncaught Ctrl-C by killing itself with SIGINT, after running atexit."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


class _CannotRun(Exception):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.message = message
        self.status = status

    def show(self) -> None:
        sys.stderr.write(f"{sys.executable}: {self.message}\n")


class _DoesNotCompile(_CannotRun):
    """The script's syntax error, shown as python shows it: the error alone, no traceback (the
    frames it was raised in are the launcher's), and exit status 1."""

    def __init__(self, error: SyntaxError):
        super().__init__(str(error), 1)
        self.error = error

    def show(self) -> None:
        error, self.error = self.error, None
        sys.excepthook(type(error), error.with_traceback(None), None)


def _new_main(**attributes) -> types.ModuleType:
    module = types.ModuleType("__main__")
    module.__dict__.update({"__builtins__": builtins, "__cached__": None, **attributes})
    return module


def _load_script_main(path: str):
    absolute = os.path.abspath(path)
    if os.path.isdir(absolute) or (os.path.isfile(absolute) and not absolute.endswith(".py") and _is_zip(absolute)):
        spec = importlib.machinery.PathFinder.find_spec("__main__", [absolute])
        if spec is None:
            raise _CannotRun(f"can't find '__main__' module in {path!r}", 1)
        sys.path[0] = absolute
        return spec.loader.get_code("__main__"), _new_main(
            __file__=spec.origin, __loader__=spec.loader, __spec__=None, __package__=""
        )
    try:
        with io.open_code(absolute) as handle:
            source = handle.read()
    except OSError as error:
        raise _CannotRun(f"can't open file {absolute!r}: [Errno {error.errno}] {error.strerror}", 2) from None
    # python puts the script's real folder (symlinks resolved) first on sys.path.
    sys.path[0] = os.path.dirname(os.path.realpath(absolute))
    loader = importlib.machinery.SourceFileLoader("__main__", absolute)
    try:
        code = compile(source, absolute, "exec", dont_inherit=True)
    except SyntaxError as error:
        raise _DoesNotCompile(error) from None
    return code, _new_main(__file__=absolute, __loader__=loader, __spec__=None, __package__=None)


def _is_zip(path: str) -> bool:
    import zipfile

    return zipfile.is_zipfile(path)


def _load_module_main(name: str):
    if not name:
        raise _CannotRun("Argument expected for the -m option", 2)
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            package = name
            spec = importlib.util.find_spec(name + ".__main__")
            if spec is None:
                raise _CannotRun(
                    f"No module named {package}.__main__; '{package}' is a package and cannot be directly executed", 1
                )
    except ImportError as error:
        raise _CannotRun(
            f"Error while finding module specification for {name!r} ({type(error).__name__}: {error})", 1
        ) from None
    if spec is None:
        raise _CannotRun(f"No module named {name}", 1)
    code = spec.loader.get_code(spec.name)
    return code, _new_main(
        __file__=spec.origin, __loader__=spec.loader, __spec__=spec, __package__=spec.parent, __cached__=spec.cached
    )


def script_path():
    """The running script's file (``__main__``), or None (``python -c``, an interactive session)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path if path and path.endswith(".py") and os.path.isfile(path) else None
