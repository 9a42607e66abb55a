"""``python -m tools.chaos``: see :mod:`tools.chaos`."""

import sys

from tools.chaos.run import main

sys.exit(main())
