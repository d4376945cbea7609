"""A plain install works: in a fresh virtual environment holding only spanrl (built as a wheel
from this checkout) and ``openai`` with their dependencies, no extras, no LangChain, an ordinary
OpenAI-SDK agent under ``opentelemetry-instrument`` exports LLM spans carrying the ids the
endpoint (vLLM's recorded answers) sent.

This is what OpenTelemetry's loader decides from the ``instruments-any`` extra (Anthropic's SDK is
not installed here): were it to need a library missing here, ``opentelemetry-instrument`` would
skip spanrl's instrumentor (saying so at DEBUG only) and the spans would carry no ids. To stay
fast and download nothing, the environment (``python -m venv --without-pip``) gets the wheel by ``pip install --no-deps
--no-index``, and a copy of the installed files (their ``RECORD``) of the exact versions this
test environment has of every package the wheel's own metadata requires, directly or not (the
set ``pip install spanrl openai`` resolves to here).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from spanrl.instrumentation import semconv

ROOT = Path(__file__).resolve().parents[2]


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The base requirements (no extra) in a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    requirements = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def pinned_closure(requirements: list[Requirement]) -> list[str]:
    """``name==version`` for every distribution ``requirements`` need, directly or not, at the
    versions installed here (what pip resolves to with this environment's constraints)."""
    pins: dict[str, str] = {}
    todo = [(r, "") for r in requirements]
    while todo:
        requirement, _ = todo.pop()
        name = canonicalize_name(requirement.name)
        extras = set(requirement.extras)
        if name in pins and not extras:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError as exc:
            raise AssertionError(f"{name} is required by spanrl but not installed in the test environment") from exc
        assert requirement.specifier.contains(dist.version, prereleases=True), (requirement, dist.version)
        pins[name] = dist.version
        for spec in dist.requires or ():
            dependency = Requirement(spec)
            wanted = dependency.marker is None or any(
                dependency.marker.evaluate({"extra": extra}) for extra in {"", *extras})
            if wanted:
                todo.append((dependency, name))
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def copy_installed(pin: str, venv: Path) -> None:
    """Put distribution ``name==version`` into ``venv`` as a copy of its files installed here (no
    index, no download); its console scripts get the venv's python in their first line."""
    name, version = pin.split("==")
    dist = distribution(name)
    assert dist.version == version and dist.files, (pin, dist.version)
    site_packages = venv / Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
    for file in dist.files:
        source = Path(dist.locate_file(file))
        if file.suffix == ".pyc" or not source.is_file():
            continue
        if file.parts[0] == "..":  # a console script: ../../../bin/NAME
            target = venv / "bin" / source.name
            lines = source.read_bytes().split(b"\n", 1)
            target.write_bytes(b"#!" + str(venv / "bin" / "python").encode() + b"\n" + lines[1]
                               if lines[0].startswith(b"#!") and len(lines) == 2 else source.read_bytes())
            target.chmod(0o755)
            continue
        target = site_packages / file
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


@pytest.fixture(scope="module")
def plain_venv(tmp_path_factory):
    """``<venv>/bin``: spanrl and openai, and what they need, nothing else."""
    work = tmp_path_factory.mktemp("plain-install")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    built = subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(work / "wheel"),
                            str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (work / "wheel").glob("spanrl-*.whl")
    pins = pinned_closure([*wheel_requirements(wheel), Requirement("openai")])
    assert not any(pin.startswith(("langchain", "torch")) for pin in pins), pins
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    installed = subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps",
                                "--no-index", "--no-compile", str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    for pin in pins:
        copy_installed(pin, venv)
    return venv / "bin"


def test_a_plain_install_records_the_engines_ids(plain_venv, trace_collector, vllm_recording, harness):
    python = str(plain_venv / "python")
    # a plain install: no LangChain, and OpenTelemetry's own check passes on the instruments-any extra
    check = ("import importlib.util, json\n"
             "from importlib.metadata import distribution\n"
             "from opentelemetry.instrumentation.dependencies import get_dist_dependency_conflicts\n"
             "print(json.dumps([importlib.util.find_spec('langchain_core') is None,\n"
             "                  str(get_dist_dependency_conflicts(distribution('spanrl')))]))\n")
    checked = subprocess.run([python, "-c", check], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout) == [True, "None"]

    env = harness.agent_environment(trace_collector.endpoint, vllm_recording.base_url)
    command = [str(plain_venv / "opentelemetry-instrument"), python, str(harness.agents / "openai_calls_agent.py"),
               "quick"]
    result = harness.run_process(command, env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    made = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(made) == 4
    assert all(body.get(semconv.REQUEST_RETURN_TOKEN_IDS) is True for body in vllm_recording.requests)

    def llm_spans():
        return [s for s in trace_collector.spans() if s["attributes"].get(semconv.OPENINFERENCE_SPAN_KIND) == "LLM"]

    assert harness.wait_for(lambda: len(llm_spans()) >= len(made))
    spans = {span["attributes"].get(semconv.GENAI_RESPONSE_ID): span for span in llm_spans()}
    assert set(spans) == set(made.values())
    for label, response_id in made.items():
        attributes, sent = spans[response_id]["attributes"], vllm_recording.sent[response_id]
        assert attributes[semconv.LLM_PROMPT_TOKEN_IDS] == tuple(sent["prompt_token_ids"]), label
        assert attributes[semconv.llm_response_token_ids(0)] == tuple(sent["choices"][0]["token_ids"]), label
        assert attributes[semconv.LLM_POLICY_VERSION] == 7
