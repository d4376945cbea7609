"""``POST /spanrl/v1/weights`` is the trainer's, never an agent's: a real policy server (its
HTTP front end in a child process, as `spanrl serve` runs it) with an agents' token and an
admin token, called over real HTTP; and `spanrl train`'s torch backend, whose route is off
while its own in-memory swap keeps working."""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from spanrl.trainer_bridge.torch_backend.server.policy import WEIGHTS_PATH, WeightsAdmin

AGENT_TOKEN = "agent-token"
ADMIN_TOKEN = "admin-token"


def perturbed_model_dir(source: str, target, seed: int) -> str:
    """A copy of the model at ``source`` with every weight moved a little (seeded)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(target)
    return str(target)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("run-output")


@pytest.fixture(scope="module")
def admin_server(tiny_model_dir, run_dir):
    """One server for the module: agents' token, admin token, weights only from ``run_dir``."""
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = PolicyEngine.from_pretrained(tiny_model_dir, device="cpu", dtype="float32").start()
    handle = serve_in_process(engine, "127.0.0.1", 0, api_token=AGENT_TOKEN,
                              weights_admin=WeightsAdmin(ADMIN_TOKEN, str(run_dir)))
    yield handle
    handle.stop()
    engine.stop()
    torch.set_num_threads(threads)


def post_weights(server, path, version, token: str | None = ADMIN_TOKEN, **headers) -> httpx.Response:
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{server.url}{WEIGHTS_PATH}", json={"path": str(path), "version": version},
                      headers=headers, timeout=120)


def serving_version(server) -> int:
    reply = httpx.get(f"{server.url}/spanrl/v1/policy", headers={"Authorization": f"Bearer {AGENT_TOKEN}"})
    return reply.json()["version"]


