# Two entry points on a fresh Linux machine: `make demo` and `make test`.
# Both create the virtual environment themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test check lint venv bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(wildcard /opt/wheels),--find-links /opt/wheels) -c constraints.txt -e '.[dev,fl]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/gputravel demo

# pytest exits 5 when it collects no test; that is a failure here, never a pass. The tests
# wait on processes more than they compute: a worker a core (at most 4), each taking whole
# files (a module's cohort boots once), halved the suite on 2 cores when it came in (10:32 -> about
# 6:30); the suite has grown since: 8:12 on the 2-core VM, 2026-11-29.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

# The fast tier: every test that starts no process (tests/conftest.py marks the rest `slow`).
check: $(STAMP)
	HYPOTHESIS_PROFILE=fast $(BIN)/python -m pytest -q -m "not slow"

# Static checks (configured in pyproject.toml): ruff over the whole tree, mypy --strict over the
# core packages. CI runs them before the tests (.ci/run); `make test` runs the tests only.
lint: $(STAMP)
	$(BIN)/ruff check
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/gputravel bench travel --sizes 4,8,16,32,64,128,256,512 --repeat 5 --json runs/bench-travel.json

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
