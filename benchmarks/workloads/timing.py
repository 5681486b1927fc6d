"""The measurement every workload shares: run ``step(i)`` for warm-up + timed steps, then print one
JSON line with the steady-state rate (interpreter and torch start-up excluded) and every loss.
Every step returns ``loss.item()``, which waits for the device, so wall time is device time too.

Under autogaudi the steady state starts once it has settled (``autogaudi.settled()``: profiled,
every trial decided), never inside its measurements: on an H100 a W3 run timed from step 40 read
0.22x plain because its compile trial was still running there, 1.55x once timed after it."""

import json
import sys
import time

import torch

# Where a user's script would put its model: the GPU when there is one (as written in most scripts).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autogaudi_settled() -> bool:
    """True for plain runs; under autogaudi, once it has made every decision."""
    autogaudi = sys.modules.get("autogaudi")
    return autogaudi is None or not autogaudi.is_enabled() or autogaudi.settled()


def report_steps(step, warmup: int, steps: int) -> None:
    """Steady state from the first step after ``warmup`` at which autogaudi (if on) has settled,
    to the end of ``warmup + steps`` steps; plus the whole run's seconds, which carry every one-off
    cost (compilation included), so that every variant runs the same steps."""
    losses, clocks = [], []
    timed_from = None
    for index in range(warmup + steps):
        clocks.append(time.perf_counter())
        if timed_from is None and index >= warmup and autogaudi_settled():
            timed_from = index
        losses.append(step(index))
    clocks.append(time.perf_counter())
    settled = timed_from is not None
    if not settled or len(losses) - timed_from < steps // 4:
        timed_from = warmup  # never settled (or too late to time): the steps after warm-up, flagged
    timed = len(losses) - timed_from
    print(
        json.dumps(
            {
                "steps_per_s": timed / (clocks[-1] - clocks[timed_from]),
                "total_seconds": clocks[-1] - clocks[0],
                "total_steps": len(losses),
                "timed_from_step": timed_from,
                "settled": settled,
                "losses": losses,
            }
        )
    )


def add_arguments(parser, steps: int, warmup: int, gpu_steps: int = None) -> None:
    """A GPU runs the small workloads so fast that they take ``gpu_steps`` timed steps there."""
    parser.add_argument("--steps", type=int, default=gpu_steps if gpu_steps and DEVICE.type == "cuda" else steps)
    parser.add_argument("--warmup", type=int, default=max(warmup, 40) if DEVICE.type == "cuda" else warmup)
    parser.add_argument(
        "--hand-tuned",
        action="store_true",
        help="what an expert writes by hand for this workload: the fused optimizer (and channels_last for the CNN)",
    )
