"""``python -m tools.modelserver``: see :mod:`tools.modelserver`."""

import sys

from tools.modelserver import main

sys.exit(main())
