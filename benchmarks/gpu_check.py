"""Everything that needs a GPU, in parts that each fit one 10-minute command on a briefly lent machine.

    python benchmarks/gpu_check.py --list
    python benchmarks/gpu_check.py --install --part 1 --out DIR     # then 2a, 3a, 3b, 2b, 2c, 4, 5
    python benchmarks/gpu_check.py --part 1,2a --minutes 9 --out DIR  # several in one call
    python benchmarks/gpu_check.py --dry-run --out DIR              # every harness on this CPU, tiny sizes

A lent GPU comes rarely, bare and for minutes: each part runs what the project's own harnesses
already run (the test suite, benchmarks/corpus.py, benchmarks/run.py, benchmarks/second_run.py),
writes their files into ``--out`` as items finish (a part killed at its limit keeps what ended),
skips what would no longer fit in its minutes, and prints one summary table last, where the device
tool's reply shows it. ``--dry-run`` runs the same harnesses on the CPU with tiny sizes so that CI
proves the battery itself works; nothing it prints is a GPU figure.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import corpus  # noqa: E402
import run as suite  # noqa: E402
import second_run  # noqa: E402

# Where the corpus is: a checkout's own shared/ travels to the device machine with it; a
# developer's ../shared beside the checkout does not.
CORPUS_PLACES = (REPO / "shared" / "corpus", corpus.DEFAULT_CORPUS)
# The corpus's GPU cases, three shards of about six minutes each on a GPU. time-sequence-lbfgs comes
# last in its shard: its Python LSTMCell loop in double precision outlasts a run's limit on a GPU,
# and the cases after it would otherwise never start.
CORPUS_SHARDS = {
    "2a": ["regression", "mingpt-adder", "mingpt-chargpt", "mnist"],
    "2b": ["vae", "siamese", "mnist-rnn", "forward-forward"],
    "2c": ["mingpt-adder-workers", "makemore-transformer", "makemore-gru", "time-sequence-lbfgs"],
}
CORPUS_VARIANTS = ["plain", "autogaudi", "capture forced", "precision auto"]
CORPUS_TIMEOUT_S = 120  # one run of one case: longer is recorded as a timeout, not waited for
CORPUS_TIMEOUT_FLOOR_S = 20  # a case started near the deadline still gives each run this long
ROUNDS = 3  # of the workloads; precision's nine variants get 2
# A dry run: tiny sizes, and the first item of each harness only.
DRY_WORKLOAD_ARGS = {
    "w1_mlp": ["--steps", "20", "--warmup", "5"],
    "rl_policy": ["--steps", "6", "--warmup", "4", "--limit", "40"],
    # 4 of W2's steps drive the harness as 20 do, in each of its 4 variants (the rate is then from steps
    # before autogaudi settled, flagged so)
    "w2": ["--batch", "1", "--warmup", "2", "--steps", "2"],
}
# A dry run's tests: a file with a test marked cuda, so that pytest and its JUnit counts run
# without collecting the whole suite (which CI runs anyway).
DRY_TESTS = "tests/backends/test_select.py"
# A dry run's corpus case, whichever part asks: the cheapest (about 2 s plain, saves no checkpoint).
DRY_CORPUS_CASE = "regression"
# and the precision variant part 4 runs the corpus under (float32 on a CPU: tf32 is CUDA's)
DRY_PRECISION = "precision tf32"


@dataclass
class Context:
    out: Path
    corpus: Path
    dry: bool
    machine: str
    deadline: float  # time.monotonic() after which nothing new starts

    def fits(self, minutes: float) -> bool:
        return self.dry or time.monotonic() + 60 * minutes < self.deadline

    def run_limit(self, runs: int) -> float:
        """Seconds each of a case's ``runs`` may take, so that the case ends by the deadline: a command
        killed at its limit returns no files for the case it was in."""
        share = (self.deadline - time.monotonic()) / runs
        return CORPUS_TIMEOUT_S if self.dry else max(CORPUS_TIMEOUT_FLOOR_S, min(CORPUS_TIMEOUT_S, share))

    def path(self, part: str, what: str, suffix: str = ".json") -> Path:
        return self.out / f"gpu-check-{part}-{what}-{self.machine}{suffix}"


def row(item: str, status: str, detail: str, seconds: float = 0.0) -> dict:
    return {"item": item, "status": status, "detail": detail, "seconds": round(seconds, 1)}


# Part 1: the suite's CUDA tests and the capture-safety tests.


def pytest_counts(xml_path: Path) -> dict:
    """Passed, failed, skipped and the failures' names and messages, from pytest's JUnit XML."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in ElementTree.parse(xml_path).iter("testcase"):
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
        else:
            counts["failed"] += 1
            name = f"{case.get('classname')}::{case.get('name')}"
            counts["failures"].append({"test": name, "message": (outcome.get("message") or "")[:1500]})
    return counts


