"""Importing the compiler aside: whether a thread importing inductor hides it behind eager steps.

    python benchmarks/import_aside.py [--rounds 3] [--seconds 3] [--out benchmarks/results/import_aside-<machine>.json]

A warm second run's capture one-off starts with importing ``torch._inductor.compile_fx`` (its lowering
and decomposition tables), which the cache cannot skip. Where the run knows from its cache that it
will capture, that import could start in a thread while the script trains eagerly. Each mode runs
in a fresh process that trains a 4-layer transformer encoder (64 wide, batch 32 of 16 tokens,
AdamW) eagerly for ``--seconds`` after 5 warm-up steps, ``torch._dynamo`` already imported (as a
training script's optimizer imports it):

- *none*: eager steps only;
- *sequential*: the import first, then eager steps for the rest of the window;
- *aside*: the import in a thread started with the window, eager steps meanwhile.

Figures: the steps the window held and the import's seconds (sequential: its own time; aside: when
the thread finished). Aside hides the import where it holds more steps than sequential.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as suite  # noqa: E402

MODES = ("none", "sequential", "aside")

CHILD = r"""
import json, sys, threading, time
import torch, torch._dynamo
mode, seconds = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(64, 4, 256, batch_first=True) for _ in range(4)])
optimizer = torch.optim.AdamW(model.parameters())
x = torch.randn(32, 16, 64)
def step():
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
for _ in range(5):
    step()
done = {}
def import_compiler():
    began = time.perf_counter()
    import torch._inductor.compile_fx  # noqa: F401
    done["import_s"] = time.perf_counter() - began
start = time.perf_counter()
thread = None
if mode == "sequential":
    import_compiler()
elif mode == "aside":
    thread = threading.Thread(target=lambda: (import_compiler(), done.setdefault("at_s", time.perf_counter() - start)))
    thread.start()
steps = 0
while time.perf_counter() - start < seconds or (thread is not None and thread.is_alive()):
    step()
    steps += 1
print(json.dumps({"steps": steps, "window_s": round(time.perf_counter() - start, 3),
                  **{key: round(value, 3) for key, value in done.items()}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    rows = []
    for round_ in range(1, options.rounds + 1):
        for mode in MODES:
            load = round(os.getloadavg()[0], 2)
            done = subprocess.run(
                [sys.executable, "-c", CHILD, mode, str(options.seconds)], capture_output=True, text=True, check=True
            )
            rows.append({"round": round_, "mode": mode, "load_before": load, **json.loads(done.stdout)})
            print(rows[-1], flush=True)
    steps = {mode: statistics.median(row["steps"] for row in rows if row["mode"] == mode) for mode in MODES}
    result = {
        **suite.provenance(),
        "seconds": options.seconds,
        "median_steps": steps,
        "rows": rows,
    }
    out = Path(options.out or HERE / "results" / f"import_aside-{result['machine']}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"median steps in {options.seconds} s: {steps}; written to {out}")


if __name__ == "__main__":
    main()
