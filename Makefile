# buildkit: `make xl-mtp` installs and builds; `make test` installs and runs the tests.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# Two stamps: `make xl-mtp` installs buildkit and what a default build runs (mlx-vlm included);
# `make test` (and lint) add the test extras (pytest, pytest-xdist, ruff, moto, dask, ...).
STAMP   := $(VENV)/.installed
TESTSTAMP := $(VENV)/.installed-test
BUILDKIT := $(BIN)/buildkit
JOBS    ?= 2

.PHONY: install install-test xl xl-mtp oq4e-mtp-xl all fixture test lint bench bench-35b release clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e . -c constraints.txt
	$(BIN)/python -m compileall -q buildkit  # as a wheel install would: every run starts from bytecode
	touch $(STAMP)

$(TESTSTAMP): $(STAMP)
	$(BIN)/pip install --quiet -e ".[test]" -c constraints.txt
	touch $(TESTSTAMP)

install: $(STAMP)

install-test: $(TESTSTAMP)

xl xl-mtp oq4e-mtp-xl: $(STAMP)
	$(BUILDKIT) build $@ --jobs $(JOBS)

all: xl xl-mtp oq4e-mtp-xl

fixture: $(STAMP)
	$(BUILDKIT) fixture build/fixture

# pytest-xdist: one worker a core; a file's tests stay on one worker, so its module fixtures
# (a build shared by its tests) run once.
test: $(TESTSTAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile

lint: $(TESTSTAMP)
	$(BIN)/ruff format --check buildkit tests bench training
	$(BIN)/ruff check buildkit tests bench training

bench: $(STAMP)
	$(BIN)/python -m compileall -q buildkit  # edits since install: time bytecode, not compiles
	$(BIN)/python bench/bench.py
	# issue 28's ratios: oq4e-mtp-xl (and its GPTQ twin) against xl, the search against mx.quantize
	$(BIN)/python bench/oq4e_bench.py --builds --search --spec layers=31

# The real model's shapes (sparse source, ~65 GB free disk, ~10 min); not in CI.
bench-35b: $(STAMP)
	$(BIN)/python -m compileall -q buildkit
	$(BIN)/python bench/bench35b.py

release: $(STAMP)
	$(BUILDKIT) build xl --release
	$(BUILDKIT) build xl-mtp --release
	$(BUILDKIT) build oq4e-mtp-xl --release

clean:
	rm -rf out build
	find cache -mindepth 1 ! -name .gitkeep -delete
