"""Whether the report's "against plain" is what a user measures: plain beside autogaudi, whole processes.

    python benchmarks/against_plain.py [--cases regression,...] [--pairs 5] [--control] [--short] [--out FILE.json]

For each corpus case (benchmarks/corpus.py's manifests: the shared corpus and this folder's), plain
and ``python -m autogaudi --quiet --report`` run in interleaved pairs (the order alternating each
pair, one warm-up pair first, so the cache is warm and a machine growing slower weighs on both
alike) in one copy of the case's folder. Each pair gives what the user pays: autogaudi's wall time
less plain's. Each autogaudi run's report says what it thinks it paid (``-net_s`` of its
``whole_run``: start, per-call work, measuring and trials, less what its changes saved) and that
figure's noise. A claim is within the pairs where the claim, give or take its noise, meets their
range of differences (minimum to maximum), or where the report stated no figure (within its noise);
the case agrees where every run's claim is within: a claim outside what the pairs measured is a report
that misses (or invents) a cost. ``benchmarks/quickstart.py`` judges its reports by the same rule.

``--control`` runs plain once more in every round (the three runs in a rotating order): the
differences between plain's two runs are what the machine alone moves a pair by in the same minutes,
the floor under which autogaudi's difference says nothing (a difference within the control's range
is "unresolved").

Two checks on the pairs themselves: each pair's CPU seconds (user and system, the process and its
children), which a loaded machine inflates far less than wall time (a process that waits for a core
pays its CPU seconds many times over in wall time); and whether both runs of a pair printed the same
result line (the case's ``result``): an unseeded script (``regression`` draws its data unseeded and
runs until its loss is small) does other work in each run, and such a pair measures the script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import corpus  # noqa: E402  (benchmarks/ is not a package)


def claim_of(report: dict) -> dict:
    """What the report says autogaudi cost the run against plain: ``slower_s`` (negative: it saved; None
    where not known), its ``noise_s`` (None: not known) and whether a figure was ``stated`` (a saving
    within its noise is not)."""
    whole_run = report["summary"]["whole_run"]
    net = whole_run["net_s"]
    return {
        "slower_s": None if net is None else -net,
        "noise_s": whole_run.get("noise_s"),
        "stated": whole_run.get("claimed", True),
    }


def claim_within(claim: dict, differences: list):
    """Whether one report's claim lies within the pairs' differences (autogaudi less plain, seconds):
    not stated (within its noise), or the claim give or take its noise meets their range; None where
    the report knew no figure."""
    if not claim["stated"]:
        return True
    if claim["slower_s"] is None:
        return None
    noise = claim["noise_s"] or 0.0
    return claim["slower_s"] - noise <= max(differences) and claim["slower_s"] + noise >= min(differences)


def spread_of(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def judge(differences: list, claims: list) -> dict:
    """The pairs' measured differences (autogaudi less plain, seconds) against the reports' claims."""
    within = [claim_within(claim, differences) for claim in claims]
    known = [claim["slower_s"] for claim in claims if claim["slower_s"] is not None]
    return {
        "measured_s": spread_of(differences),
        "claimed_s": statistics.median(known) if known else None,
        "claims_within": within,
        "agrees": None if all(value is None for value in within) else all(value is not False for value in within),
    }


def resolved(differences: list, control: list) -> bool:
    """Whether autogaudi's median difference lies outside what plain against plain moved in the same
    rounds (the control's minimum to maximum)."""
    median = statistics.median(differences)
    return not min(control) <= median <= max(control)


def children_cpu_s() -> float:
    """CPU seconds (user and system) of every child process waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_run(command: list, env: dict, folder: Path, timeout: float, result: str) -> tuple:
    """(wall seconds, CPU seconds, the last line matching ``result`` or None) of one run."""
    began, cpu_began = time.perf_counter(), children_cpu_s()
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
    seconds, cpu_s = time.perf_counter() - began, children_cpu_s() - cpu_began
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    lines = [match.group(0) for match in re.finditer(result, done.stdout + done.stderr)]
    return seconds, cpu_s, lines[-1] if lines else None


def measure_case(case: dict, pairs: int, scratch: Path, timeout: float, control: bool = False) -> dict:
    copy = scratch / case["name"]
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(case["corpus"], copy, ignore=shutil.ignore_patterns("__pycache__"))
    folder = copy / case["dir"]
    corpus.run_setup(case, folder)
    report = scratch / f"{case['name']}-report.json"
    cache = scratch / f"{case['name']}-cache"
    commands = {
        "plain": ([sys.executable, *case["command"]], corpus.clean_env(case, "plain")),
        "autogaudi": (
            [sys.executable, "-m", "autogaudi", "--quiet", "--report", str(report), *case["command"]],
            {**corpus.clean_env(case, "autogaudi"), "AUTOGAUDI_NO_CACHE": "0", "AUTOGAUDI_CACHE_DIR": str(cache)},
        ),
    }
    if control:
        commands["plain again"] = commands["plain"]
    differences, cpu_differences, control_differences, claims = [], [], [], []
    walls = {name: [] for name in commands}
    unlike = 0  # pairs whose two runs printed different results
    for pair in range(pairs + 1):
        names = list(commands)
        order = names[pair % len(names) :] + names[: pair % len(names)] if control else names[:: 1 if pair % 2 else -1]
        runs = {name: timed_run(*commands[name], folder, timeout, case["result"]) for name in order}
        if pair:  # the first pair warms the disk cache and fills autogaudi's cache folder
            differences.append(runs["autogaudi"][0] - runs["plain"][0])
            cpu_differences.append(runs["autogaudi"][1] - runs["plain"][1])
            if control:
                control_differences.append(runs["plain again"][0] - runs["plain"][0])
            unlike += runs["autogaudi"][2] != runs["plain"][2]
            claims.append(claim_of(json.loads(report.read_text())))
            for name, (seconds, _cpu_s, _result) in runs.items():
                walls[name].append(seconds)
    medians = {name: statistics.median(values) for name, values in walls.items()}
    result = {
        "case": case["name"],
        "pairs": pairs,
        "wall_s": medians,
        "ratio_plain_over_autogaudi": round(medians["plain"] / medians["autogaudi"], 3),
        "differences_s": [round(value, 3) for value in differences],
        "cpu_differences_s": [round(value, 3) for value in cpu_differences],
        "pairs_with_other_results": unlike,
        "claims": claims,
        **judge(differences, claims),
    }
    if control:
        result["control_differences_s"] = [round(value, 3) for value in control_differences]
        # the ratio plain's two arms read of each other: how far from 1.0 the machine alone moves one
        result["ratio_plain_over_plain_again"] = round(medians["plain"] / medians["plain again"], 3)
        result["resolved"] = resolved(differences, control_differences)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: every case that runs on the CPU)")
    parser.add_argument("--corpus", type=Path, default=corpus.DEFAULT_CORPUS, help="the shared corpus folder")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved pairs counted per case (default 5)")
    parser.add_argument("--short", action="store_true", help="the corpus's shortened commands (benchmarks/corpus.py)")
    parser.add_argument("--control", action="store_true", help="also run plain a second time in every round (A/A)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    corpora = [path for path in (args.corpus, HERE / "corpus_rl") if (path / "corpus.json").exists()]
    cases = corpus.load_cases(corpora, "cpu", args.cases.split(",") if args.cases else None)
    cases = [corpus.shortened(case) if args.short else case for case in cases]
    facts = {"machine": corpus.machine_name(), "date": time.strftime("%Y-%m-%d"), "commit": _commit()}  # the code run
    facts["load_1min_before"] = os.getloadavg()[0]  # a busy machine's pairs spread wide: say how busy
    results = []
    with tempfile.TemporaryDirectory(prefix="autogaudi-against-plain-") as folder:
        for case in cases:
            missing = corpus.missing_requirements(case)
            if missing:
                print(f"{case['name']}: skipped, needs {', '.join(missing)}")
                continue
            result = measure_case(case, args.pairs, Path(folder), args.timeout, args.control)
            result["load_1min_after"] = os.getloadavg()[0]
            results.append(result)
            measured, claimed = result["measured_s"], result["claimed_s"]
            print(
                f"{case['name']}: plain/autogaudi {result['ratio_plain_over_autogaudi']}x; autogaudi less plain "
                f"{measured['median']:+.3f} s ({measured['min']:+.3f} to {measured['max']:+.3f}) over {args.pairs} "
                f"pairs; the reports say {'not known' if claimed is None else f'{claimed:+.3f} s'}: "
                + {True: "within", False: "OUTSIDE", None: "not checked"}[result["agrees"]]
                + f"; CPU autogaudi less plain {statistics.median(result['cpu_differences_s']):+.3f} s"
                + (
                    f"; plain less plain {min(result['control_differences_s']):+.3f} to "
                    f"{max(result['control_differences_s']):+.3f} s "
                    f"(plain/plain {result['ratio_plain_over_plain_again']}x): "
                    + ("resolved" if result["resolved"] else "unresolved")
                    if args.control
                    else ""
                )
                + (
                    f"; {result['pairs_with_other_results']} pairs printed other results"
                    if result["pairs_with_other_results"]
                    else ""
                )
            )
    if args.out:
        args.out.write_text(
            json.dumps({**facts, "pairs": args.pairs, "control": args.control, "results": results}, indent=2) + "\n"
        )


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    return done.stdout.strip()


if __name__ == "__main__":
    main()
