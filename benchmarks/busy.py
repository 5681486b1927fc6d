"""Decisions on a busy machine: corpus cases run plain and under autogaudi beside busy processes.

    python benchmarks/busy.py [--corpus DIR ...] [--cases a,b] [--busy 2] [--short] [--out PATH]

Users' machines are shared (a second job, data loading), so a decision that flips, or a trial that
overruns, when other processes take the cores is a bug. For each case, beside ``--busy`` processes
that spin (``python3 -c "while True: pass"``), this runs: plain, autogaudi with an empty cache (a
first run), autogaudi again on that cache (a warm run), and plain again; the two plains' mean is
the whole-run reference (the load drifts). It reads from each autogaudi run's report what autogaudi
paid for its own decisions (``summary.whole_run.cost_s``: one-offs, the slower arms of trials, its
measuring steps) against the whole run, and which trials the warm run started again that the first
rejected. Results: ``benchmarks/results/busy-<machine>.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus  # noqa: E402  (the corpus runner beside this file: its cases, copies and set-up)

SPIN = "while True: pass"
SHARE_LIMIT = 0.05  # the most of a whole run autogaudi's own decisions may cost beside busy processes


@contextlib.contextmanager
def busy(count: int):
    """``count`` processes that each keep a core busy, for as long as the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def run(case: dict, folder: Path, cache: Path | None, report: Path | None, timeout: float) -> dict:
    """One run of the case in ``folder``: plain where ``report`` is None, else under autogaudi with
    ``cache`` as its cache folder."""
    variant = "plain" if report is None else "autogaudi"
    env = corpus.clean_env(case, variant)
    extra = [] if report is None else [*corpus.VARIANTS[variant], "--report", str(report)]
    if cache is not None:
        env["AUTOGAUDI_CACHE_DIR"] = str(cache)
    began = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, *extra, *case["command"]],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        exit_code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        exit_code, output = None, ""
    seconds = time.perf_counter() - began
    matches = re.findall(f"(?:{case['result']})", output) if case.get("result") else []
    record = {"exit_code": exit_code, "seconds": round(seconds, 2), "result": matches[-1] if matches else None}
    if report is not None and report.exists():
        record["report"] = json.loads(report.read_text())
    return record


def decisions(report: dict | None) -> dict:
    """What a run's report says autogaudi paid for its decisions, and the trials it ran."""
    if not report:
        return {"cost_s": None, "trials": []}
    whole = report.get("summary", {}).get("whole_run") or {}
    trials = [
        {"candidate": t["candidate"], "decision": t.get("decision"), "one_off_s": t.get("one_off_s")}
        for t in report.get("trials", [])
        if "check" not in t
    ]
    return {"cost_s": whole.get("cost_s"), "trials": trials}


def run_case(case: dict, scratch: Path, timeout: float, log) -> dict:
    missing = corpus.missing_requirements(case)
    if missing:
        return {"name": case["name"], "skipped": f"needs {', '.join(missing)}"}
    root = scratch / case["name"]
    shutil.rmtree(root, ignore_errors=True)
    runs = {}
    cache = root / "cache"
    for name, under in (("plain", False), ("first", True), ("warm", True), ("plain again", False)):
        copy = root / name.replace(" ", "-")
        shutil.copytree(case["corpus"], copy, ignore=shutil.ignore_patterns("__pycache__"))
        folder = copy / case["dir"]
        corpus.run_setup(case, folder)
        report = root / f"{name}-report.json" if under else None
        runs[name] = run(case, folder, cache if under else None, report, timeout)
        log(f"  {case['name']}: {name} exit {runs[name]['exit_code']} in {runs[name]['seconds']} s")
    plain_s = (runs["plain"]["seconds"] + runs["plain again"]["seconds"]) / 2
    first, warm = decisions(runs["first"].get("report")), decisions(runs["warm"].get("report"))
    rejected = {t["candidate"] for t in first["trials"] if t["decision"] != "kept"}
    row = {
        "name": case["name"],
        "plain_s": [runs["plain"]["seconds"], runs["plain again"]["seconds"]],
        # as the corpus compares: timings in a result line left out, an unseeded case's exit only
        "results_same": all(
            corpus.compare_results(case, "autogaudi", runs["plain"]["result"], runs[name]["result"])[0]
            for name in ("first", "warm", "plain again")
        ),
        "results": {name: runs[name]["result"] for name in runs},  # which run differed, where one did
        "exit_codes": {name: runs[name]["exit_code"] for name in runs},
    }
    for name, found in (("first", first), ("warm", warm)):
        seconds = runs[name]["seconds"]
        row[name] = {
            "seconds": seconds,
            "ratio_to_plain": round(plain_s / seconds, 3),
            "decision_cost_s": found["cost_s"],
            "decision_share": round(found["cost_s"] / seconds, 4) if found["cost_s"] is not None else None,
            "trials": found["trials"],
        }
    row["warm_retried_rejected"] = sorted(rejected & {t["candidate"] for t in warm["trials"]})
    return row


