"""Run the benchmark suite: plain PyTorch vs autogaudi vs hand-tuned, in fresh processes.

    python benchmarks/run.py [--rounds 7]

Writes benchmarks/results/<machine>.json, the Markdown table (<machine>-table.md, also printed) and a
bar chart of the ratios to plain PyTorch (<machine>-chart.png, when matplotlib is installed: it is
in the test extra). Each variant runs in its own
interpreter (autogaudi patches a whole process). Variants alternate within a round and the order
rotates from round to round, so neither drift on the machine nor a variant's position in the round
favours one of them. Rates are medians with min and max; ratios are the median of the rounds' own
ratios (a variant's rate over plain's, or hand-tuned's, in the same round), with their min and max:
a round's variants run back to back, so its ratio cancels the machine's drift between rounds (on the
2-core machine one round of W1 ran twice as fast as another). Every run's losses are compared with
plain PyTorch's (a relative bound: fused kernels reassociate float sums and trajectories drift apart
over hundreds of steps, by as much for the hand-tuned script as for autogaudi) and with the
hand-tuned script's, which applies the same math as autogaudi and should match it closely.
"""

import argparse
import atexit
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from autogaudi.core.registry import UNIT_NAMES  # noqa: E402

LOSS_TOLERANCE = 1e-2  # the largest |loss - plain loss| / plain loss accepted at any step
# bf16 keeps 8 significant bits (fp16 11): their losses are held to what the hand-written autocast script gets.
LOW_PRECISION_LOSS_TOLERANCE = 5e-2
LOW_PRECISION_VARIANTS = ("precision", "autocast", "tf32")  # words in the names of the variants that run below float32
WORKLOADS = {
    "w1_mlp": [str(HERE / "workloads" / "mlp.py")],
    "w2_transformer": [str(HERE / "workloads" / "transformer.py")],
    "w3_cnn": [str(HERE / "workloads" / "cnn.py")],
    "rl_policy": [str(HERE / "workloads" / "rl_policy.py")],
    "w4_loader_bound": [str(HERE / "workloads" / "loader_bound.py")],
    # One long epoch: what gains only if workers start inside the epoch that measured the loader.
    "w4_loader_bound_1_epoch": [
        str(HERE / "workloads" / "loader_bound.py"),
        *("--epochs", "1", "--batches", "120", "--steady-from", "30"),
    ],
    # Long enough for the precision guard (3 steps) and auto's trial (30) to settle before timing.
    "w2_transformer_precision": [str(HERE / "workloads" / "transformer.py"), "--warmup", "50", "--steps", "40"],
    # fp16: as short as the guard allows (settled by step 17), since a CPU runs fp16 matmuls 20x slower.
    "w2_transformer_fp16": [str(HERE / "workloads" / "transformer.py"), "--warmup", "20", "--steps", "12"],
    "w5_ddp_2_ranks": [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "workloads" / "ddp_mlp.py"),
    ],
}
# (interpreter arguments before the workload, arguments after it)
VARIANTS = {
    "plain": ([], []),
    "autogaudi": (["-m", "autogaudi", "--quiet"], []),
    "hand-tuned": ([], ["--hand-tuned"]),
    "autogaudi, all units off": (["-m", "autogaudi", "--quiet", "--disable", ",".join(UNIT_NAMES)], []),
}
# Opt-in units are measured where they apply, as one more variant of that workload.
PRECISION = ["-m", "autogaudi", "--quiet", "--precision"]
EXTRA_VARIANTS = {
    # Mixed precision against the same script with autocast (and fp16's GradScaler) written by hand (the oracles).
    "w2_transformer_precision": {
        "autogaudi --precision bf16": ([*PRECISION, "bf16"], []),
        "autogaudi --precision auto": ([*PRECISION, "auto"], []),
        "hand-written bf16 autocast": ([], ["--autocast"]),
    },
    "w2_transformer_fp16": {
        "autogaudi --precision fp16": ([*PRECISION, "fp16"], []),
        "hand-written fp16 autocast + GradScaler": ([], ["--fp16"]),
    },
    "w5_ddp_2_ranks": {"autogaudi --force fast_ddp": (["-m", "autogaudi", "--quiet", "--force", "fast_ddp"], [])},
    # What a capture trial that is not kept leaves behind: on the 2-core CPU W1's compile trial is
    # rejected, so its steady state should equal the unit switched off.
    "w1_mlp": {
        "autogaudi --trial graph_capture": (["-m", "autogaudi", "--quiet", "--trial", "graph_capture"], []),
        "autogaudi --disable graph_capture": (["-m", "autogaudi", "--quiet", "--disable", "graph_capture"], []),
    },
}
# --control: plain PyTorch a second time in each round. Its ratio to plain should be 1.00x; how far it
# lands from that is the noise floor of every other ratio in the same table.
CONTROL_VARIANT = {"plain again (A/A control)": VARIANTS["plain"]}


