"""Benchmarks: the side-by-side table against Redis Streams (``python -m tools.bench``,
``cli.py`` with ``scenarios.py``, ``procs.py``, ``worker.py``, ``report.py``), the Spark
read (``python -m tools.bench.spark``) and the micro-benchmarks of single layers
(``python -m tools.bench.micro.<codec|engine|hotpath>``). See ``tools/README.md`` and
``docs/benchmarks.md``.
"""
