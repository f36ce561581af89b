"""The code's own checks, run by CI with the tests: ruff's lint rules and its format, over the
package, the tests, the benchmarks and checks/ (pyproject.toml's [tool.ruff]), the layering's
import contracts (import-linter, [tool.importlinter]) and mypy's types over the core, the engine
and the config ([tool.mypy])."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREES = ["pagedllm", "tests", "benchmarks", "checks"]
BIN = os.path.dirname(sys.executable)
RUFF = shutil.which("ruff", path=BIN) or shutil.which("ruff")
LINT_IMPORTS = shutil.which("lint-imports", path=BIN) or shutil.which("lint-imports")
MYPY = shutil.which("mypy", path=BIN) or shutil.which("mypy")
needs_mypy = pytest.mark.skipif(MYPY is None, reason="mypy is not installed (pip install -e '.[test]')")
needs_ruff = pytest.mark.skipif(RUFF is None, reason="ruff is not installed (pip install -e '.[test]')")


def ruff(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([RUFF, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_ruff
def test_the_code_passes_ruffs_lint_rules():
    result = ruff("check", *TREES)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_ruff
def test_the_code_is_formatted():
    result = ruff("format", "--check", *TREES)
    assert result.returncode == 0, result.stdout + result.stderr + "\n(run: ruff format " + " ".join(TREES) + ")"


@needs_ruff
def test_a_violation_fails_both_checks(tmp_path):
    """What CI meets when code breaks the rules: an unused import, imports out of order, a line
    the formatter would split."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n\nx = {  'a':1 }\n")
    config = ("--config", os.path.join(ROOT, "pyproject.toml"))
    lint = ruff("check", *config, str(bad), cwd=str(tmp_path))
    assert lint.returncode == 1 and "F401" in lint.stdout and "I001" in lint.stdout, lint.stdout + lint.stderr
    assert ruff("format", "--check", *config, str(bad), cwd=str(tmp_path)).returncode == 1


@pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (pip install -e '.[test]')")
def test_the_layering_contracts_hold():
    result = subprocess.run([LINT_IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def mypy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MYPY, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@needs_mypy
def test_the_core_engine_and_config_type_check():
    result = mypy()  # the files and settings of [tool.mypy]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@needs_mypy
def test_a_type_error_fails_the_type_check(tmp_path):
    """What CI meets when a checked module's types do not add up: a str passed where the engine
    core's message takes a list of token ids."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from pagedllm.core.messages import EngineCoreRequest\n"
        "from pagedllm.sampling_params import SamplingParams\n\n"
        "EngineCoreRequest('r', 'not token ids', SamplingParams(), 4)\n"
    )
    result = mypy(str(bad))
    assert result.returncode == 1 and "arg-type" in result.stdout, result.stdout + result.stderr
