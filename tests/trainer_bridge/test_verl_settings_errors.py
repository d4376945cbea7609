"""`backend: verl` set up wrong, as a user would: one clear line naming the fix, non-zero exit.

Runs in the main test environment, which has verl's Python package but no vLLM, so "verl is not
installed" is real here (the verl backend's own tests run in `.venv-verl`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spanrl_train(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_SPANRL_")}
    return subprocess.run(
        [sys.executable, "-m", "spanrl", "train", "--tasks", str(tasks), "--output-dir", str(tmp_path / "run"),
         "--store", str(tmp_path / "spanrl.db"), "--steps", "1", "--bridge-port", "0", *flags],
        capture_output=True, text=True, timeout=180, env=env, cwd=REPO,
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    path = str(tmp_path_factory.mktemp("model") / "tiny")
    create_model_dir(path, preset="tiny", seed=0)
    return path


def test_unknown_backend_names_the_choices(tmp_path, model_dir):
    line = one_line_error(spanrl_train(tmp_path, "--model", model_dir, "--backend", "megatron"))
    assert "megatron" in line and "'torch'" in line and "'verl'" in line


def test_verl_not_installed_names_the_install_commands(tmp_path, model_dir):
    line = one_line_error(spanrl_train(tmp_path, "--model", model_dir, "--backend", "verl", "--verl-cpu-mode", "on"))
    assert "vllm" in line and "spanrl[verl-cpu]" in line and "pip install --no-deps verl==0.9.1" in line


def test_cpu_mode_off_without_a_gpu_says_to_turn_it_on(tmp_path, model_dir):
    result = spanrl_train(tmp_path, "--model", model_dir, "--backend", "verl", "--verl-cpu-mode", "off")
    if torch.cuda.is_available():  # a GPU machine gets past this check (to the missing vLLM here)
        assert "cpu_mode" not in result.stderr
        return
    line = one_line_error(result)
    assert "no CUDA GPU" in line and "cpu_mode: auto" in line


def test_a_folder_that_is_not_a_model_names_model_init(tmp_path):
    (tmp_path / "not-a-model").mkdir()
    line = one_line_error(spanrl_train(tmp_path, "--model", str(tmp_path / "not-a-model"), "--backend", "verl"))
    assert "not a Hugging Face model directory" in line and "spanrl model init" in line
