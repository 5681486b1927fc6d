"""Trains the test GPT (tests/gpt_model.py) at batch 16: the doctor's memory projection reads its step."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.gpt_model import train  # noqa: E402

train(steps=50)
