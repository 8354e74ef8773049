"""Old import path of ``batch_plan``; holds no code.

Rules of this module:
- Nothing in ``dcp`` or ``tests`` imports it; it is kept for ``tools/bench/spark.py``
  (owned elsewhere) and goes away when that file imports ``dcp.spark.batch_plan``.
"""

from .batch_plan import VbRange

__all__ = ["VbRange"]
