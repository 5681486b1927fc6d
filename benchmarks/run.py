"""Run the benchmark suite: plain PyTorch vs autogaudi, interleaved, in fresh processes.

    python benchmarks/run.py [--rounds 5]

Writes benchmarks/results/<machine>.json and prints a Markdown table. Each variant runs in its own
interpreter (autogaudi patches a whole process) and variants alternate round by round, so drift
on the machine hits all of them alike; figures are medians with min and max. A variant whose
losses differ from plain PyTorch's by more than the tolerance is flagged, however fast it is.
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

LOSS_TOLERANCE = 1e-6  # same math on the CPU today: the losses must agree to float rounding
MLP = [str(HERE / "workloads" / "mlp.py")]
VARIANTS = {
    "plain": [],
    "autogaudi": ["-m", "autogaudi", "--quiet"],
    "autogaudi, all units off": ["-m", "autogaudi", "--quiet", "--disable", ",".join(UNIT_NAMES)],
}


def machine_name() -> str:
    cores = psutil.cpu_count(logical=False) or psutil.cpu_count()
    return f"{platform.machine()}-{cores}core-cpu"


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGAUDI")}
    env.update(extra)
    return env


def run_json(command: list) -> dict:
    result = subprocess.run([sys.executable, *command], env=clean_env(), capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def summary(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values)}


def step_overhead(rounds: int) -> dict:
    rates = {name: [] for name in VARIANTS}
    losses = {}
    for _ in range(rounds):
        for name, prefix in VARIANTS.items():
            result = run_json(prefix + MLP)
            rates[name].append(result["steps_per_s"])
            losses.setdefault(name, result["losses"])
    plain = statistics.median(rates["plain"])
    rows = {}
    for name, values in rates.items():
        drift = max(abs(a - b) for a, b in zip(losses[name], losses["plain"]))
        rows[name] = {"steps_per_s": summary(values), "ratio_vs_plain": statistics.median(values) / plain,
                      "max_loss_difference": drift, "losses_match": drift <= LOSS_TOLERANCE}
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
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results" / f"{machine_name()}.json")
    args = parser.parse_args()
    import torch

    results = {
        "machine": machine_name(), "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__, "rounds": args.rounds,
        "w1_mlp_step_rate": step_overhead(args.rounds),
        "startup": startup(args.rounds * 4),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"# {results['machine']} (torch {results['torch']}, median of {args.rounds} rounds)\n")
    print("| W1 MLP variant | steps/s (min-max) | vs plain | losses match |\n|---|---|---|---|")
    for name, row in results["w1_mlp_step_rate"].items():
        rate = row["steps_per_s"]
        print(f"| {name} | {rate['median']:.1f} ({rate['min']:.1f}-{rate['max']:.1f}) | "
              f"{row['ratio_vs_plain']:.3f}x | {row['losses_match']} |")
    start = results["startup"]
    print(f"\nstartup `python -c pass`: plain {start['ms']['plain']['median']:.1f} ms, "
          f"AUTOGAUDI=1 {start['ms']['AUTOGAUDI=1']['median']:.1f} ms (+{start['added_ms']:.1f} ms), torch not imported")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