def run_pytest(name: str, arguments: list, ctx: Context, results: dict) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        xml_path = Path(scratch) / "junit.xml"
        began = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", *arguments, "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - began
        counts = pytest_counts(xml_path) if xml_path.exists() else {"failures": [], "error": done.stdout[-3000:]}
    results[name] = {"command": ["pytest", *arguments], "exit_code": done.returncode, **counts}
    ctx.path("1", "tests").write_text(json.dumps(results, indent=1) + "\n")
    tally = ", ".join(f"{counts[key]} {key}" for key in ("passed", "failed", "skipped") if key in counts)
    failed = "; ".join(failure["test"] for failure in counts["failures"])
    status = "ok" if done.returncode == 0 else "FAILED"
    return row(name, status, f"{tally or 'no result'}{': ' + failed if failed else ''}", seconds)


def part_tests(ctx: Context) -> list:
    """The tests marked ``cuda`` (skipped without one: CI never runs them), then, on a GPU, the whole
    capture-safety file: its CPU tests also run where CUDA is present, which CI never sees."""
    results = {}
    tests = DRY_TESTS if ctx.dry else "tests"
    rows = [run_pytest(f"pytest -m cuda {tests}", ["-m", "cuda", tests], ctx, results)]
    capture = "tests/optimizations/test_capture_safety.py"
    if ctx.dry:
        rows.append(row(f"pytest {capture}", "not run", "dry run: CI runs it on the CPU already"))
    else:
        rows.append(run_pytest(f"pytest {capture}", [capture], ctx, results))
    return rows


# Part 2: the corpus, one case at a time.


def corpus_part(shard: str) -> Callable:
    def part(ctx: Context) -> list:
        names, variants = CORPUS_SHARDS[shard], CORPUS_VARIANTS
        if ctx.dry:  # the harness on its cheapest case, against plain, under part 4's precision variant
            # (not with a plain run of its own): capture's compile is part 5's in a dry run, the defaults'
            # run is left to the suite's corpus test, which runs this case so on the CPU, and precision
            # auto is the same harness path as that variant, under another flag
            names = [DRY_CORPUS_CASE]
            variants = ["plain", DRY_PRECISION]
        return run_corpus(ctx, shard, names, variants, 7 / len(names))

    return part


def run_corpus(ctx: Context, part: str, names: list, variants: list, minutes_each: float) -> list:
    if not (ctx.corpus / "corpus.json").exists():
        return [row(f"corpus {', '.join(names)}", "not run", f"no corpus at {ctx.corpus} (--corpus)")]
    cases = corpus.load_cases([ctx.corpus], "gpu", names)
    results = corpus.new_results("gpu", 1, False, variants)
    out, rows = ctx.path(part, "corpus"), []
    for case in cases:
        if not ctx.fits(minutes_each):
            rows.append(row(f"corpus {case['name']}", "not run", "out of this part's minutes"))
            continue
        with tempfile.TemporaryDirectory() as scratch:
            began = time.perf_counter()
            result = corpus.run_case(case, variants, Path(scratch), corpus.log, ctx.run_limit(len(variants)))
        results["cases"].append(result)
        corpus.write(results, out)
        rows.append(corpus_row(result, time.perf_counter() - began))
    return rows


def corpus_row(result: dict, seconds: float) -> dict:
    name = f"corpus {result['name']}"
    if "skipped" in result:
        return row(name, "not run", result["skipped"])
    runs = result["runs"]
    verdicts = {variant: run.get("verdict", f"exit {run['exit_code']}") for variant, run in runs.items()}
    crashed = "crashed" in verdicts.values() or runs["plain"]["exit_code"] != 0
    detail = ", ".join(f"{variant} {verdict}" for variant, verdict in verdicts.items())
    return row(name, "FAILED" if crashed else "ok", detail, seconds)