def markdown(results: dict) -> str:
    lines = [
        f"# Decisions beside {results['busy']} busy processes: {results['machine']}",
        "",
        f"{results['date']}, autogaudi {results['autogaudi']} at {results['commit']}, torch {results['torch']}; "
        "each case plain, under "
        "autogaudi with an empty cache (first), again on that cache (warm), plain again; ratio = mean of the two "
        "plains / the run (above 1 faster). Share = autogaudi's own decision cost (one-offs, trials' slower arms, "
        f"measuring steps, from the report) of the whole run; the goal is at most {SHARE_LIMIT:.0%}.",
        "",
        "| case | plain s | first: ratio, share, trials | warm: ratio, share, trials | warm re-tried a rejection | "
        "same result |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["cases"]:
        if "skipped" in row:
            lines.append(f"| {row['name']} | skipped: {row['skipped']} | | | | |")
            continue

        def cell(run: dict) -> str:
            share = "?" if run["decision_share"] is None else f"{run['decision_share']:.1%}"
            trials = ", ".join(f"{t['candidate']} {t['decision']}" for t in run["trials"]) or "none"
            return f"{run['ratio_to_plain']:.2f}x, {share}, {trials}"

        lines.append(
            f"| {row['name']} | {' / '.join(map(str, row['plain_s']))} | {cell(row['first'])} | {cell(row['warm'])} "
            f"| {', '.join(row['warm_retried_rejected']) or 'no'} | {'yes' if row['results_same'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, action="append", help="a corpus folder with its corpus.json")
    parser.add_argument("--cases", help="comma-separated case names (default: every CPU case)")
    parser.add_argument("--busy", type=int, default=2, help="processes that spin beside the runs (default 2)")
    parser.add_argument("--short", action="store_true", help="the corpus's shorter runs")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/busy-<machine>.json")
    args = parser.parse_args(argv)
    corpora = args.corpus or [corpus.DEFAULT_CORPUS, corpus.HERE / "corpus_rl"]
    cases = corpus.load_cases(corpora, "cpu", args.cases.split(",") if args.cases else None)
    if args.short:
        cases = [corpus.shortened(case) for case in cases]
    import torch

    import autogaudi

    results = {
        "machine": corpus.machine_name(),
        "date": datetime.date.today().isoformat(),
        "autogaudi": autogaudi.__version__,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=corpus.REPO, capture_output=True, text=True
        ).stdout.strip(),
        "torch": torch.__version__,
        "busy": args.busy,
        "cases": [],
    }
    out = args.out or corpus.HERE / "results" / f"busy-{corpus.machine_name()}.json"
    with tempfile.TemporaryDirectory(prefix="autogaudi-busy-") as scratch, busy(args.busy):
        for case in cases:
            results["cases"].append(run_case(case, Path(scratch), args.timeout, corpus.log))
            out.write_text(json.dumps(results, indent=1) + "\n")
            out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
