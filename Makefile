# Every target installs into .venv first if needed; a fresh machine needs only python3.11 and make.
# The install includes libtpu (the tpu extra, Linux x86-64): the tests compile for Cloud TPU
# topologies with it, on CPU (tests/conftest.py sets JAX_PLATFORMS=cpu).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKDIR ?= runs/digits_cnn
CONFIG ?= configs/digits_cnn.py
# pytest-xdist workers for make test and test-slow (CI has 2 cores; 0 runs in this process).
# One test file per worker at a time (loadfile): a file's module fixtures compile once.
TEST_WORKERS ?= 2

.PHONY: install train eval test test-slow lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --quiet -e '.[test,tpu]'  # -qq: no setuptools banner; errors still show
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python -m replicator train --config $(CONFIG) --workdir $(WORKDIR)

eval: $(STAMP)
	$(BIN)/python -m replicator eval --config $(CONFIG) --workdir $(WORKDIR)

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m slow

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

lint: $(STAMP)
	$(BIN)/ruff check replicator experiments configs tests benchmarks examples
	$(BIN)/ruff format --check replicator experiments configs tests benchmarks examples

clean:
	rm -rf $(VENV) runs
