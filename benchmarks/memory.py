"""The step memory's forecast against the measured peak, and what checkpointing costs per step.

    python benchmarks/memory.py [--steps 12] [--out benchmarks/results/memory-x86_64-2core-cpu]

For the test GPT (tests/gpt_model.py: 4 blocks, width 64, batch 16x32, AdamW): the forecast peak
(fake tensors, before the first forward) against the peak MemTracker measures on the second step;
then, under a --memory-limit of 60% of that peak, the median step time with the blocks
activation_checkpointing chose, against every block checkpointed (a limit nothing fits) and
against none (plain PyTorch). In one process, a few steps each: a CPU figure, not a device's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autogaudi  # noqa: E402
from autogaudi.backends.base import GB  # noqa: E402
from tests.gpt_model import train  # noqa: E402

ONLY = "step_profiler,activation_checkpointing"


def under(limit_gb, steps):
    """(median step ms after the first three steps, blocks checkpointed, memory section) under ``limit_gb``."""
    autogaudi.enable(device="cpu", memory_limit=limit_gb, only=ONLY) if limit_gb else None
    try:
        times = []
        train(steps, times=times)
        report = autogaudi.report().as_dict() if limit_gb else None
    finally:
        autogaudi.disable()
    row = next((u for u in report["units"] if u["name"] == "activation_checkpointing"), None) if report else None
    blocks = len(row["figures"].get("blocks_checkpointed", [])) if row else 0
    return round(statistics.median(times[3:]) * 1000, 2), blocks, report["memory"] if report else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/memory-x86_64-2core-cpu"))
    options = parser.parse_args()
    torch.set_num_threads(1)
    _, _, roomy = under(1.0, 4)
    peak = roomy["peak_bytes"]
    limit = 0.6 * peak / GB
    chosen_ms, chosen_blocks, chosen = under(limit, options.steps)
    all_ms, all_blocks, _ = under(1e-9, options.steps)
    none_ms, _, _ = under(None, options.steps)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), 1 thread",
        "date": datetime.date.today().isoformat(),
        "commit": commit.stdout.strip(),
        "torch": torch.__version__,
        "model": "tests/gpt_model.py TinyGPT: 4 blocks, width 64, batch 16x32, AdamW",
        "forecast_peak_bytes": roomy["predicted_peak_bytes"],
        "measured_peak_bytes": peak,
        "limit_bytes": round(limit * GB),
        "chosen": {"blocks": chosen_blocks, "ms_per_step": chosen_ms, "measured_peak_bytes": chosen["peak_bytes"]},
        "every_block": {"blocks": all_blocks, "ms_per_step": all_ms},
        "none": {"blocks": 0, "ms_per_step": none_ms},
        "steps": options.steps,
    }
    mb = 1e6
    table = "\n".join(
        [
            f"Machine {results['machine']}, {results['date']}, commit {results['commit']}, torch {results['torch']}.",
            "",
            "| | forecast peak | measured peak |",
            "|---|---|---|",
            f"| test GPT, no limit | {results['forecast_peak_bytes'] / mb:.2f} MB | {peak / mb:.2f} MB |",
            "",
            f"Under a limit of 60% of the peak ({limit * GB / mb:.2f} MB), median step of {options.steps - 3}:",
            "",
            "| blocks checkpointed | ms per step | measured peak |",
            "|---|---|---|",
            f"| none (plain) | {none_ms} | {peak / mb:.2f} MB |",
            f"| chosen: {chosen_blocks} of 4 | {chosen_ms} | {chosen['peak_bytes'] / mb:.2f} MB |",
            f"| every block: {all_blocks} of 4 | {all_ms} | — |",
        ]
    )
    print(table)
    Path(options.out + ".json").write_text(json.dumps(results, indent=2) + "\n")
    Path(options.out + ".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
