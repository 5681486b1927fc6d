"""Run the benchmark suite: plain PyTorch vs autogaudi vs hand-tuned, in fresh processes.

    python benchmarks/run.py [--rounds 7]

Writes benchmarks/results/<machine>.json and prints a Markdown table. Each variant runs in its own
interpreter (autogaudi patches a whole process). Variants alternate within a round and the order
rotates from round to round, so neither drift on the machine nor a variant's position in the round
favours one of them; figures are medians with min and max. Every run's losses are compared with
plain PyTorch's (a relative bound: fused kernels reassociate float sums and trajectories drift apart
over hundreds of steps, by as much for the hand-tuned script as for autogaudi) and with the
hand-tuned script's, which applies the same math as autogaudi and should match it closely.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from autogaudi.registry import UNIT_NAMES  # noqa: E402

LOSS_TOLERANCE = 1e-2  # the largest |loss - plain loss| / plain loss accepted at any step
WORKLOADS = {
    "w1_mlp": [str(HERE / "workloads" / "mlp.py")],
    "w2_transformer": [str(HERE / "workloads" / "transformer.py")],
    "w3_cnn": [str(HERE / "workloads" / "cnn.py")],
    "w4_loader_bound": [str(HERE / "workloads" / "loader_bound.py")],
}
# (interpreter arguments before the workload, arguments after it)
VARIANTS = {
    "plain": ([], []),
    "autogaudi": (["-m", "autogaudi", "--quiet"], []),
    "hand-tuned": ([], ["--hand-tuned"]),
    "autogaudi, all units off": (["-m", "autogaudi", "--quiet", "--disable", ",".join(UNIT_NAMES)], []),
}


def machine_name() -> str:
    """Names the results file: the GPU the workloads run on when there is one, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return "-".join(torch.cuda.get_device_name().lower().split()) + f"-x{torch.cuda.device_count()}"
    cores = psutil.cpu_count(logical=False) or psutil.cpu_count()
    return f"{platform.machine()}-{cores}core-cpu"


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGAUDI")}
    env.update(extra)
    return env


def run_json(command: list) -> dict:
    result = subprocess.run([sys.executable, *command], env=clean_env(), capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def summary(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values)}


def step_rates(workload: list, rounds: int) -> dict:
    """Every variant of one workload, interleaved round by round; ratios against plain and hand-tuned."""
    rates = {name: [] for name in VARIANTS}
    totals = {name: [] for name in VARIANTS}  # whole-run seconds, where a workload reports them
    losses = {}
    names = list(VARIANTS)
    for round_number in range(rounds):
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            before, after = VARIANTS[name]
            began = time.perf_counter()
            result = run_json(before + workload + after)
            print(f"  {Path(workload[0]).stem} round {round_number + 1}: {name} "
                  f"{result['steps_per_s']:.1f} steps/s ({time.perf_counter() - began:.1f} s)", file=sys.stderr, flush=True)
            rates[name].append(result["steps_per_s"])
            if "total_seconds" in result:
                totals[name].append(result["total_seconds"])
            losses.setdefault(name, result["losses"])
    plain = statistics.median(rates["plain"])
    tuned = statistics.median(rates["hand-tuned"])
    rows = {}
    for name, values in rates.items():
        drift = max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses["plain"]))
        rows[name] = {"steps_per_s": summary(values), "ratio_vs_plain": statistics.median(values) / plain,
                      "ratio_vs_hand_tuned": statistics.median(values) / tuned,
                      "max_relative_loss_difference": drift, "losses_match": drift <= LOSS_TOLERANCE,
                      "max_loss_difference_vs_hand_tuned": max(
                          abs(a - b) for a, b in zip(losses[name], losses["hand-tuned"]))}
        if totals[name]:
            rows[name]["total_seconds"] = summary(totals[name])
            rows[name]["total_speedup_vs_plain"] = statistics.median(totals["plain"]) / statistics.median(totals[name])
    return rows


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
    parser.add_argument("--only", help="comma-separated workloads to run (default: all): " + ", ".join(WORKLOADS))
    args = parser.parse_args()
    args.out = args.out or HERE / "results" / f"{machine_name()}.json"
    chosen = args.only.split(",") if args.only else list(WORKLOADS)
    unknown = sorted(set(chosen) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; valid: {', '.join(WORKLOADS)}")
    import torch

    results = {
        "machine": machine_name(), "cpu": platform.processor() or platform.machine(),
        "cpu_cores": psutil.cpu_count(logical=False),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(), "torch": torch.__version__, "rounds": args.rounds,
        "workloads": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"# {results['machine']} (torch {results['torch']}, median of {args.rounds} rounds)\n")
    print("| workload | variant | steps/s median (min-max) | vs plain | vs hand-tuned | "
          "max rel. loss diff vs plain | max loss diff vs hand-tuned |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for workload in chosen:  # written after each workload, so a run cut short still leaves its figures
        results["workloads"][workload] = rows = step_rates(WORKLOADS[workload], args.rounds)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        for name, row in rows.items():
            print(table_row(workload, name, row), flush=True)
    results["startup"] = start = startup(args.rounds * 4)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nstartup `python -c pass`: plain {start['ms']['plain']['median']:.1f} ms, "
          f"AUTOGAUDI=1 {start['ms']['AUTOGAUDI=1']['median']:.1f} ms (+{start['added_ms']:.1f} ms), torch not imported")
    print(f"\nwritten to {args.out}")


def table_row(workload: str, name: str, row: dict) -> str:
    rate = row["steps_per_s"]
    flag = "" if row["losses_match"] else " (DIFFERENT TRAINING)"
    if "total_seconds" in row:
        flag += f" (whole run incl. warm-up and one-off costs: {row['total_speedup_vs_plain']:.2f}x plain)"
    return (f"| {workload} | {name} | {rate['median']:.1f} ({rate['min']:.1f}-{rate['max']:.1f}) | "
            f"{row['ratio_vs_plain']:.3f}x | {row['ratio_vs_hand_tuned']:.3f}x | "
            f"{row['max_relative_loss_difference']:.1e}{flag} | {row['max_loss_difference_vs_hand_tuned']:.1e} |")


if __name__ == "__main__":
    main()