def test_an_agents_token_gets_403_and_no_token_401(admin_server, tiny_model_dir, run_dir):
    target = perturbed_model_dir(tiny_model_dir, run_dir / "agent-try", seed=1)
    before = serving_version(admin_server)
    refused = post_weights(admin_server, target, before + 1, token=AGENT_TOKEN)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "admin_token_required"
    assert "admin token" in refused.json()["error"]["message"]
    assert post_weights(admin_server, target, before + 1, token=None).status_code == 401
    assert post_weights(admin_server, target, before + 1, token="guess").status_code == 401
    # a header that is not ASCII is a wrong token, not a server error
    odd = httpx.post(f"{admin_server.url}{WEIGHTS_PATH}", json={"path": target, "version": before + 1},
                     headers={"Authorization": "Bearer caf\u00e9".encode("latin-1")})
    assert odd.status_code == 401
    assert serving_version(admin_server) == before
    # the admin token is not an agent's token either: the model routes refuse it
    chat = httpx.post(f"{admin_server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                      json={"model": "x", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 401


def test_only_directories_under_the_run_folder_load(admin_server, tiny_model_dir, run_dir, tmp_path):
    before = serving_version(admin_server)
    outside = perturbed_model_dir(tiny_model_dir, tmp_path / "elsewhere", seed=2)
    refused = post_weights(admin_server, outside, before + 1)
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "path"
    assert str(run_dir.resolve()) in refused.json()["error"]["message"]
    # a way out through '..' or a symbolic link inside the folder is outside too
    assert post_weights(admin_server, f"{run_dir}/../{os.path.basename(tmp_path)}/elsewhere",
                        before + 1).status_code == 403
    os.symlink(outside, run_dir / "link-out")
    assert post_weights(admin_server, run_dir / "link-out", before + 1).status_code == 403
    assert serving_version(admin_server) == before


def test_a_version_not_above_the_serving_one_is_409(admin_server, tiny_model_dir, run_dir):
    before = serving_version(admin_server)
    target = perturbed_model_dir(tiny_model_dir, run_dir / "stale", seed=3)
    for version in (before, before - 1):
        refused = post_weights(admin_server, target, version)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["param"] == "version"
    assert serving_version(admin_server) == before


def test_the_admin_loads_a_newer_directory_under_the_run_folder(admin_server, tiny_model_dir, run_dir):
    from transformers import AutoModelForCausalLM

    before = serving_version(admin_server)
    target = perturbed_model_dir(tiny_model_dir, run_dir / f"v{before + 5}", seed=4)
    loaded = post_weights(admin_server, target, before + 5)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["version"] == before + 5 and loaded.headers["x-spanrl-policy-version"] == str(before + 5)
    expected = AutoModelForCausalLM.from_pretrained(target).model.embed_tokens.weight
    assert torch.equal(admin_server.engine.model.model.embed_tokens.weight.cpu(), expected)
    missing = post_weights(admin_server, run_dir / "nothing", before + 6)
    assert missing.status_code == 400 and "config.json" in missing.json()["error"]["message"]
    assert serving_version(admin_server) == before + 5


def test_the_engine_itself_refuses_an_older_version(engine, tiny_model_dir, tmp_path):
    """Where the swap happens, not only at the route: a load racing the route's check loses."""
    from spanrl.trainer_bridge.torch_backend.engine.requests import WeightsVersionError

    target = perturbed_model_dir(tiny_model_dir, tmp_path / "v3", seed=5)
    engine.load_weights_from_dir(target, 3)
    with pytest.raises(WeightsVersionError, match="not above the serving version 3"):
        engine.load_weights_from_dir(target, 3)
    assert engine.version == 3


def test_a_server_without_an_admin_refuses_every_token(server):
    reply = httpx.post(f"{server.url}{WEIGHTS_PATH}", json={"path": "/", "version": 9},
                       headers={"Authorization": "Bearer anything"})
    assert reply.status_code == 403 and reply.json()["error"]["code"] == "weights_route_off"


def test_spanrl_trains_own_server_refuses_its_agents_and_still_swaps_itself(tiny_model_dir, tmp_path):
    """`spanrl train` (torch backend): the policy token its runners hand to agents gets 403 on the
    weights route, and the trainer's own update still reaches the endpoint."""
    from spanrl.trainer_bridge.backend import TrainingSample
    from spanrl.trainer_bridge.torch_backend.backend import start_backend
    from spanrl.trainer_bridge.train_settings import TrainSettings

    settings = TrainSettings(tasks=str(tmp_path / "unused.jsonl"), model=str(tiny_model_dir), device="cpu",
                             policy_port=0, checkpoint_every=0, learning_rate=1e-3, policy_token=AGENT_TOKEN,
                             output_dir=str(tmp_path / "run"))
    backend = start_backend(settings.backend_run())
    try:
        server = backend.server
        target = perturbed_model_dir(tiny_model_dir, tmp_path / "run" / "v7", seed=6)
        refused = post_weights(server, target, 7, token=AGENT_TOKEN)
        assert refused.status_code == 403
        assert serving_version(server) == 0
        samples = [TrainingSample(prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5], advantage=advantage,
                                  group_id="g", rollout_id=f"r{i}") for i, advantage in enumerate((1.0, -1.0))]
        stats = backend.update(samples)
        assert stats.policy_version == 1 and serving_version(server) == 1
    finally:
        backend.close()


def test_spanrl_serve_refuses_half_an_admin_and_an_admin_token_agents_hold(tmp_path):
    from spanrl.errors import SettingError
    from spanrl.trainer_bridge.torch_backend.serve_cli import ServeSettings, weights_admin_of

    assert weights_admin_of(ServeSettings(model_dir="m")) is None  # the route is off
    with pytest.raises(SettingError, match="both admin_token and weights_dir"):
        weights_admin_of(ServeSettings(model_dir="m", admin_token="a"))
    with pytest.raises(SettingError, match="must differ from token"):
        weights_admin_of(ServeSettings(model_dir="m", token="same", admin_token="same", weights_dir=str(tmp_path)))
    with pytest.raises(SettingError, match="is not a folder"):
        weights_admin_of(ServeSettings(model_dir="m", admin_token="a", weights_dir=str(tmp_path / "missing")))
    admin = weights_admin_of(ServeSettings(model_dir="m", token="t", admin_token="a", weights_dir=str(tmp_path)))
    assert admin.token == "a" and admin.root == os.path.realpath(tmp_path)
