# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.jitckpt-installed
PYTEST_ARGS ?=

.PHONY: test unit integration lint fmt demo bench image image-test k8s-check clean

$(STAMP): requirements-dev.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found; set PYTHON=/path/to/python3.11" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

integration: $(STAMP)
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

demo: $(STAMP)
	@echo "make demo: the preempt-and-resume demo arrives with the pod harness (issue 5)." >&2
	@exit 2

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
