"""vLLM's OpenAI server as this folder's tests against vLLM run it (conftest.py's ``vllm_server``).

Three modules test against a running vLLM (``VLLM_MODULES``), and its start takes 30-90 s on
CPU, so one server with the settings all three need serves them; under pytest-xdist the three
go to one worker (tests/conftest.py's scheduler), so the server starts once per run.
"""

from __future__ import annotations

import json
import sys

import httpx

VLLM_MODULES = ("tests/verl_backend/test_vllm_live.py", "tests/verl_backend/test_proxy_vllm.py",
                "tests/verl_backend/test_verl_gateway_structured.py")
VLLM_NAMES = ("policy", "tiny")  # the names its clients call it by; its replies name the first
# a cap on every request's new tokens (vLLM's generation-config max_new_tokens caps a request's
# own max_tokens): the live agent names none; the structured-output tests ask for 48
VLLM_MAX_NEW_TOKENS = 48
VLLM_CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
VLLM_READY_TIMEOUT_S = 600.0  # measured 30-90 s on 2 quiet cores, minutes on busy ones


def vllm_command(model_dir: str, port: int) -> list[str]:
    """Greedy by default (a request's own temperature overrides it: the live agent names none), at
    most VLLM_MAX_NEW_TOKENS new tokens a request; tool calls parsed as hermes (what
    ``tool_choice`` needs); structured outputs by xgrammar, JSON without free whitespace."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", *VLLM_NAMES, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "16", "--seed", "0",
            "--generation-config", "vllm", "--override-generation-config",
            json.dumps({"max_new_tokens": VLLM_MAX_NEW_TOKENS, "temperature": 0}),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
