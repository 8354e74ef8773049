"""``python -m dcp.ctl``: the same as the ``dcpctl`` console script."""

import sys

from .cli import main

sys.exit(main())
