"""``python -m autogaudi [options] (script.py | -m module) [args ...]``: run a script as if directly.

(``python -m autogaudi doctor ...`` is the doctor: :mod:`autogaudi.diagnosis.command`; ``python -m autogaudi
cache {list,clear}`` shows or clears what runs remember: :mod:`autogaudi.cache`.)

The user's program must not be able to tell it was launched through us: ``sys.argv``,
``sys.path[0]``, a real ``__main__`` module (``__file__``, ``__spec__``), the exit code, and a
traceback that starts in the user's code are all what ``python script.py`` would give. Classes
defined in the script pickle under multiprocessing's spawn start method because ``__main__`` is a
real module with ``__file__`` / ``__spec__`` that the children can re-import.

Before the script starts, the launcher imports only autogaudi's light modules (never torch): the
options are validated, then exported to the environment together with ``AUTOGAUDI=1`` and the
bootstrap folder on ``PYTHONPATH``, so child processes (torchrun workers) are optimized too.
"""

from __future__ import annotations

import argparse
import builtins
import importlib.machinery
import importlib.util
import io
import os
import signal
import sys
import types

from autogaudi import report_file, runtime
from autogaudi._frames import strip_own_frames
from autogaudi._paths import bootstrap_dir
from autogaudi._version import __version__
from autogaudi.cache import refusal as cache_refusal
from autogaudi.errors import OptionsError
from autogaudi.options import OPTIONS, Options, parse_bool
from autogaudi.registry import UNITS

PROG = "python -m autogaudi"
_replaced_main_modules = []  # the launcher's own __main__, kept alive after the script replaces it
# Process launchers run under `python -m autogaudi -m ...`: their own process only starts and
# watches workers, which inherit autogaudi through the environment; it trains nothing, so autogaudi
# stays off in it (a session there cost 0.13 s of a 7 s two-rank run on the 2-core CPU, for nothing).
PROCESS_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")
_VALUE_FLAGS = {option.flag for option in OPTIONS if not option.is_switch}


def build_parser() -> argparse.ArgumentParser:
    units = "\n".join(f"  {unit.name:<22} {unit.summary}" for unit in UNITS)
    env = "\n".join(f"  {option.env:<24} same as {option.flag}" for option in OPTIONS)
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [options] (script.py | -m module) [args ...]",
        description="Run an unmodified PyTorch training script with the optimizations that suit the "
        "hardware it finds (Intel Gaudi, CUDA or CPU), then report what was applied and why.",
        epilog=f"optimization units (switch off with --disable, restrict with --only):\n{units}\n\n"
        f"environment (CLI flags win over it; enable(**kwargs) wins over both):\n"
        f"  {'AUTOGAUDI=1':<24} enable in any Python process, without the launcher\n{env}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # a prefix is refused, never taken for the option it starts (split_command_line knows whole flags only)
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"autogaudi {__version__}")
    for option in OPTIONS:
        if option.is_switch:
            parser.add_argument(
                option.flag, dest=option.name, action="store_const", const=True, default=None, help=option.help
            )
        else:
            parser.add_argument(option.flag, dest=option.name, default=None, metavar=option.metavar, help=option.help)
    return parser


def split_command_line(argv: list, value_flags=_VALUE_FLAGS):
    """Split ``argv`` into (our options, target, target's args, is_module) like python does.

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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:  # a script called "doctor" runs as ./doctor
        from autogaudi.diagnosis.command import main as doctor_main

        return doctor_main(argv[1:])
    if argv[:1] == ["cache"]:  # likewise ./cache
        from autogaudi.cache import main as cache_main

        return cache_main(argv[1:])
    ours, target, target_args, is_module = split_command_line(argv)
    parser = build_parser()
    given = {name: value for name, value in vars(parser.parse_args(ours)).items() if value is not None}
    if target is None:
        parser.error("give a script to run, or -m module")
    try:
        options = Options.from_env().replace(**given)
        report_file.check(options.report)
    except OptionsError as error:
        parser.error(str(error))
    refused = cache_refusal(options)  # evicting there would delete the user's files: before the script starts
    if refused:
        parser.error(refused)
    if options.report is not None:  # children (torchrun workers) write where this folder says, too
        given["report"] = report_file.resolved(options.report)
        options = options.replace(report=given["report"])
    _export_to_children(options, given)
    if not (is_module and target in PROCESS_LAUNCHERS):
        runtime.enable_with_source(given, "launcher")
    return run_as_main(target, target_args, is_module)


def _export_to_children(options: Options, given: dict) -> None:
    """Let every Python process started below this one enable autogaudi with the same options.
    A malformed ``AUTOGAUDI`` is refused here, before the script, as a bad option is."""
    try:
        parse_bool("AUTOGAUDI", os.environ.get("AUTOGAUDI", ""))
    except OptionsError as error:
        build_parser().error(f"environment: {error}")
    os.environ.update(options.env_overrides(given))
    os.environ["AUTOGAUDI"] = "1"
    folder = bootstrap_dir()
    path = os.environ.get("PYTHONPATH", "")
    if folder not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = folder + (os.pathsep + path if path else "")


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
