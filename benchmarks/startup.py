"""What autogaudi's start and report add to a short run: one training step of a tiny model.

    python benchmarks/startup.py [--rounds 10] [--out benchmarks/results/startup-<machine>.json]

Two measures, each over ``--rounds`` fresh processes after one warm-up:

- *whole*: ``python -m autogaudi --quiet one_step.py`` against ``python one_step.py`` in
  interleaved pairs (the order alternating each round, so a machine getting slower or faster
  weighs on both alike): each one's median wall and CPU (user + system) milliseconds, and the
  median, minimum and maximum of the pairs' differences. On a busy machine the runs' own spread
  (importing torch and its compiler: seconds) hides a difference of tens of milliseconds. So the
  pairs are also split by phase, from CPU times the script marks: before ``import torch`` (under
  autogaudi its launcher), torch's import (and autogaudi's session, which starts inside it), the
  step, and the exit with the interpreter's teardown; a phase where autogaudi works reads more in
  pair after pair even where the totals cannot tell.
- *parts*: in one process that imported torch first (so what torch imports itself is not counted),
  the wall and CPU milliseconds of importing the launcher's modules, of starting the session, and of
  the exit report: autogaudi's own work, short enough to read on a busy machine (its CPU time best).
  What autogaudi adds inside the script's own calls (the first optimizer step's checks) is not in
  the parts: only the pairs see it.

The load average before and after is written beside the figures: on a shared machine it says how
much the pairs' spread can be trusted.

``--instructions``: where the pairs cannot resolve the budget (torch's import moves by hundreds of
milliseconds on a 2-core machine, busy or not), each command also runs once under valgrind's
callgrind, which counts the instructions each phase executes on the main thread: the same count run
after run (plain against itself differs by under 0.1% per phase). The main thread's only, where
autogaudi's work runs: torch's worker threads spin while they wait, longer on a busy machine (beside
a test suite, a whole run counted 70 million more). The script's marks call
``os.getpgrp()``, a syscall nothing else here makes, and callgrind dumps its count before each; the
added instructions of each phase are turned into milliseconds at plain's own rate in that phase (its
median CPU milliseconds over its instructions), an estimate: autogaudi's code need not run at the
rate of the code it is beside. ``--check`` reads this estimate where it was measured. Beside it, the
added instructions outside Python's garbage collector: the collector runs where allocations cross its
thresholds, so a start allocating a little more or less moves a full collection to another moment of
the run, and the total with it, by millions either way; outside it the count follows the work far more
closely (the allocator's own paths still move it by two or three million).

The budget lives here, not in a test that pins which modules a start imports: ``--check`` exits 1
where the pairs' median wall difference is over ``BUDGET_MS`` (read it on a quiet machine: on a busy
one the pairs' spread is wider than the budget, and the verdict says so instead of failing).

One cache folder serves every autogaudi run, as a user's own runs share theirs. Both run with the
bytecode of autogaudi's modules as Python last wrote it: where ``PYTHONDONTWRITEBYTECODE`` is set and
nothing was compiled, each run compiles every module again (``python -m compileall autogaudi`` first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUDGET_MS = 25.0  # what autogaudi may add to a one-step script's whole run, median of the pairs

ONE_STEP = """\
import os, time
began = time.process_time()  # the interpreter's start, and under autogaudi its launcher's
os.getpgrp()  # each mark: where callgrind counts up to (--instructions)
import torch
imported = time.process_time()  # under autogaudi, its session's start too
os.getpgrp()
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(4, 8)).pow(2).mean()
loss.backward()
optimizer.step()
optimizer.zero_grad()
os.getpgrp()
if os.environ.get("STARTUP_MARKS"):
    with open(os.environ["STARTUP_MARKS"], "w") as marks:
        marks.write(f"{began} {imported} {time.process_time()}")
"""
PHASES = ("before_torch", "torch_import", "step", "exit_and_teardown")

PARTS = """\
import json, sys, time
import torch  # first: the modules torch imports itself are not autogaudi's cost

