"""``python -m autogaudi [options] (script.py | -m module) [args ...]``: run a script as if directly.

(``python -m autogaudi doctor ...`` is the doctor: :mod:`autogaudi.diagnosis.command`; ``python -m autogaudi
cache {list,clear}`` shows or clears what runs remember: :mod:`autogaudi.store.cache`.)

The user's program must not be able to tell it was launched through us: it runs as ``__main__``
as python would run it (:mod:`autogaudi.entry.main_script`).

Before the script starts, the launcher imports only autogaudi's light modules (never torch): the
options are validated, then exported to the environment together with ``AUTOGAUDI=1`` and the
bootstrap folder on ``PYTHONPATH``, so child processes (torchrun workers) are optimized too.
"""

from __future__ import annotations

import argparse
import os
import sys

from autogaudi._version import __version__
from autogaudi.core.errors import OptionsError
from autogaudi.core.options import OPTIONS, Options, parse_bool
from autogaudi.core.registry import UNITS
from autogaudi.entry import runtime
from autogaudi.entry.main_script import run_as_main, split_command_line
from autogaudi.entry.paths import bootstrap_dir
from autogaudi.measure import timeline
from autogaudi.store.cache import refusal as cache_refusal

PROG = "python -m autogaudi"
# Process launchers run under `python -m autogaudi -m ...`: their own process only starts and
# watches workers, which inherit autogaudi through the environment; it trains nothing, so autogaudi
# stays off in it (a session there cost 0.13 s of a 7 s two-rank run on the 2-core CPU, for nothing).
PROCESS_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")
VALUE_FLAGS = {option.flag for option in OPTIONS if not option.is_switch}


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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:  # a script called "doctor" runs as ./doctor
        from autogaudi.diagnosis.command import main as doctor_main  # here: the doctor loads only when asked for

        return doctor_main(argv[1:])
    if argv[:1] == ["cache"]:  # likewise ./cache
        from autogaudi.store.cache import main as cache_main  # here: as the doctor

        return cache_main(argv[1:])
    ours, target, target_args, is_module = split_command_line(argv, VALUE_FLAGS)
    # The parser reads our options and says usage errors and --help: without options (the plain
    # `python -m autogaudi train.py`) it is not built, a cost of the start (docs/benchmarks.md).
    parsed = vars(build_parser().parse_args(ours)) if ours else {}
    given = {name: value for name, value in parsed.items() if value is not None}
    if target is None:
        build_parser().error("give a script to run, or -m module")
    try:
        options = Options.from_env().replace(**given)
        if options.report is not None:  # children (torchrun workers) write where this folder says, too
            from autogaudi.reporting import output_file  # here: loaded only for a report, as runtime does

            output_file.check(options.report)
            given["report"] = output_file.resolved(options.report)
            options = options.replace(report=given["report"])
    except OptionsError as error:
        build_parser().error(str(error))
    refused = cache_refusal(options)  # evicting there would delete the user's files: before the script starts
    if refused:
        build_parser().error(refused)
    _export_to_children(options, given)
    if not (is_module and target in PROCESS_LAUNCHERS):
        runtime.enable_with_source(given, "launcher")
    timeline.entered_until_now()
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
