"""Developer tools: benchmarks (``tools.bench``), the reliability harness (``tools.chaos``),
the protocol test vectors (``tools.vectors``) and the hypothesis strategies the tests and
the fuzzer share (``tools.strategies``). See ``tools/README.md``.

Rules of this package: dev-only (never imported by ``dcp``, never shipped: the wheel
packages ``dcp*`` only); run from the repository root, ``python -m tools.<name>``, so the
package is importable without touching ``sys.path``; it may need the ``dev`` extra
(hypothesis, psutil, redis...).
"""
