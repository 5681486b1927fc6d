"""Not part of the real bridge: which Gaudi software release the double models (``HPU_DOUBLE_RELEASE``).

``latest`` (the default): eager mode with torch.compile by default (``PT_HPU_LAZY_MODE`` default 0),
the bridge loaded by ``import torch`` through its ``torch.backends`` entry point. ``1.19``: lazy mode
by default, so not autoloaded (the bridge's autoload skips lazy mode): the script imports the bridge.
"""

import os

RELEASES = {"latest": "1.23.0", "1.19": "1.19.0"}
RELEASE = os.environ.get("HPU_DOUBLE_RELEASE", "latest")
if RELEASE not in RELEASES:
    raise ImportError(f"HPU_DOUBLE_RELEASE={RELEASE!r}: the double models {', '.join(RELEASES)}")
VERSION = RELEASES[RELEASE] + "-double"
LAZY_BY_DEFAULT = RELEASE == "1.19"
