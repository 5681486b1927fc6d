"""Where a whole run's difference from plain goes: start, loop, exit and the interpreter's teardown.

    python benchmarks/phases.py [--pairs 6] [--cwd DIR] script.py args...

``against_plain.py`` says whether a report's "against plain" lies within what whole-process pairs
measure; where it does not, this says in which phase the rest is. Plain and ``python -m autogaudi
--quiet --report`` run the script in interleaved pairs (one warm-up pair first, a shared cache folder:
the later runs follow remembered decisions, as a user's second run does), each under a probe that
marks wall and CPU time at torch's import, the first and last optimizer step and its own ``atexit``
(registered first, so it runs after autogaudi's report); the parent reads the process's CPU, its
children's included, as ``against_plain.py`` reads it. Per phase, the medians and autogaudi's less
plain's, beside the reports' own cost. Output folders the script writes are the script's business:
pass a fresh ``--cwd``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import against_plain  # noqa: E402  (benchmarks/ is not a package: its timed run)

TIMEOUT_S = 900.0  # one run

PROBE = """\
import atexit, json, os, runpy, sys, time
mark = lambda: (time.perf_counter(), time.process_time())
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
marks, steps = {"torch": mark()}, []
register_optimizer_step_post_hook(lambda *_: steps.append(mark()))
mode, report, script, *rest = sys.argv[1:]
def dump():
    marks["atexit_end"], marks["first"], marks["last"] = mark(), steps[0], steps[-1]
    with open(os.environ["PHASES_OUT"], "w") as out:
        json.dump(marks, out)
atexit.register(dump)  # registered first: runs after autogaudi's exit
if mode == "plain":
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")
else:
    sys.argv = ["autogaudi", "--quiet", "--report", report, script, *rest]
    runpy.run_module("autogaudi", run_name="__main__", alter_sys=True)
"""


def one_run(mode: str, command: list, cwd: Path, scratch: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGAUDI")}
    env.update(PHASES_OUT=str(scratch / "phases.json"), AUTOGAUDI_CACHE_DIR=str(scratch / "cache"))
    report = scratch / "report.json"
    probe = [sys.executable, "-c", PROBE, mode, str(report), *command]
    wall, cpu, _ = against_plain.timed_run(probe, env, cwd, TIMEOUT_S, result=r"(?!)")  # CPU: children's too
    marks = json.loads((scratch / "phases.json").read_text())
    figures = {
        "start_cpu_s": marks["first"][1] - marks["torch"][1],  # the script's set-up and autogaudi's start
        "loop_wall_s": marks["last"][0] - marks["first"][0],
        "loop_cpu_s": marks["last"][1] - marks["first"][1],
        "exit_cpu_s": marks["atexit_end"][1] - marks["last"][1],
        "teardown_cpu_s": cpu - marks["atexit_end"][1],  # after every atexit handler, children included
        "total_cpu_s": cpu,
        "wall_s": wall,
    }
    if mode == "autogaudi":
        figures["reported_cost_s"] = json.loads(report.read_text())["summary"]["whole_run"]["cost_s"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--cwd", type=Path, default=Path.cwd(), help="where the script runs (default: here)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the script and its arguments")
    args = parser.parse_args()
    runs = {"plain": [], "autogaudi": []}
    with tempfile.TemporaryDirectory(prefix="autogaudi-phases-") as folder:
        for pair in range(args.pairs + 1):
            for mode in ("plain", "autogaudi") if pair % 2 else ("autogaudi", "plain"):
                figures = one_run(mode, args.command, args.cwd, Path(folder))
                if pair:  # the first pair warms the disk and fills the cache
                    runs[mode].append(figures)
    for name in runs["plain"][0]:
        plain, ours = (statistics.median(run[name] for run in runs[mode]) for mode in ("plain", "autogaudi"))
        print(f"{name:15s} plain {plain:.3f}  autogaudi {ours:.3f}  difference {ours - plain:+.3f}")
    print(f"reported cost   {statistics.median(run['reported_cost_s'] for run in runs['autogaudi']):.3f}")


if __name__ == "__main__":
    main()
