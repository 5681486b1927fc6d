"""Test double of habana_frameworks.torch: importing it "loads the bridge": torch.hpu registered, and
HPU tensors (the double's, :mod:`habana_frameworks.torch._device`) usable by ``device="hpu"``."""

import importlib
import os
import sys

import habana_frameworks

habana_frameworks.is_loaded = True  # as the bridge, first: torch's autoload during the import below does nothing

import torch  # noqa: E402

# The bridge's native library loads against torch, so only after it: until then the package is half
# imported and its modules cannot be (a script that imports the bridge first, reaching torch's import
# hooks from inside this import, finds it so).
_native_library_loaded = True

from habana_frameworks.torch import (  # noqa: E402, F401
    _device,
    _release,
    core,
    hpex,
    hpu,
    utils,
)

__version__ = _release.VERSION

if getattr(torch, "hpu", None) is not hpu:
    if hasattr(torch, "hpu"):
        # Only a test process re-imports the bridge (after switching lazy/eager); real ones never do.
        delattr(torch, "hpu")
    torch._register_device_module("hpu", hpu)
_device.install()
if "torch._dynamo" in sys.modules:  # dynamo may have looked for backends before the bridge loaded
    importlib.import_module("habana_frameworks.torch._compile").register()

# The bridge reads PT_HPU_GPU_MIGRATION when it loads and then loads Intel's GPU migration toolkit.
if os.environ.get("PT_HPU_GPU_MIGRATION") == "1":
    import habana_frameworks.torch.gpu_migration  # noqa: F401, E402
