"""``python -m autogaudi``: see :mod:`autogaudi.launcher`."""

import sys

from autogaudi.launcher import main

sys.exit(main())
