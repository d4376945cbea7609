"""Agent frameworks whose pins clash with the main test environment, each in its own venv built
by `.ci/frameworks_env.sh` (`.venv-autogen`, `.venv-crewai`: this repository installed plainly,
as in a user's agent environment, plus the framework). The agent runs with that venv's
`opentelemetry-instrument`; the policy server and `spanrl receive` run here, in the main
environment. CI builds the venvs after the main suite, then runs:

    python -m pytest -q tests/frameworks

A module is collected only where its framework's venv exists (the main suite's run, before the
build, collects none); nothing here is skipped where it runs.
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.conftest import policy_server, receiver  # noqa: F401  (the shared fixtures)

REPO = Path(__file__).resolve().parents[2]
FRAMEWORK_VENVS = {"test_frameworks_autogen.py": ".venv-autogen", "test_frameworks_crewai.py": ".venv-crewai",
                   "test_frameworks_calc_autogen_training.py": ".venv-autogen"}

collect_ignore = [module for module, venv in FRAMEWORK_VENVS.items()
                  if not (REPO / venv / "bin" / "opentelemetry-instrument").exists()]
