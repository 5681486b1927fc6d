"""The measurement every workload shares: run ``step(i)`` for warm-up + timed steps, then print one
JSON line with the steady-state rate (interpreter and torch start-up excluded) and every loss.
Every step returns ``loss.item()``, which waits for the device, so wall time is device time too."""
import json
import time

import torch

# Where a user's script would put its model: the GPU when there is one (as written in most scripts).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def report_steps(step, warmup: int, steps: int) -> None:
    losses = []
    for index in range(warmup + steps):
        if index == warmup:
            start = time.perf_counter()
        losses.append(step(index))
    print(json.dumps({"steps_per_s": steps / (time.perf_counter() - start), "losses": losses}))


def add_arguments(parser, steps: int, warmup: int) -> None:
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--hand-tuned", action="store_true",
                        help="what an expert writes by hand for this workload: the fused optimizer "
                             "(and channels_last for the CNN)")
