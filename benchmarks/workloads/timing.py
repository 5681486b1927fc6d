"""The measurement every workload shares: run ``step(i)`` for warm-up + timed steps, then print one
JSON line with the steady-state rate (interpreter and torch start-up excluded) and every loss.
Every step returns ``loss.item()``, which waits for the device, so wall time is device time too."""
import json
import time

import torch

# Where a user's script would put its model: the GPU when there is one (as written in most scripts).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def report_steps(step, warmup: int, steps: int) -> None:
    """Steady state after ``warmup`` steps (autogaudi profiles and runs its trials in the first ~40),
    plus the whole run's seconds, which carry every one-off cost (compilation included)."""
    losses = []
    began = time.perf_counter()
    for index in range(warmup + steps):
        if index == warmup:
            start = time.perf_counter()
        losses.append(step(index))
    end = time.perf_counter()
    print(json.dumps({"steps_per_s": steps / (end - start), "total_seconds": end - began, "losses": losses}))


def add_arguments(parser, steps: int, warmup: int, gpu_steps: int = None) -> None:
    """A GPU runs the small workloads so fast that they take ``gpu_steps`` timed steps there."""
    parser.add_argument("--steps", type=int, default=gpu_steps if gpu_steps and DEVICE.type == "cuda" else steps)
    parser.add_argument("--warmup", type=int, default=max(warmup, 40) if DEVICE.type == "cuda" else warmup)
    parser.add_argument("--hand-tuned", action="store_true",
                        help="what an expert writes by hand for this workload: the fused optimizer "
                             "(and channels_last for the CNN)")
