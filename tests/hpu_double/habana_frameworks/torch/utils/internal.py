"""is_lazy(): PT_HPU_LAZY_MODE read once at import, "!= 0" means lazy; its default is the modelled
release's (1 in 1.19, 0 since: eager with torch.compile)."""

import os

from habana_frameworks.torch._release import LAZY_BY_DEFAULT

_LAZY = os.environ.get("PT_HPU_LAZY_MODE", "1" if LAZY_BY_DEFAULT else "0") != "0"


def is_lazy():
    return _LAZY
