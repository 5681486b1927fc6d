"""Trains the test GPT (tests/gpt_model.py, a torch model) for STEPS steps (5 by default); its call number OOM_AT
runs out of memory once, in OOM_WHERE (forward or backward; no OOM_AT: never). Prints the losses."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpt_model import OutOfMemoryGPT, train  # noqa: E402

at = int(os.environ["OOM_AT"]) if os.environ.get("OOM_AT") else None
losses, _ = train(steps=int(os.environ.get("STEPS", "5")), make=lambda: OutOfMemoryGPT(at, os.environ.get("OOM_WHERE")))
print("losses", *(loss.hex() for loss in losses), flush=True)
