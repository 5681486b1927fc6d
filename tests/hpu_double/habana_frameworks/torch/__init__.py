"""Test double of habana_frameworks.torch: importing it "loads the bridge" and registers torch.hpu."""
import torch

from habana_frameworks.torch import core, hpu, utils  # noqa: F401
from habana_frameworks.torch import hpex  # noqa: F401

__version__ = "1.19.0-double"

if getattr(torch, "hpu", None) is not hpu:
    if hasattr(torch, "hpu"):
        # Only a test process re-imports the bridge (after switching lazy/eager); real ones never do.
        delattr(torch, "hpu")
    torch._register_device_module("hpu", hpu)
