# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.jitckpt-installed
PYTEST_ARGS ?=

.PHONY: deepspeed-ops test test-py39 test-oldest test-gpu unit integration lint fmt docs demo bench image image-test k8s-check clean

$(STAMP): requirements-dev.txt requirements-deepspeed.txt requirements-states.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found; set PYTHON=/path/to/python3.11" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --upgrade --no-deps \
	  --target $(VENV)/deepspeed -r requirements-deepspeed.txt
	$(BIN)/python -m pip install --quiet --upgrade --no-deps \
	  --target $(VENV)/states -r requirements-states.txt
	rm -rf $(VENV)/states/test  # torchao's own tests, a top-level `test` that hides the stdlib's
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

venv: $(STAMP)

# DeepSpeed builds its CPU shared-memory collective op (deepspeed_shm_comm) with ninja in every
# ZeRO run that finds it unbuilt: ~90 CPU-seconds. The tests build it into the venv
# (TORCH_EXTENSIONS_DIR: tests/harness/training.py); .ci/run does it ahead, on idle CPU. A build
# killed mid-way leaves its lock, on which every later ZeRO run waits: this clears it first.
deepspeed-ops: $(STAMP)
	rm -f $(VENV)/torch_extensions/deepspeed_shm_comm/lock
	PYTHONPATH=$(VENV)/deepspeed TORCH_EXTENSIONS_DIR=$(VENV)/torch_extensions \
	  $(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"

# make test never needs podman: the image tests are `make image-test`.
test: $(STAMP)
	$(BIN)/python -m pytest -m "not podman" $(PYTEST_ARGS)

# The entrypoint and its hook run under the training image's own python3 in swap-in mode
# (>= 3.9): their own tests on python3.9, in .venv39 (pytest only; no torch). .ci/run calls it.
PYTHON39 ?= $(shell for p in python3.9 $$(pyenv root 2>/dev/null)/versions/3.9*/bin/python3.9; do \
	$$p -c '' 2>/dev/null && { command -v $$p; break; }; done)
PY39_TESTS := tests/unit/test_config.py tests/unit/test_settings.py tests/unit/test_manifest.py \
	tests/unit/test_status.py tests/unit/test_registry.py tests/unit/test_grace.py \
	tests/unit/test_hook_parts.py tests/unit/test_protocol.py tests/unit/test_s3_validity.py \
	tests/integration/test_entrypoint.py
test-py39:
	@test -n "$(PYTHON39)" || { echo "make: no working python3.9 (set PYTHON39=/path/to/python3.9)" >&2; exit 2; }
	@test -x .venv39/bin/pytest || { $(PYTHON39) -m venv .venv39 && \
	  .venv39/bin/python -m pip install --quiet "pytest<9" "pytest-timeout<3" && \
	  .venv39/bin/python -m pip install --quiet --no-deps -e .; }
	.venv39/bin/python -m pytest -p no:cacheprovider $(PY39_TESTS) $(PYTEST_ARGS)

# The state matrix (tests/system/test_states.py) on the oldest supported stack: the training
# child runs under .venv-oldest's python (requirements-oldest.txt: torch 2.7.1, transformers
# 4.57), with its own states/ (requirements-oldest-states.txt); the entrypoint and pytest are
# .venv's. .ci/run calls it.
OLDEST       := .venv-oldest
OLDEST_STAMP := $(OLDEST)/.jitckpt-installed
$(OLDEST_STAMP): requirements-oldest.txt requirements-oldest-states.txt
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found; set PYTHON=/path/to/python3.11" >&2; exit 2; }
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST)/bin/python -m pip install --quiet -r requirements-oldest.txt
	$(OLDEST)/bin/python -m pip install --quiet --upgrade --no-deps \
	  --target $(OLDEST)/states -r requirements-oldest-states.txt
	rm -rf $(OLDEST)/states/test
	touch $@

test-oldest: $(STAMP) $(OLDEST_STAMP)
	JITCKPT_TEST_PYTHON=$(abspath $(OLDEST))/bin/python \
	  $(BIN)/python -m pytest tests/system/test_states.py $(PYTEST_ARGS)

# On a machine with a CUDA GPU (never in CI): the GPU paths of the saves (tests/gpu: bytes equal to
# torch's and safetensors', snapshots, a Trainer on the GPU under the entrypoint) and bench_jit
# with the model on the GPU. It runs under the machine's own python3 with a CUDA build of torch
# and transformers (GPU_PYTHON=... to choose), with this checkout's packages on PYTHONPATH.
GPU_PYTHON ?= python3
GPU_PATH   := $(abspath entrypoint):$(abspath sidecar):$(abspath tests)
test-gpu:
	@$(GPU_PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	  'make test-gpu: no CUDA device for $(GPU_PYTHON) (torch ' + torch.__version__ + ')')"
	PYTHONPATH=$(GPU_PATH) $(GPU_PYTHON) -m pytest -p no:cacheprovider tests/gpu $(PYTEST_ARGS)
	PYTHONPATH=$(GPU_PATH) $(GPU_PYTHON) bench/bench_jit.py 3 --cuda

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

integration: $(STAMP)
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/hadolint Containerfile

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The README's configuration table and docs/monitoring.md's metrics table, from the code
# (a unit test checks them).
docs: $(STAMP)
	$(BIN)/python tools/readme_tables.py

# A job preempted twice at random steps, resumed from S3 (moto on 127.0.0.1) in fresh pods,
# compared with an uninterrupted run. DEMO_ARGS='--seed N' repeats a run; outputs in demo-out/.
DEMO_ARGS ?=
demo: $(STAMP)
	$(BIN)/python demo/demo.py $(DEMO_ARGS)

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# Both Containerfile targets. Without BASE_IMAGE/SIDECAR_BASE they are built on local bases
# (debootstrap bookworm + the local torch CPU wheel; no registry needed), tagged :dev.
# With them: make image BASE_IMAGE=docker.io/pytorch/pytorch:... SIDECAR_BASE=python:3.11-slim
image: $(STAMP)
	$(BIN)/python tests/harness/images.py --tag $(or $(IMAGE_TAG),dev) \
	  $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE)) $(if $(SIDECAR_BASE),--sidecar-base $(SIDECAR_BASE))

# Builds both images on the local bases and runs them with podman (runc, cgroupfs).
image-test: $(STAMP)
	$(BIN)/python tests/harness/images.py --tag test
	$(BIN)/python -m pytest -m podman tests/images $(PYTEST_ARGS)

# Strict validation of k8s/ for Kubernetes 1.29 to the newest bundled schema, plus the
# agreement, PromQL and dashboard checks (also part of make test).
k8s-check: $(STAMP)
	$(BIN)/python -m pytest tests/k8s $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv39 $(OLDEST) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
