"""``python -m autogaudi doctor [--steps N] [--json PATH] [--fail-on KINDS] (script.py | -m module) [args]``.

The script runs in this process as ``__main__``, exactly as under the launcher (same argv, path,
tracebacks), with autogaudi's optimizations off: the doctor observes only, so the steps it runs
compute what they would compute without it. The findings go to stderr after the script stops, the
JSON (schema ``autogaudi.doctor/1``) to ``--json``. Exit status 0 whatever was found (a report, not
a gate), 1 with ``--fail-on`` when a finding of a named kind is present, the script's own status
when it failed or exited before the steps were done.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from autogaudi.diagnosis.findings import KINDS
from autogaudi.entry import runtime
from autogaudi.entry.main_script import run_as_main, split_command_line

PROG = "python -m autogaudi doctor"
DEFAULT_STEPS = 20
VALUE_FLAGS = ("--steps", "--json", "--fail-on")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [--steps N] [--json PATH] [--fail-on KINDS] (script.py | -m module) [args ...]",
        description="Run a training script for a few steps, observing only, and list what would make it "
        "slow on Intel Gaudi: host syncs, dynamic shapes, graph blockers, unsupported dtypes, "
        "input stalls, tile sizes, bf16 readiness.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"optimizer steps to observe before stopping the script (default {DEFAULT_STEPS})",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the findings as JSON to PATH")
    parser.add_argument(
        "--fail-on",
        metavar="KINDS",
        default="",
        help="exit 1 if a finding of one of these comma-separated kinds is present "
        f"('all' for any); kinds: {', '.join(KINDS)}",
    )
    return parser


def _parse_fail_on(parser, text: str) -> set:
    kinds = {kind.strip() for kind in text.split(",") if kind.strip()}
    if "all" in kinds:
        return set(KINDS)
    unknown = sorted(kinds - set(KINDS))
    if unknown:
        parser.error(f"--fail-on: unknown kind(s) {', '.join(unknown)}; valid: all, {', '.join(KINDS)}")
    return kinds


def main(argv: list) -> int:
    ours, target, target_args, is_module = split_command_line(argv, VALUE_FLAGS)
    parser = build_parser()
    args = parser.parse_args(ours)
    if target is None:
        parser.error("give a script to diagnose, or -m module")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, not {args.steps}")
    fail_on = _parse_fail_on(parser, args.fail_on)
    diagnosis, status = diagnose(target, target_args, steps=args.steps, is_module=is_module)
    sys.stderr.write(diagnosis.format())
    sys.stderr.flush()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(diagnosis.as_dict(), handle, indent=2)
            handle.write("\n")
    if status:
        return status
    return 1 if diagnosis.kinds() & fail_on else 0


def diagnose(target: str, args: list, steps: int, is_module: bool = False):
    """(Diagnosis, the script's exit status) after running ``target`` for at most ``steps`` steps."""
    runtime.disable()  # AUTOGAUDI=1 in the environment must not optimize what the doctor observes
    os.environ.pop("AUTOGAUDI", None)
    import torch  # noqa: F401  (the observer hooks torch before the script runs)

    from autogaudi.diagnosis.observer import Observer, StopDiagnosis
    from autogaudi.diagnosis.result import Diagnosis

    observer = Observer(steps)
    observer.script = None if is_module else os.path.abspath(target)
    saved = sys.argv[:], sys.modules.get("__main__"), sys.path[0] if sys.path else None
    observer.install()
    status, exited = 0, False
    try:
        with observer.watcher:
            status = run_as_main(target, args, is_module, stopped_by=(StopDiagnosis,))
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        exited = True
    finally:
        observer.uninstall()
        sys.argv[:] = saved[0]
        sys.modules["__main__"] = saved[1]
        if saved[2] is not None:
            sys.path[0] = saved[2]
    if observer.steps >= steps:
        outcome = "stopped"
    else:
        outcome = ("exited" if exited else "raised") if status else "finished"
    return Diagnosis(target, steps, observer, outcome, status), status
