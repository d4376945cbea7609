"""`spanrl serve CHECKPOINT` of a checkpoint trained with per-agent adapters: the base and every
adapter served over HTTP, routed as during training, each adapter's logprobs equal to a peft
forward of it; a checkpoint with a missing or cut-off adapter file is refused naming the file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

from spanrl.child_processes import free_port
from spanrl.trainer_bridge.torch_backend.adapter_checkpoint import AdapterCheckpointError, checkpoint_adapter_specs

from .conftest import TEST_DEVICE
from .test_adapter_serving import PROMPT, completion, peft_model, trained  # noqa: F401 (trained: a fixture)


@contextmanager
def spanrl_serve(model_dir, *flags: str):
    """`spanrl serve MODEL_DIR` in its own process; yields its /v1 URL once it answers."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "spanrl", "serve", str(model_dir), "--port", str(port),
                               "--threads", "1", "--device", TEST_DEVICE, *flags],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            if server.poll() is not None:
                pytest.fail(f"spanrl serve exited {server.returncode}: {server.stdout.read()}")
            assert time.monotonic() < deadline, "spanrl serve did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_spanrl_serve_of_a_checkpoint_serves_each_adapter_as_peft_does(trained, forward_logprobs):  # noqa: F811
    _, checkpoint = trained  # a real training step of two adapters: writer, fixers (rewriter, checker)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert set(state["config"]["adapters"]) == {"writer", "fixers"}  # each adapter's agents, saved with it
    with spanrl_serve(checkpoint, "--served-model-name", "policy") as base_url:
        api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        assert {m.id for m in api.models.list().data} == {"policy", "writer", "fixers"}
        policy = httpx.get(base_url.replace("/v1", "/spanrl/v1/policy")).json()
        assert policy["adapters"] == {"writer": ["writer"], "fixers": ["rewriter", "checker"]}
        routes = [("writer", None, "writer"), ("fixers", None, "fixers"), ("rewriter", None, "fixers"),
                  ("checker", "writer", "fixers"), ("policy", "checker", "fixers"), ("policy", "writer", "writer"),
                  ("policy", None, None), ("policy", "planner", None)]
        served = {}
        for model, agent, adapter in routes:
            choice = completion(api, model, agent)["choices"][0]
            reference = forward_logprobs(peft_model(checkpoint, adapter), PROMPT, choice["token_ids"])
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(reference.tolist(), abs=1e-4), (model, agent)
            served.setdefault(adapter, choice["logprobs"]["token_logprobs"])
        assert len({tuple(logprobs) for logprobs in served.values()}) == 3  # both adapters moved in training
        with pytest.raises(openai.NotFoundError, match="the model 'nobody' does not exist"):
            completion(api, "nobody")  # the endpoint's model-name rule: only its names


def broken_copy(checkpoint, tmp_path):
    copy = tmp_path / "step-000001"
    shutil.copytree(checkpoint, copy)
    return copy


def test_spanrl_serve_names_a_missing_adapter_file_and_exits_2(trained, tmp_path):  # noqa: F811
    copy = broken_copy(trained[1], tmp_path)
    missing = copy / "adapters" / "fixers" / "adapter_model.safetensors"
    missing.unlink()
    result = subprocess.run([sys.executable, "-m", "spanrl", "serve", str(copy), "--port", str(free_port())],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"{missing}: missing" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_cut_off_or_unlisted_adapter_and_a_missing_state_file_are_named(trained, tmp_path):  # noqa: F811
    copy = broken_copy(trained[1], tmp_path)
    assert [spec.name for spec in checkpoint_adapter_specs(copy)] == ["writer", "fixers"]
    weights = copy / "adapters" / "writer" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(AdapterCheckpointError, match=f"{weights}: unreadable safetensors file"):
        checkpoint_adapter_specs(copy)
    shutil.copy(trained[1] / "adapters" / "writer" / "adapter_model.safetensors", weights)
    config = copy / "adapters" / "fixers" / "adapter_config.json"
    config.write_text("{not json")
    with pytest.raises(AdapterCheckpointError, match=f"{config}: not a JSON adapter config"):
        checkpoint_adapter_specs(copy)
    shutil.copy(trained[1] / "adapters" / "fixers" / "adapter_config.json", config)
    shutil.copytree(copy / "adapters" / "writer", copy / "adapters" / "planner")
    with pytest.raises(AdapterCheckpointError, match=r"holds adapters \['planner'\] that .* does not name"):
        checkpoint_adapter_specs(copy)
    shutil.rmtree(copy / "adapters" / "planner")
    (copy / "trainer_state.json").unlink()
    with pytest.raises(AdapterCheckpointError, match="trainer_state.json: missing"):
        checkpoint_adapter_specs(copy)
