"""A regular (non-editable) install of spanrl, used from the repository root, imports itself.

The repository's folders are mapped into the one ``spanrl`` package by pyproject's
``package-dir`` (``core/`` is ``spanrl`` itself, ``instrumentation/`` is
``spanrl.instrumentation``, ...). No folder at the root may be named like the package: Python
puts the working directory first on ``sys.path``, so an agent started under
``opentelemetry-instrument`` from the repository root would import such a folder instead of the
install and fail (``No module named 'spanrl.exporter'``). The test builds a wheel of this
checkout, installs it with ``--no-deps`` into a folder of its own and imports every package of
the tree, and spanrl's OpenTelemetry entry points, from the repository root; each must come from
the install. It also checks that the wheel holds every package folder of the tree, so a new
subpackage cannot be left out of pyproject's package list.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the folders pyproject maps into the spanrl package, and the import path of each
MAPPED = {"core": "spanrl", "instrumentation": "spanrl.instrumentation", "exporter": "spanrl.exporter",
          "otlp_receiver": "spanrl.otlp_receiver", "trainer_bridge": "spanrl.trainer_bridge",
          "runner": "spanrl.runner", "examples": "spanrl.examples"}


def tree_packages() -> set[str]:
    """Every package of the source tree (a folder with ``__init__.py`` under a mapped folder)."""
    packages = set()
    for folder, package in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            packages.add(".".join([package, *relative.parts]) if relative.parts else package)
    return packages


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """``(wheel, site folder)``: a wheel of this checkout, installed without dependencies."""
    work = tmp_path_factory.mktemp("regular-install")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    built = subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(work), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = work.glob("spanrl-*.whl")
    site = work / "site"
    done = subprocess.run([*pip, "install", "-q", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return wheel, site


def test_no_root_folder_shadows_the_package():
    assert not (ROOT / "spanrl").exists(), "a spanrl/ folder at the root shadows the installed package"


def test_the_wheel_holds_every_package_of_the_tree(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = {os.path.dirname(name).replace("/", ".") for name in archive.namelist()
                    if name.endswith("/__init__.py")}
    assert tree_packages() - in_wheel == set(), "add the missing packages to [tool.setuptools] packages"


def test_every_package_imports_from_the_install_in_the_repository_root(installed):
    _, site = installed
    code = (
        "import importlib, json, sys\n"
        "from importlib.metadata import entry_points\n"
        f"names = {sorted(tree_packages())!r}\n"
        "files = {n: importlib.import_module(n).__file__ for n in names}\n"
        "hooks = [ep.load().__module__ for group in ('opentelemetry_pre_instrument', 'opentelemetry_post_instrument')\n"
        "         for ep in entry_points(group=group) if ep.name == 'spanrl']\n"
        "print(json.dumps({'files': files, 'hooks': hooks}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    outside = {name: path for name, path in found["files"].items() if not path.startswith(str(site))}
    assert outside == {}, "imported from outside the install"
    assert found["hooks"] == ["spanrl.exporter.hook", "spanrl.exporter.hook"]
