"""The skip rule of tests/conftest.py, in a real pytest run (a subprocess) over probe tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PROBES = '''
import pytest

def test_passes():
    pass

@pytest.mark.skipif(True, reason="no GPU on this machine")
def test_needs_a_gpu():
    pass
'''


def run_probes(tmp_path: Path, extra: str = "", *pytest_args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_probes.py").write_text(PROBES + extra)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    # the rule as a plugin (`-p conftest` is tests/conftest.py); the probes' folder has no conftest of its own
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-c", os.devnull, *pytest_args, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_for_a_missing_gpu_passes(tmp_path):
    result = run_probes(tmp_path)
    assert result.returncode == 0, result.stdout
    assert "1 passed, 1 skipped" in result.stdout and "not allowed" not in result.stdout


def test_any_other_skip_fails_the_run_and_is_named(tmp_path):
    result = run_probes(tmp_path, '''
def test_needs_a_package():
    pytest.importorskip("a_package_nobody_installed")
''')
    assert result.returncode == 1, result.stdout
    assert "skips that are not allowed" in result.stdout
    assert "test_needs_a_package: could not import 'a_package_nobody_installed'" in result.stdout


def test_the_rule_holds_when_xdist_spreads_the_tests_over_workers(tmp_path):
    # CI runs the suite with `-n 2`: skips happen in the workers, the verdict in the controller
    collected_away = 'import pytest\npytest.importorskip("a_package_nobody_installed")\n'
    (tmp_path / "test_collected_away.py").write_text(collected_away)
    result = run_probes(tmp_path, '''
def test_needs_a_package():
    pytest.importorskip("another_package_nobody_installed")
''', "-n", "2")
    assert result.returncode == 1, result.stdout
    assert "test_needs_a_package: could not import 'another_package_nobody_installed'" in result.stdout
    assert "test_collected_away.py: could not import 'a_package_nobody_installed'" in result.stdout
    gpu_only = tmp_path / "gpu_only"
    gpu_only.mkdir()
    allowed = run_probes(gpu_only, "", "-n", "2")
    assert allowed.returncode == 0 and "1 passed, 1 skipped" in allowed.stdout, allowed.stdout
