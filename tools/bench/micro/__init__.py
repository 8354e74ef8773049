"""Micro-benchmarks of one layer each, in process, no peer: ``codec`` (frame encode and
decode), ``engine`` (the storage engine without a server), ``hotpath`` (the server's and
the SDK's per-item paths). Each runs as ``python -m tools.bench.micro.<name> --help``.
"""
