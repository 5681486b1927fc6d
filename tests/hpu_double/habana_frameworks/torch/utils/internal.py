"""is_lazy(): PT_HPU_LAZY_MODE read once at import, "!= 0" means lazy (default 1, as in v1.19)."""

import os

_LAZY = os.environ.get("PT_HPU_LAZY_MODE", "1") != "0"


def is_lazy():
    return _LAZY
