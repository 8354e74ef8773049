"""Old import path of ``driver.Planner``; holds no code.

Rules of this module:
- Nothing in ``dcp`` or ``tests`` imports it; it is kept for ``tools/bench/spark.py``
  (owned elsewhere) and goes away when that file imports ``dcp.spark.driver``.
"""

from .driver import Planner

__all__ = ["Planner"]