# Parts 3 and 4: workloads through benchmarks/run.py.


def workload_rows(ctx: Context, part: str, plan: list, rounds: int, minutes_each: float) -> list:
    """``plan``: (workload name, its command, variants). Results in run.py's files, after each workload."""
    results = suite.new_results(1 if ctx.dry else rounds)
    out, rows = ctx.path(part, "workloads"), []
    table = suite.companions(out)[0]
    for name, command, variants in plan:
        if not ctx.fits(minutes_each):
            rows.append(row(name, "not run", "out of this part's minutes"))
            continue
        began = time.perf_counter()
        try:
            results["workloads"][name] = figures = suite.step_rates(command, results["rounds"], variants)
        except SystemExit as failure:  # run.py's way of saying a variant failed
            rows.append(row(name, "FAILED", str(failure)[-1500:], time.perf_counter() - began))
            continue
        suite.write_results(results, out, table)
        rows.append(row(name, *workload_verdict(figures), time.perf_counter() - began))
    return rows


def workload_verdict(figures: dict) -> tuple:
    """Status and one line: each variant's steady-state and whole-run ratio to plain, what it flagged."""
    parts, status = [], "ok"
    for variant, figure in figures.items():
        if variant == "plain":
            continue
        text = f"{variant} {figure['ratio_vs_plain']:.2f}x"
        if "total_speedup_vs_plain" in figure:
            text += f" (whole run {figure['total_speedup_vs_plain']:.2f}x)"
        if not figure["losses_match"]:
            text, status = text + " DIFFERENT TRAINING", "FAILED"
        if any(step is None for step in figure.get("timed_from_step", ())):
            text += " not settled"
        parts.append(text)
    return status, "; ".join(parts)


def plain_autogaudi_hand_tuned() -> dict:
    return {name: suite.VARIANTS[name] for name in ("plain", "autogaudi", "hand-tuned")}


def workloads_part(part: str, names: list) -> Callable:
    def run(ctx: Context) -> list:
        plan = [(name, suite.WORKLOADS[name], plain_autogaudi_hand_tuned()) for name in names]
        if ctx.dry:  # the harness on the first workload only
            plan = [(name, [*command, *DRY_WORKLOAD_ARGS[name]], variants) for name, command, variants in plan[:1]]
        return workload_rows(ctx, part, plan, ROUNDS, 8 / len(names))

    return run


# Part 4: precision.

TF32_VARIANTS = {
    "autogaudi --precision tf32": ([*suite.PRECISION, "tf32"], []),
    "hand-written tf32": ([], ["--tf32"]),
}


def part_precision(ctx: Context) -> list:
    """W2 under bf16, fp16, tf32 and auto against the same script with autocast, GradScaler or the TF32
    switches written by hand; an fp16 step whose gradients overflow, which loss scaling must skip
    and go on; and the corpus GPT under each precision."""
    w2 = suite.WORKLOADS["w2_transformer"]
    variants = {
        **plain_autogaudi_hand_tuned(),
        **suite.EXTRA_VARIANTS["w2_transformer_precision"],
        **suite.EXTRA_VARIANTS["w2_transformer_fp16"],
        **TF32_VARIANTS,
    }
    del variants["autogaudi"]  # precision is opt-in: what --precision does, not the defaults
    sizes = ["--warmup", "60", "--steps", "400"]
    if ctx.dry:
        # float32 on a CPU (tf32 is CUDA's): W2's precision flags and rows, without bf16's slow CPU kernels
        variants = {name: variants[name] for name in ("plain", "hand-tuned", *TF32_VARIANTS)}
        sizes = DRY_WORKLOAD_ARGS["w2"]
    rows = workload_rows(ctx, "4", [("w2_transformer precision", [*w2, *sizes], variants)], 2, 4)
    if ctx.dry:  # fp16 runs about 20x slower than float32 on a CPU: W2's ~40 fp16 steps take minutes
        rows.append(row("fp16 overflow, loss scaling", "not run", "dry run: fp16 on a CPU is too slow"))
        return rows + [row("corpus precision", "not run", f"dry run: part 2a's runs {DRY_PRECISION}")]
    rows.append(overflow_check(ctx, [*w2, "--warmup", "60", "--steps", "200", "--overflow-at", "80"]))
    precisions = ["plain", "precision bf16", "precision fp16", "precision tf32"]
    return rows + run_corpus(ctx, "4", ["mingpt-chargpt"], precisions, 2)


