# The two commands a newcomer needs: `make run` and `make test`.
# Others: `make test-fast` (protocol + engine, under a minute), `make chaos-short` (the short
# reliability runs CI does), `make bench` (the benchmark table), `make typecheck`,
# `make cluster` / `make cluster-down` (etcd and three nodes on loopback: docs/cluster.md).
# Both bootstrap what they need: a .venv with the project and its extras, and (for tests)
# Debian's tshark and etcd-server (tests/etcd/) when they are missing and we are root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA ?= ./dcp-data
# `make cluster`: data, logs and pid files of its etcd and nodes
CLUSTER_DIR ?= ./dcp-cluster
# extra flags for `make bench`, e.g. BENCH_ARGS="--tiny" or BENCH_ARGS="--no-peer"
BENCH_ARGS ?=
# extra pytest flags for `make test`, e.g. PYTEST_ARGS="-n 2" (pytest-xdist)
PYTEST_ARGS ?=

.PHONY: run test test-fast chaos-short lint typecheck typing-baseline venv tshark etcd bench clean \
  cluster cluster-down

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,spark]'
	touch $(STAMP)

venv: $(STAMP)

tshark:
	@command -v tshark >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tshark >/dev/null) \
	      || echo "warning: could not install tshark; wire-capture tests will be skipped"; \
	  else echo "note: not root, tshark not installed; wire-capture tests will be skipped"; fi; }

# etcd (3.4, Debian's etcd-server) for the cluster tests: tests/etcd/ start a throwaway one.
etcd:
	@command -v etcd >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null) \
	      || echo "warning: could not install etcd-server; etcd tests will be skipped"; \
	  else echo "note: not root, etcd-server not installed; etcd tests will be skipped"; fi; }

run: $(STAMP)
	$(BIN)/dcp-server --data-dir $(DATA)

# A local cluster in the background: etcd on 127.0.0.1:2379 (data $(CLUSTER_DIR)/etcd) and
# nodes n1..n3 (dcp-server --cluster http://127.0.0.1:2379 --node-name nI) on
# 127.0.0.1:11210-11212 (data $(CLUSTER_DIR)/nI); returns once every node has joined and
# prints how to connect. Processes already running from an earlier `make cluster` are kept.
# `make cluster-down` stops them (SIGTERM, SIGKILL after 5 s) and keeps the data.
# (tools/local_cluster.py does the work.)
cluster: $(STAMP) etcd
	$(BIN)/python -m tools.local_cluster up --dir $(CLUSTER_DIR)

cluster-down:
	$(PY) -m tools.local_cluster down --dir $(CLUSTER_DIR)

lint: $(STAMP)
	$(BIN)/ruff check dcp tests tools
	$(BIN)/ruff format --check dcp tests tools pyspark_dcp

test: $(STAMP) tshark etcd
	$(BIN)/ruff check dcp tests tools
	$(BIN)/ruff format --check dcp tests tools pyspark_dcp
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_ARGS)

# The layers with no network and no subprocess: the quick loop while editing the codec or the
# engine (about 30 s). Serial: on a 2-core machine `-n 2` (pytest-xdist) was slower (33 s
# against 26 s); add PYTEST_ARGS="-n auto" where there are more cores.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) tests/protocol tests/engine tests/test_layering.py \
	  -m "not slow and not tshark"

# What CI runs of the reliability harness: every chaos scenario in its short form, plus the
# abuse smoke run (tests/chaos/). The long runs: python -m tools.chaos --help.
chaos-short: $(STAMP)
	$(BIN)/python -m pytest -q tests/chaos

# The benchmark table against Redis Streams at the tool's default sizes (long: see
# docs/benchmarks.md); BENCH_ARGS=--tiny for a CI-sized run in seconds.
bench: $(STAMP)
	$(BIN)/python -m tools.bench all --slow-reps 1 $(BENCH_ARGS)

# The full mypy report; tests/test_typing.py holds it to tests/typing_baseline.txt.
typecheck: $(STAMP)
	$(BIN)/python -m mypy

typing-baseline: $(STAMP)
	$(BIN)/python -m tests.test_typing --update

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
