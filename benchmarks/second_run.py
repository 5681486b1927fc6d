"""What the cache saves: each case run twice in fresh processes sharing one new cache folder.

    python benchmarks/second_run.py [--corpus ../shared/corpus] [--out benchmarks/results/second-run-<machine>.json]

Cases:

- ``w3_cnn, capture forced``: W3 under ``--force graph_capture`` (the capture path a GPU takes by
  measurement): the capture's one-off (set-up, first compile, later compiles, stopping compile workers:
  graph_capture's figures) and the whole run, first and second run.
- ``mingpt-chargpt, capture forced``: the corpus GPT case, copied unmodified, under the corpus harness's
  ``capture forced`` variant; the same figures.
- ``w1_mlp, --trial graph_capture``: a capture the trial rejects on a CPU: the second run should start
  no trial (only the check of the remembered decision) and run at the rate of ``--disable graph_capture``
  from its first steps; that run is measured beside it.

Every run gets ``--report``; figures come from autogaudi's JSON report and the wall clock around the
process. The first run of each pair starts with an empty cache folder (nothing remembered, nothing
compiled): a user's first run of the day after ``cache clear``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import corpus  # noqa: E402
import run as suite  # noqa: E402

from autogaudi.optimizations.graph_capture.unit import ONE_OFF_PARTS  # noqa: E402


def graph_capture_row(report: dict) -> dict:
    return next(row for row in report["units"] if row["name"] == "graph_capture")


def one_off_s(report: dict) -> float:
    """graph_capture's one-off this run; a trial's record, where it ran one, holds the same parts."""
    figures = graph_capture_row(report)["figures"]
    return round(sum(figures.get(part, 0.0) for part in ONE_OFF_PARTS), 3)


def timed(command: list, cwd: Path, env: dict, report: Path) -> dict:
    began = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        sys.exit(f"{' '.join(map(str, command))} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    data = json.loads(report.read_text())
    row = graph_capture_row(data)
    return {
        "seconds": round(seconds, 2),
        "one_off_s": one_off_s(data),
        "compile_cache": row["figures"].get("compile_cache"),
        "graph_capture": row["reason_code"],
        "profile": next(r for r in data["units"] if r["name"] == "step_profiler")["reason_code"],
        "trials": [
            {key: record.get(key) for key in ("check", "decision", "speedup", "ratio") if key in record}
            for record in data["trials"]
        ],
        "steps_per_s": data["steps"].get("steps_per_s"),
        "cache": (data["cache"] or {}).get("decisions"),
    }


def pair(name: str, command: list, cwd: Path, env: dict, scratch: Path) -> dict:
    """The command twice, sharing a cache folder that starts empty."""
    env = {**env, "AUTOGAUDI_CACHE_DIR": str(scratch / f"{name}-cache")}
    runs = []
    for index in (1, 2):
        report = scratch / f"{name}-{index}.json"
        runs.append(timed([sys.executable, *command[:2], "--report", str(report), *command[2:]], cwd, env, report))
    first, second = runs
    ratio = round(second["one_off_s"] / first["one_off_s"], 3) if first["one_off_s"] else None
    return {"first": first, "second": second, "second_one_off_over_first": ratio}


def w3_capture_forced(env: dict, scratch: Path, corpus_folder: Path, short: list) -> dict:
    w3 = [str(HERE / "workloads" / "cnn.py"), *short]
    return pair("w3", ["-m", "autogaudi", "--quiet", "--force", "graph_capture", *w3], HERE, env, scratch)


def gpt_capture_forced(env: dict, scratch: Path, corpus_folder: Path, short: list) -> dict:
    (case,) = corpus.load_cases([corpus_folder], "cpu", ["mingpt-chargpt"])
    if short:
        case = corpus.shortened(case)
    copy = scratch / "corpus"
    shutil.copytree(corpus_folder, copy, ignore=shutil.ignore_patterns("__pycache__"))
    gpt_env = {**corpus.clean_env(case, "capture forced"), "AUTOGAUDI_NO_CACHE": "0"}
    for command in case.get("setup", ()):  # as the corpus harness does (the GPT's input text)
        subprocess.run([sys.executable, *command], cwd=copy / case["dir"], env=gpt_env, check=True, timeout=600)
    return pair("gpt", [*corpus.VARIANTS["capture forced"], *case["command"]], copy / case["dir"], gpt_env, scratch)


def w1_trial(env: dict, scratch: Path, corpus_folder: Path, short: list) -> dict:
    w1 = [str(HERE / "workloads" / "mlp.py"), *short]
    decisions = pair("w1", ["-m", "autogaudi", "--quiet", "--trial", "graph_capture", *w1], HERE, env, scratch)
    report = scratch / "w1-disabled.json"
    decisions["graph_capture disabled"] = timed(
        [sys.executable, "-m", "autogaudi", "--report", str(report), "--quiet", "--disable", "graph_capture", *w1],
        HERE,
        {**env, "AUTOGAUDI_NO_CACHE": "1"},
        report,
    )
    return decisions


# --short: arguments after each workload.
SHORT = ["--steps", "30", "--warmup", "10"]
# --cases NAME: (the case's title in the results, what runs it)
CASES = {
    "w3": ("w3_cnn, capture forced", w3_capture_forced),
    "gpt": ("mingpt-chargpt, capture forced", gpt_capture_forced),
    "w1": ("w1_mlp, --trial graph_capture", w1_trial),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=corpus.DEFAULT_CORPUS)
    parser.add_argument("--out", type=Path, default=HERE / "results" / f"second-run-{suite.machine_name()}.json")
    parser.add_argument(
        "--cases", type=lambda text: text.split(","), help=f"comma-separated (default: all): {','.join(CASES)}"
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help=f"a dry run of the harness: workloads with {' '.join(SHORT)}, the corpus case with corpus.py's --short",
    )
    arguments = parser.parse_args(argv)
    chosen = arguments.cases or list(CASES)
    unknown = sorted(set(chosen) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; valid: {', '.join(CASES)}")
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="autogaudi-second-run-"))
    results = {"machine": suite.machine_name(), "cases": {}}
    env = {key: value for key, value in suite.clean_env().items() if key != "AUTOGAUDI_CACHE_DIR"}
    try:
        for name in chosen:
            title, run_case = CASES[name]
            results["cases"][title] = run_case(env, scratch, arguments.corpus, SHORT if arguments.short else [])
            arguments.out.write_text(json.dumps(results, indent=2) + "\n")  # after each case: a cut run keeps it
            arguments.out.with_suffix(".md").write_text(markdown(results))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(markdown(results))
    return 0


def markdown(results: dict) -> str:
    lines = [
        f"# Second run, {results['machine']}",
        "",
        "Each case twice in fresh processes sharing a cache folder that starts empty "
        "(`benchmarks/second_run.py`). One-off: graph_capture's set-up, first compile, later compiles "
        "and compile-worker shutdown in that run. steps/s: the report's, over every step after the 3 warm-up "
        "steps (a compile inside them included).",
        "",
        *([results["notes"], ""] if results.get("notes") else []),
        "| case | run | whole run (s) | one-off (s) | compile cache | steps/s | graph_capture | profile | trials |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, case in results["cases"].items():
        for label in ("first", "second", "graph_capture disabled"):
            if label not in case:
                continue
            run = case[label]
            trials = "; ".join(
                f"{'check ' if record.get('check') else 'trial '}{record.get('decision')}" for record in run["trials"]
            )
            lines.append(
                f"| {name} | {label} | {run['seconds']} | {run['one_off_s']} | {run['compile_cache'] or '-'} | "
                f"{run['steps_per_s']} | "
                f"`{run['graph_capture']}` | `{run['profile']}` | {trials or '-'} |"
            )
        if case.get("second_one_off_over_first") is not None:
            lines.append(f"| {name} | second / first one-off | | **{case['second_one_off_over_first']}x** | | | | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