def low_precision(variant: str) -> bool:
    return any(word in variant for word in LOW_PRECISION_VARIANTS)


def machine_name() -> str:
    """Names the results file: the GPU the workloads run on when there is one, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return "-".join(torch.cuda.get_device_name().lower().split()) + f"-x{torch.cuda.device_count()}"
    cores = psutil.cpu_count(logical=False) or psutil.cpu_count()
    return f"{platform.machine()}-{cores}core-cpu"


@functools.cache
def caches_folder() -> str:
    """One folder for every run's cache, made on first use and removed at exit. Not a module-level
    TemporaryDirectory: the tests load this file as a module more than once, and each such object
    collected later warns ("Implicitly cleaning up") inside whatever test is running then."""
    folder = tempfile.mkdtemp(prefix="autogaudi-bench-caches-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def provenance() -> dict:
    """What a results file says it was measured on: the machine, torch's version and the date."""
    import torch

    return {"machine": machine_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


def clean_env(**extra) -> dict:
    """The environment less autogaudi's variables, with a fresh cache folder: each run is a first run
    (nothing remembered, nothing compiled); second_run.py measures what the cache saves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGAUDI")}
    env["AUTOGAUDI_CACHE_DIR"] = tempfile.mkdtemp(dir=caches_folder())
    env.update(extra)
    return env


def run_json(command: list) -> dict:
    result = subprocess.run([sys.executable, *command], env=clean_env(), capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def trial_decisions(before: list, workload: list, after: list) -> tuple:
    """The variant's command, with autogaudi asked for its JSON report where it runs, and a reader
    of the report's trial decisions ("graph_capture rejected"): a ratio says how fast, the decisions
    say which code ran."""
    if before[:2] != ["-m", "autogaudi"]:
        return before + workload + after, lambda: None
    handle, path = tempfile.mkstemp(suffix=".json")
    os.close(handle)

    def read():
        try:
            trials = json.loads(Path(path).read_text() or "{}").get("trials", [])
        finally:
            os.unlink(path)
        return [f"{trial['candidate']} {trial['decision']}" for trial in trials]

    return [*before[:2], "--report", path, *before[2:], *workload, *after], read


def summary(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values)}


def per_round(numerators: list, denominators: list) -> list:
    """Each round's own ratio: a round's variants ran back to back, so drift between rounds cancels."""
    return [a / b for a, b in zip(numerators, denominators)]


def relative_drift(losses: list, reference: list) -> float:
    """The largest |loss - reference loss| / |reference loss| over the steps."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def step_rates(workload: list, rounds: int, variants: dict) -> dict:
    """Every variant of one workload, interleaved round by round; ratios against plain and hand-tuned."""
    rates = {name: [] for name in variants}
    totals = {name: [] for name in variants}  # whole-run seconds, where a workload reports them
    one_offs = {name: [] for name in variants}  # whole-run seconds beyond what its steady rate explains
    timed_from = {name: [] for name in variants}
    decisions = {name: [] for name in variants}  # autogaudi's trial decisions, per round
    losses = {}
    plain_rounds = []  # plain's losses in every round: how far plain moves from itself
    names = list(variants)
    script = next(Path(part).stem for part in workload if part.endswith(".py"))
    for round_number in range(rounds):
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            before, after = variants[name]
            command, read_decisions = trial_decisions(before, workload, after)
            began = time.perf_counter()
            result = run_json(command)
            decided = read_decisions()
            if decided is not None:
                decisions[name].append(decided)
            print(
                f"  {script} round {round_number + 1}: {name} "
                f"{result['steps_per_s']:.1f} steps/s ({time.perf_counter() - began:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
            rates[name].append(result["steps_per_s"])
            if "total_seconds" in result:
                totals[name].append(result["total_seconds"])
            if "total_steps" in result:
                one_offs[name].append(result["total_seconds"] - result["total_steps"] / result["steps_per_s"])
                timed_from[name].append(result["timed_from_step"] if result["settled"] else None)
            losses.setdefault(name, result["losses"])
            if name == "plain":
                plain_rounds.append(result["losses"])
    # Seeded runs on a GPU need not repeat themselves (plain mnist did not on an H100; an RL loop's sampled
    # trajectory then parts ways): a variant within plain's own difference is plain's.
    own = max((relative_drift(later, plain_rounds[0]) for later in plain_rounds[1:]), default=0.0)
    rows = {}
    for name, values in rates.items():
        vs_plain = per_round(values, rates["plain"])
        drift = relative_drift(losses[name], losses["plain"])
        tolerance = LOW_PRECISION_LOSS_TOLERANCE if low_precision(name) else LOSS_TOLERANCE
        rows[name] = {
            "steps_per_s": summary(values),
            "steps_per_s_by_round": values,
            "ratio_vs_plain": statistics.median(vs_plain),
            "ratio_vs_plain_range": [min(vs_plain), max(vs_plain)],
            "ratio_vs_hand_tuned": statistics.median(per_round(values, rates["hand-tuned"])),
            "max_relative_loss_difference": drift,
            "plain_own_loss_difference": own,
            "losses_match": drift <= max(tolerance, own),
            "max_loss_difference_vs_hand_tuned": max(abs(a - b) for a, b in zip(losses[name], losses["hand-tuned"])),
        }
        if decisions[name]:
            rows[name]["trial_decisions_by_round"] = decisions[name]
        if totals[name]:
            rows[name]["total_seconds"] = summary(totals[name])
            rows[name]["total_speedup_vs_plain"] = statistics.median(per_round(totals["plain"], totals[name]))
        if one_offs[name]:
            rows[name].update(
                timed_from_step=timed_from[name],
                **break_even(
                    statistics.median(one_offs[name]) - statistics.median(one_offs["plain"]),
                    statistics.median(rates["plain"]),
                    statistics.median(values),
                ),
            )
    return rows


def break_even(extra_one_off_s: float, plain_rate: float, rate: float) -> dict:
    """The one-off seconds a variant adds to a run beyond plain's, and the run length (steps) from
    which it is ahead of plain on the whole run: one-off + N/rate = N/plain_rate. None: never (it is
    not faster in the steady state); 0: from the first step (no extra one-off)."""
    figures = {"one_off_s_vs_plain": round(extra_one_off_s, 3)}
    if extra_one_off_s <= 0:
        figures["break_even_steps"] = 0 if rate >= plain_rate else None
    elif rate > plain_rate:
        figures["break_even_steps"] = round(extra_one_off_s / (1 / plain_rate - 1 / rate))
    else:
        figures["break_even_steps"] = None
    return figures


def startup(rounds: int) -> dict:
    """Wall time of `python -c pass`, with and without AUTOGAUDI=1 (which must not import torch)."""
    probe = "import sys; assert 'torch' not in sys.modules"
    times = {"plain": [], "AUTOGAUDI=1": []}
    for _ in range(rounds):
        for name, env in (("plain", clean_env()), ("AUTOGAUDI=1", clean_env(AUTOGAUDI="1"))):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", probe], env=env, check=True)
            times[name].append((time.perf_counter() - start) * 1000)
    added = statistics.median(times["AUTOGAUDI=1"]) - statistics.median(times["plain"])
    return {"ms": {name: summary(values) for name, values in times.items()}, "added_ms": added}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/<machine>.json")
    parser.add_argument(
        "--render",
        type=Path,
        metavar="RESULTS_JSON",
        help="run nothing: rewrite the Markdown table and the chart of an existing results file",
    )
    parser.add_argument("--only", help="comma-separated workloads to run (default: all): " + ", ".join(WORKLOADS))
    parser.add_argument(
        "--control",
        action="store_true",
        help="also run plain PyTorch twice per round, to read the noise floor of the ratios",
    )
    args = parser.parse_args()
    if args.render:
        results = json.loads(args.render.read_text())
        table_path, chart_path = companions(args.render)
        table_path.write_text(markdown_table(results))
        print(f"written to {table_path}")
        print(write_chart(results, chart_path))
        return
    args.out = args.out or HERE / "results" / f"{machine_name()}.json"
    table_path, chart_path = companions(args.out)
    chosen = args.only.split(",") if args.only else list(WORKLOADS)
    unknown = sorted(set(chosen) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; valid: {', '.join(WORKLOADS)}")
    results = new_results(args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(table_header(results), flush=True)
    for workload in chosen:  # written after each workload, so a run cut short still leaves its figures
        variants = {**VARIANTS, **EXTRA_VARIANTS.get(workload, {}), **(CONTROL_VARIANT if args.control else {})}
        results["workloads"][workload] = rows = step_rates(WORKLOADS[workload], args.rounds, variants)
        write_results(results, args.out, table_path)
        for name, row in rows.items():
            print(table_row(workload, name, row), flush=True)
    results["startup"] = startup(args.rounds * 4)
    write_results(results, args.out, table_path)
    print("\n" + startup_line(results["startup"]))
    print(f"\nwritten to {args.out}, {table_path}")
    print(write_chart(results, chart_path))


def new_results(rounds: int) -> dict:
    """A results file's header (the machine and versions), with no workload yet."""
    import torch

    return {
        "machine": machine_name(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": psutil.cpu_count(logical=False),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "rounds": rounds,
        "workloads": {},
    }


def companions(results_path: Path) -> tuple:
    """Where the Markdown table and the chart of a results file go: beside it."""
    return (
        results_path.with_name(results_path.stem + "-table.md"),
        results_path.with_name(results_path.stem + "-chart.png"),
    )


def write_results(results: dict, path: Path, table_path: Path) -> None:
    path.write_text(json.dumps(results, indent=2) + "\n")
    table_path.write_text(markdown_table(results))


def table_header(results: dict) -> str:
    paired = all("steps_per_s_by_round" in row for rows in results["workloads"].values() for row in rows.values())
    return (
        f"# {results['machine']} (torch {results['torch']}, median of {results['rounds']} rounds)\n\n"
        + (
            "Ratios: the median of the rounds' own ratios (variants of a round run back to back).\n\n"
            if paired
            else "Ratios: of the medians (this file predates ratios paired by round).\n\n"
        )
        + "| workload | variant | steps/s median (min-max) | vs plain | vs hand-tuned | "
        "max rel. loss diff vs plain | max loss diff vs hand-tuned |\n|---|---|---|---|---|---|---|"
    )


def startup_line(start: dict) -> str:
    return (
        f"startup `python -c pass`: plain {start['ms']['plain']['median']:.1f} ms, AUTOGAUDI=1 "
        f"{start['ms']['AUTOGAUDI=1']['median']:.1f} ms (+{start['added_ms']:.1f} ms), torch not imported"
    )


def markdown_table(results: dict) -> str:
    lines = [table_header(results)]
    for workload, rows in results["workloads"].items():
        lines.extend(table_row(workload, name, row) for name, row in rows.items())
    if "startup" in results:
        lines.append("\n" + startup_line(results["startup"]))
    return "\n".join(lines) + "\n"


def write_chart(results: dict, path: Path) -> str:
    """Bars: each variant's steady-state rate as a multiple of plain PyTorch's, per workload, with
    the rounds' min-max ratios as error bars (none for files written before ratios were paired by
    round, e.g. the H100 run's). Returns what it did, for the log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        return "no chart: matplotlib is not installed (pip install -e '.[test]')"
    workloads = list(results["workloads"])
    names = list(dict.fromkeys(name for rows in results["workloads"].values() for name in rows))
    figure, axes = pyplot.subplots(figsize=(2.2 * len(workloads) + 2, 4))
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        ratios, low, high = [], [], []
        for workload in workloads:
            row = results["workloads"][workload].get(name)
            if row is None:  # a variant only some workloads have: no bar there (NaN is not drawn)
                ratios.append(float("nan"))
                low.append(0.0)
                high.append(0.0)
                continue
            ratio = row["ratio_vs_plain"]
            smallest, largest = row.get("ratio_vs_plain_range", (ratio, ratio))
            ratios.append(ratio)
            low.append(ratio - smallest)
            high.append(largest - ratio)
        positions = [number + (index - (len(names) - 1) / 2) * width for number in range(len(workloads))]
        axes.bar(positions, ratios, width, yerr=[low, high], capsize=2, label=name)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(workloads)), workloads)
    axes.set_ylabel("steady-state steps/s vs plain PyTorch")
    axes.set_title(
        f"{results['machine']}, torch {results['torch']}, median ratio of {results['rounds']} rounds (min-max)"
    )
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return f"chart written to {path}"


def table_row(workload: str, name: str, row: dict) -> str:
    rate = row["steps_per_s"]
    own = row.get("plain_own_loss_difference", 0.0)
    if not row["losses_match"]:
        flag = " (DIFFERENT TRAINING)"
    elif row["max_relative_loss_difference"] > 0 and own >= row["max_relative_loss_difference"] and name != "plain":
        flag = f" (within plain's own round-to-round {own:.1e})"
    else:
        flag = ""
    if "total_seconds" in row:
        flag += f" (whole run incl. warm-up and one-off costs: {row['total_speedup_vs_plain']:.2f}x plain)"
    if row.get("one_off_s_vs_plain") is not None and name != "plain":
        steps = row["break_even_steps"]
        flag += (
            f" (one-off {row['one_off_s_vs_plain']:+.2f} s vs plain; ahead of plain on the whole run "
            + ("never: not faster" if steps is None else f"from step {steps}")
            + ")"
        )
        unsettled = sum(step is None for step in row["timed_from_step"])
        if unsettled:
            flag += f" (NOT SETTLED in {unsettled} round(s): timed from warm-up)"
    if row.get("trial_decisions_by_round"):
        counted = Counter(decision for decided in row["trial_decisions_by_round"] for decision in decided)
        rounds = len(row["trial_decisions_by_round"])
        flag += " (trials: " + (", ".join(f"{text} in {n}/{rounds}" for text, n in counted.items()) or "none") + ")"
    return (
        f"| {workload} | {name} | {rate['median']:.1f} ({rate['min']:.1f}-{rate['max']:.1f}) | "
        f"{row['ratio_vs_plain']:.3f}x | {row['ratio_vs_hand_tuned']:.3f}x | "
        f"{row['max_relative_loss_difference']:.1e}{flag} | {row['max_loss_difference_vs_hand_tuned']:.1e} |"
    )


if __name__ == "__main__":
    main()
