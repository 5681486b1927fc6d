"""Test double of Intel's habana_frameworks package (see tests/hpu_double/README.md).

``__autoload`` is the ``torch.backends`` entry point (``habana_frameworks-*.dist-info`` beside this
folder) that torch >= 2.5 calls at the end of ``import torch``. As in the bridge: ``PT_HPU_AUTOLOAD``
(``1``/``0``) decides where set; otherwise a process in lazy mode is not autoloaded, judged on
``PT_HPU_LAZY_MODE`` with the modelled release's default (``HPU_DOUBLE_RELEASE``).
"""

import os

is_loaded = False  # set by habana_frameworks.torch: an autoload after an explicit import does nothing


def _release_is_lazy_by_default() -> bool:
    return os.environ.get("HPU_DOUBLE_RELEASE", "latest") == "1.19"


def is_autoload_enabled() -> bool:
    autoload = os.environ.get("PT_HPU_AUTOLOAD", "-1")
    if autoload in ("0", "1"):
        return autoload == "1"
    return os.environ.get("PT_HPU_LAZY_MODE", "1" if _release_is_lazy_by_default() else "0") != "1"


def __autoload():
    if is_loaded or not is_autoload_enabled():
        return
    import habana_frameworks.torch  # noqa: F401
