# The two commands a newcomer needs: `make run` and `make test`.
# Both bootstrap what they need: a .venv with the project and its extras, and (for tests)
# Debian's tshark when it is missing and we are root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA ?= ./dcp-data

.PHONY: run test lint venv tshark bench clean

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

run: $(STAMP)
	$(BIN)/dcp-server --data-dir $(DATA)

lint: $(STAMP)
	$(BIN)/ruff check dcp tests tools

test: $(STAMP) tshark
	$(BIN)/ruff check dcp tests tools
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
