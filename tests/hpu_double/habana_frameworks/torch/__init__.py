"""Test double of habana_frameworks.torch: importing it "loads the bridge" and registers torch.hpu."""

import torch

from habana_frameworks.torch import (  # noqa: F401
    core,
    hpex,  # noqa: F401
    hpu,
    utils,
)

__version__ = "1.19.0-double"

if getattr(torch, "hpu", None) is not hpu:
    if hasattr(torch, "hpu"):
        # Only a test process re-imports the bridge (after switching lazy/eager); real ones never do.
        delattr(torch, "hpu")
    torch._register_device_module("hpu", hpu)
