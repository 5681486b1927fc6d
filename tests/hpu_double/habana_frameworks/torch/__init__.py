"""Test double of habana_frameworks.torch: importing it "loads the bridge" and registers torch.hpu."""

import os

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

# The bridge reads PT_HPU_GPU_MIGRATION when it loads and then loads Intel's GPU migration toolkit.
if os.environ.get("PT_HPU_GPU_MIGRATION") == "1":
    import habana_frameworks.torch.gpu_migration  # noqa: F401, E402

# The one place the double reaches into autogaudi: the probe that says which device a tensor is on
# (autogaudi.placement.device_type_of), answered from the double's record, since it cannot hold HPU tensors.
try:
    import autogaudi.placement as _placement  # noqa: E402
except ImportError:  # a process without autogaudi
    _placement = None
if _placement is not None:
    from habana_frameworks.torch import _calls as _placement_record  # noqa: E402

    _placement.device_type_of = _placement_record.device_type_of
