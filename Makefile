# Two entry points on a fresh Linux machine: `make demo` and `make test`.
# Both create the virtual environment themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test check venv bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(wildcard /opt/wheels),--find-links /opt/wheels) -c constraints.txt -e '.[dev,fl]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/gputravel demo

# pytest exits 5 when it collects no test; that is a failure here, never a pass.
test: $(STAMP)
	$(BIN)/python -m pytest -q

# The fast tier: every test that starts no process (tests/conftest.py marks the rest `slow`).
check: $(STAMP)
	HYPOTHESIS_PROFILE=fast $(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/gputravel bench travel --sizes 4,8,16,32,64,128,256,512 --repeat 5 --json runs/bench-travel.json

clean:
	rm -rf $(VENV) runs .pytest_cache