marks = [(time.perf_counter(), time.process_time())]
import autogaudi.entry.launcher  # noqa: E402,F401  (what `python -m autogaudi` imports before the script)
from autogaudi.entry import runtime

marks.append((time.perf_counter(), time.process_time()))
runtime.enable_with_source({"quiet": True}, "launcher")  # torch is in: the session starts now
marks.append((time.perf_counter(), time.process_time()))
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), {"__name__": "__main__"})
marks.append((time.perf_counter(), time.process_time()))
runtime.report_at_exit()
marks.append((time.perf_counter(), time.process_time()))
runtime.disable()
parts = {"import": marks[1], "start": marks[2], "report": marks[4]}
before = {"import": marks[0], "start": marks[1], "report": marks[3]}
print(json.dumps({f"{name}_{kind}_ms": 1000 * (parts[name][index] - before[name][index])
                  for name in parts for index, kind in enumerate(("wall", "cpu"))}))
"""


def timed(command: list, env: dict) -> tuple:
    """(wall ms, CPU ms, CPU ms by phase) of one run of ``command``, which must exit 0. The phases
    (:data:`PHASES`) come from the CPU times the one-step script marks (``STARTUP_MARKS``) and the
    process's own at its end."""
    marks = Path(env["STARTUP_MARKS"])
    marks.unlink(missing_ok=True)  # a run that wrote none must not read the run before's
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    stderr = process.stderr.read().decode(errors="replace")
    process.stderr.close()
    if process.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({process.returncode}):\n{stderr[-4000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    began, imported, stepped = (float(mark) for mark in marks.read_text().split())
    phases = dict(zip(PHASES, (began, imported - began, stepped - imported, cpu - stepped)))
    return wall * 1000, cpu * 1000, {name: seconds * 1000 for name, seconds in phases.items()}


def counted(command: list, env: dict, out: Path) -> subprocess.Popen:
    """``command`` started under callgrind, counting each thread's instructions until each of the
    script's marks (the main thread's in ``out.1-01`` to ``out.3-01``) and to the exit (``out-01``)."""
    valgrind = ["valgrind", "--tool=callgrind", "--separate-threads=yes", "--dump-before=os_getpgrp*"]
    valgrind.append(f"--callgrind-out-file={out}")
    env = {**env, "PYTHONHASHSEED": "0"}  # the same dict layouts, run after run
    return subprocess.Popen(valgrind + command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def phase_files(out: Path) -> list:
    """:func:`counted`'s files of the main thread, one per phase (:data:`PHASES`), in order."""
    files = [Path(f"{out}.{index}-01") for index in (1, 2, 3)] + [Path(f"{out}-01")]
    if Path(f"{out}.4-01").exists() or not all(path.exists() for path in files):
        raise RuntimeError(f"callgrind did not dump once at each of the script's three marks: {out}")
    return files


def phase_instructions(out: Path) -> dict:
    """The main thread's instructions in each phase (:data:`PHASES`) from :func:`counted`'s files."""
    counts = []
    for path in phase_files(out):
        summary = next(line for line in path.read_text().splitlines() if line.startswith(("summary:", "totals:")))
        counts.append(int(summary.split()[1]))
    return dict(zip(PHASES, counts))


def phase_collector_instructions(out: Path) -> dict:
    """Of :func:`phase_instructions`, those inside Python's garbage collector (``gc_collect_main`` and
    what it calls), by phase, from ``callgrind_annotate``'s inclusive counts."""
    counts = []
    for path in phase_files(out):
        annotated = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        lines = [line.split()[0] for line in annotated.splitlines() if ":gc_collect_main [" in line]
        counts.append(int(lines[0].replace(",", "")) if lines else 0)
    return dict(zip(PHASES, counts))


def instructions(commands: dict, env: dict, folder: Path) -> dict:
    """Each command's instructions by phase, both run at once (a count does not depend on the load),
    and under ``"collector"`` those of them inside the garbage collector."""
    runs = {name: counted(command, env, folder / f"{name}.callgrind") for name, command in commands.items()}
    for name, process in runs.items():
        _, stderr = process.communicate()
        if process.returncode != 0:
            sys.exit(f"callgrind's run of {name} failed ({process.returncode}):\n{stderr[-4000:]}")
    counts = {name: phase_instructions(folder / f"{name}.callgrind") for name in commands}
    counts["collector"] = {name: phase_collector_instructions(folder / f"{name}.callgrind") for name in commands}
    return counts


def instructions_added(counts: dict, plain_cpu_ms: dict) -> dict:
    """autogaudi's instructions over plain's, by phase and in all, and each phase's in milliseconds at
    plain's rate in that phase (``plain_cpu_ms``: plain's median CPU milliseconds by phase); where the
    collector's were counted, the added instructions outside it (why: the module's docstring)."""
    ours, plain = counts["autogaudi"], counts["plain"]
    added = {phase: ours[phase] - plain[phase] for phase in PHASES}
    added_ms = {phase: added[phase] * plain_cpu_ms[phase] / plain[phase] for phase in PHASES}
    figures = {
        **counts,
        "added": {**added, "all": sum(added.values())},
        "added_ms_at_plain_rate": {**added_ms, "all": sum(added_ms.values())},
    }
    if "collector" in counts:
        collected = counts["collector"]
        outside = {
            phase: added[phase] - (collected["autogaudi"][phase] - collected["plain"][phase]) for phase in PHASES
        }
        figures["added_outside_collector"] = {**outside, "all": sum(outside.values())}
    return figures


def spread(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(rounds: int, python: str, count_instructions: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="autogaudi-startup-") as folder:
        script = Path(folder) / "one_step.py"
        script.write_text(ONE_STEP)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGAUDI")}
        env["AUTOGAUDI_CACHE_DIR"] = str(Path(folder) / "cache")
        env["STARTUP_MARKS"] = str(Path(folder) / "marks")
        commands = {
            "autogaudi": [python, "-m", "autogaudi", "--quiet", str(script)],
            "plain": [python, str(script)],
        }
        runs = {name: [] for name in commands}
        for round_ in range(rounds + 1):
            order = list(commands) if round_ % 2 else list(reversed(commands))
            results = {name: timed(commands[name], env) for name in order}
            if round_:  # the first pair warms the disk cache and fills autogaudi's cache folder
                for name, figures in results.items():
                    runs[name].append(figures)
        counts = instructions(commands, env, Path(folder)) if count_instructions else None
        parts = []
        for round_ in range(rounds + 1):
            result = subprocess.run([python, "-c", PARTS, str(script)], env=env, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"the parts probe failed ({result.returncode}):\n{result.stderr[-4000:]}")
            if round_:
                parts.append(json.loads(result.stdout.splitlines()[-1]))
    figures = {"parts": {name: spread([run[name] for run in parts]) for name in parts[0]}}
    for kind in ("wall", "cpu"):
        total = [sum(value for name, value in run.items() if f"_{kind}_" in name) for run in parts]
        figures["parts"][f"total_{kind}_ms"] = {**spread(total), "by_round": total}
    figures["phases_cpu_ms"] = phases_added(runs["autogaudi"], runs["plain"])
    if counts is not None:
        plain_cpu_ms = {phase: statistics.median(run[2][phase] for run in runs["plain"]) for phase in PHASES}
        figures["instructions"] = instructions_added(counts, plain_cpu_ms)
    for index, figure in enumerate(("wall_ms", "cpu_ms")):
        added = [ours[index] - plain[index] for ours, plain in zip(runs["autogaudi"], runs["plain"])]
        figures[figure] = {
            "autogaudi": spread([run[index] for run in runs["autogaudi"]]),
            "plain": spread([run[index] for run in runs["plain"]]),
            "added": spread(added),
            "added_by_round": added,
        }
    return figures


def phases_added(ours: list, plain: list) -> dict:
    """Per phase, the pairs' CPU milliseconds autogaudi's run took over plain's (median, minimum,
    maximum) and in how many pairs more: a phase where autogaudi works reads the same way pair after
    pair, while the pairs' totals carry torch's own import spread (hundreds of milliseconds)."""
    figures = {}
    for phase in PHASES:
        added = [run[2][phase] - other[2][phase] for run, other in zip(ours, plain)]
        figures[phase] = {**spread(added), "more_in": sum(value > 0 for value in added), "pairs": len(added)}
    return figures


def verdict(figures: dict, budget_ms: float = BUDGET_MS) -> str:
    """ "within" or "over": the counted instructions' milliseconds against the budget, where counted;
    else the pairs' median added wall milliseconds, or "unresolved" where their differences spread
    wider than the budget on both sides of it (a busy machine)."""
    if "instructions" in figures:
        return "within" if figures["instructions"]["added_ms_at_plain_rate"]["all"] <= budget_ms else "over"
    added = figures["wall_ms"]["added"]
    if (
        added["median"] > budget_ms
        and added["min"] < budget_ms < added["max"]
        and added["max"] - added["min"] > 4 * budget_ms
    ):
        return "unresolved"
    return "within" if added["median"] <= budget_ms else "over"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved pairs counted (default 10)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter both commands run under")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--check", action="store_true", help=f"exit 1 where over the {BUDGET_MS:g} ms budget")
    parser.add_argument(
        "--instructions", action="store_true", help="also count each phase's instructions under valgrind (minutes)"
    )
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    figures = measure(args.rounds, args.python, args.instructions)
    figures["load_1min"] = {"before": load_before, "after": os.getloadavg()[0]}  # the machine's, as uptime says
    print(
        f"parts, median (min-max) ms over {args.rounds} processes: "
        + ", ".join(f"{name} {v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f})" for name, v in figures["parts"].items())
    )
    for figure in ("wall_ms", "cpu_ms"):
        parts = figures[figure]
        line = ", ".join(
            f"{name} {parts[name]['median']:.1f} ({parts[name]['min']:.1f}-{parts[name]['max']:.1f})"
            for name in ("autogaudi", "plain", "added")
        )
        print(f"{figure}: median (min-max) over {args.rounds} pairs: {line}")
    print(
        "CPU ms over plain by phase, median (min-max; pairs where more): "
        + ", ".join(
            f"{name} {v['median']:+.1f} ({v['min']:+.1f}-{v['max']:+.1f}; {v['more_in']}/{v['pairs']})"
            for name, v in figures["phases_cpu_ms"].items()
        )
    )
    if "instructions" in figures:
        added, added_ms = figures["instructions"]["added"], figures["instructions"]["added_ms_at_plain_rate"]
        print(
            "instructions over plain by phase (millions; ms at plain's rate): "
            + ", ".join(f"{name} {added[name] / 1e6:+.1f} ({added_ms[name]:+.1f})" for name in (*PHASES, "all"))
        )
        outside = figures["instructions"]["added_outside_collector"]
        print(
            "of them outside the garbage collector (millions): "
            + ", ".join(f"{name} {outside[name] / 1e6:+.1f}" for name in (*PHASES, "all"))
        )
    said = verdict(figures)
    load = figures["load_1min"]
    print(f"load average (1 min) {load['before']:.2f} before, {load['after']:.2f} after")
    print(f"budget {BUDGET_MS:g} ms over plain: {said}")
    if args.out:
        args.out.write_text(
            json.dumps({"rounds": args.rounds, "budget_ms": BUDGET_MS, "verdict": said, **figures}, indent=2) + "\n"
        )
    if args.check and said == "over":
        sys.exit(1)


if __name__ == "__main__":
    main()