def overflow_check(ctx: Context, command: list) -> dict:
    """``--precision fp16`` where one step's gradients overflow (x1e4 at the output): loss scaling must
    skip it and go on in fp16, every loss finite. That the very step is skipped, and the optimizer
    state untouched, is test_mixed_precision's on the CPU; this is the same on CUDA's kernels."""
    name = "fp16 overflow, loss scaling"
    if not ctx.fits(1.5):
        return row(name, "not run", "out of this part's minutes")
    began = time.perf_counter()
    report = ctx.out / "overflow-report.json"
    try:
        mine = suite.run_json(["-m", "autogaudi", "--quiet", "--report", str(report), "--precision", "fp16", *command])
    except SystemExit as failure:
        return row(name, "FAILED", str(failure)[-1500:], time.perf_counter() - began)
    unit = next(unit for unit in json.loads(report.read_text())["units"] if unit["name"] == "mixed_precision")
    report.unlink()
    skipped = unit["figures"].get("skipped_steps", 0)
    finite = all(math.isfinite(loss) for loss in mine["losses"])
    good = unit["reason_code"] == "on" and skipped >= 1 and finite
    detail = (
        f"mixed_precision {unit['reason_code']}, {skipped} step(s) skipped, loss scale "
        f"{unit['figures'].get('loss_scale')}, losses {'finite' if finite else 'NOT FINITE'}"
    )
    return row(name, "ok" if good else "FAILED", detail, time.perf_counter() - began)


# Part 5: what a second run saves.


def part_second_run(ctx: Context) -> list:
    out = ctx.path("5", "second-run")
    arguments = ["--corpus", str(ctx.corpus), "--out", str(out)]
    if ctx.dry:  # one case, short: its trial's compile is the dry run's only one
        arguments += ["--cases", "w1", "--short"]
    began = time.perf_counter()
    try:
        second_run.main(arguments)
    except SystemExit as failure:
        return [row("second run", "FAILED", str(failure)[-1500:], time.perf_counter() - began)]
    cases = json.loads(out.read_text())["cases"]
    ratios = "; ".join(f"{name}: {case['second_one_off_over_first']}x" for name, case in cases.items())
    return [row("second run", "ok", f"second/first one-off {ratios}", time.perf_counter() - began)]


@dataclass
class Part:
    title: str
    gpu_minutes: float  # an estimate from earlier lent-GPU runs of the same harnesses, not a measurement
    run: Callable
    # False for a shard whose harness another part's dry run already runs: it runs nothing in a dry run
    in_dry_run: bool = True


PARTS = {
    "1": Part("the suite's CUDA tests (-m cuda) and the capture-safety tests", 4, part_tests),
    **{
        shard: Part(
            f"corpus GPU cases {', '.join(names)}: {', '.join(CORPUS_VARIANTS)}", 8, corpus_part(shard), shard == "2a"
        )
        for shard, names in CORPUS_SHARDS.items()
    },
    "3a": Part("RL-shaped loop and W1: plain, autogaudi, hand-tuned", 7, workloads_part("3a", ["rl_policy", "w1_mlp"])),
    "3b": Part(
        "W5 (2 DDP ranks) and W3: plain, autogaudi, hand-tuned",
        8,
        workloads_part("3b", ["w5_ddp_2_ranks", "w3_cnn"]),
        False,
    ),
    "4": Part("precision bf16/fp16/tf32/auto on W2 and the corpus GPT; an fp16 overflow", 8, part_precision),
    "5": Part("second run: compile one-offs, first and second run", 5, part_second_run),
}
ORDER = ["1", "2a", "3a", "3b", "2b", "2c", "4", "5"]  # when minutes are short, the first ones first


