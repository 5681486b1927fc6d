"""What autogaudi's hooks add to each call a training step makes: backward, no_grad, forward, item().

    python benchmarks/step_overhead.py [--calls 3000] [--windows 5] [--rounds 3] [--out FILE]

In one process: each call timed over ``--calls`` repetitions, the median of ``--windows`` windows,
plain, then with ``autogaudi.enable()`` (after 2000 warm-up steps, so that the census and the
decisions are behind it), then plain again after ``disable()``; ``--rounds`` such rounds. The calls
are a regression-shaped step's: a tiny forward, a backward pass (with the gradient zeroed), an empty
``torch.no_grad()`` block (a hand-written parameter update's), ``.item()``. Host-bound loops of
sub-millisecond steps feel these costs; on a step of milliseconds they vanish.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import autogaudi

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as suite  # noqa: E402

WEIGHT = torch.randn(4, 1, requires_grad=True)


def forward():
    (WEIGHT * 2).sum()


def backward():
    loss = (WEIGHT * 2).sum()
    if WEIGHT.grad is not None:
        WEIGHT.grad.zero_()
    loss.backward()


def no_grad():
    with torch.no_grad():
        pass


def item():
    WEIGHT.sum().item()


CALLS = {"forward": forward, "backward": backward, "no_grad": no_grad, "item": item}


def timed(fn, calls: int, windows: int) -> float:
    """Microseconds per call: the median window."""
    per_call = []
    for _ in range(windows):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - began) / calls * 1e6)
    return statistics.median(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    rows = []
    for round_ in range(1, options.rounds + 1):
        before = {name: timed(fn, options.calls, options.windows) for name, fn in CALLS.items()}
        autogaudi.enable(quiet=True, no_cache=True)
        for _ in range(2000):
            backward()
            no_grad()
        under = {name: timed(fn, options.calls, options.windows) for name, fn in CALLS.items()}
        autogaudi.disable()
        after = {name: timed(fn, options.calls, options.windows) for name, fn in CALLS.items()}
        for name in CALLS:
            plain = (before[name] + after[name]) / 2
            rows.append(
                {
                    "round": round_,
                    "call": name,
                    "plain_us": round(plain, 2),
                    "autogaudi_us": round(under[name], 2),
                    "added_us": round(under[name] - plain, 2),
                }
            )
            print(rows[-1], flush=True)
    added = {name: statistics.median(row["added_us"] for row in rows if row["call"] == name) for name in CALLS}
    result = {
        **suite.provenance(),
        "median_added_us": added,
        "rows": rows,
    }
    print(f"median µs added per call: {added}")
    if options.out:
        with open(options.out, "w") as out:
            out.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
