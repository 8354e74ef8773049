"""Spark's entry point for ``format("dcp")``.

Spark imports every installed top-level ``pyspark_*`` module when a session first looks a
data source up, and registers its ``DefaultSource``. So installing this project with the
``spark`` extra is enough: no ``spark.dataSource.register`` call is needed.
"""

from dcp.spark.source import DcpDataSource as DefaultSource

__all__ = ["DefaultSource"]
