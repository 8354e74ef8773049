"""``python -m tools.bench``: the benchmark table (see ``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
