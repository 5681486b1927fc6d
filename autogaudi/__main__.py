"""``python -m autogaudi``: see :mod:`autogaudi.entry.launcher`."""

import sys

from autogaudi.entry.launcher import main

sys.exit(main())
