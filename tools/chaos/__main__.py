"""``python -m tools.chaos``: the reliability harness (see ``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