def install() -> str:
    """Make this checkout importable by the machine's Python as ``pip install -e .`` would (a path
    file in site-packages, and autogaudi.pth for ``AUTOGAUDI=1``), without pip: the lent machine has
    no network and no build backend, and its CUDA torch must stay. Says what is still missing."""
    import importlib.metadata
    import re

    import tomllib

    # Asked of a fresh interpreter outside the checkout: this one has the checkout on its path, and
    # so would say yes where a corpus script run from its own folder cannot import autogaudi.
    where = subprocess.run(
        [sys.executable, "-c", "import autogaudi; print(autogaudi.__file__)"],
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
    )
    if where.returncode != 0:
        site = Path(sysconfig.get_paths()["purelib"])
        (site / "autogaudi-checkout.pth").write_text(f"{REPO}\n")
        shutil.copy(REPO / "autogaudi.pth", site / "autogaudi.pth")
        done = f"autogaudi from {REPO} importable (path files in {site})"
    else:
        done = f"autogaudi already importable from {Path(where.stdout.strip()).parent}"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    missing = []
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group()
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return done + (f"; not installed: {', '.join(missing)} (carry wheels to add them)" if missing else "")


def summary(ctx: Context, part: str, rows: list) -> str:
    kind = "DRY RUN on the CPU, tiny sizes: checks the battery works; no figure here is a GPU figure" if ctx.dry else ""
    lines = [
        f"# gpu_check part {part} on {ctx.machine}{': ' + kind if kind else ''}",
        "",
        f"{PARTS[part].title}",
        "",
        "| item | status | seconds | detail |",
        "|---|---|---|---|",
        *(f"| {r['item']} | {r['status']} | {r['seconds']} | {r['detail'].replace('|', '/')} |" for r in rows),
    ]
    return "\n".join(lines) + "\n"


def run_part(ctx: Context, part: str) -> list:
    if ctx.dry and not PARTS[part].in_dry_run:
        rows = [row(part, "not run", "dry run: the same harness as another part's dry run")]
    else:
        rows = PARTS[part].run(ctx)
    ctx.path(part, "summary").write_text(json.dumps({"dry_run": ctx.dry, "part": part, "rows": rows}, indent=1))
    ctx.path(part, "summary", ".md").write_text(summary(ctx, part, rows))
    return rows


def parts_named(text: str) -> list:
    """``--part``'s value: one part or several, comma-separated, run in the order given."""
    parts = [part for part in text.split(",") if part]
    unknown = [part for part in parts if part not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"no part {', '.join(unknown) or repr(text)}; the parts: {', '.join(ORDER)}")
    return parts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the parts and their expected minutes")
    parser.add_argument(
        "--part",
        type=parts_named,
        help=f"the part to run, or several in one call, comma-separated ({', '.join(ORDER)}): they share --minutes",
    )
    parser.add_argument("--dry-run", action="store_true", help="every part on this CPU, tiny sizes (CI)")
    parser.add_argument("--install", action="store_true", help="make this checkout importable first (no pip)")
    parser.add_argument("--out", type=Path, help="the folder for the results (on the lent machine: $OUT)")
    parser.add_argument("--corpus", type=Path, help="default: the first of " + ", ".join(map(str, CORPUS_PLACES)))
    parser.add_argument("--minutes", type=float, default=9.0, help="start nothing new after this (default 9)")
    args = parser.parse_args(argv)
    if args.list:
        print("| part | what | minutes on a GPU (estimate) |\n|---|---|---|")
        for part in ORDER:
            print(f"| {part} | {PARTS[part].title} | {PARTS[part].gpu_minutes} |")
    if args.install:
        print(install(), flush=True)
    if not (args.part or args.dry_run):
        if not (args.list or args.install):
            parser.error("name --part, --dry-run, --list or --install")
        return 0
    if args.out is None:
        parser.error("--out is needed to run a part")
    corpus_folder = args.corpus or next((place for place in CORPUS_PLACES if place.exists()), CORPUS_PLACES[0])
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args.out, corpus_folder, args.dry_run, suite.machine_name(), time.monotonic() + 60 * args.minutes)
    texts, failed = [], False
    for part in ORDER if args.dry_run else args.part:
        rows = run_part(ctx, part)
        texts.append(summary(ctx, part, rows))
        failed |= any(r["status"] == "FAILED" for r in rows)
    print("\n".join(texts))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
