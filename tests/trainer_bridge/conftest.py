"""Shared fixtures of the trainer_bridge tests: a locally created tiny model and a running server."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

# where models run in these tests: cpu, or cuda on a GPU machine (docs/gpu.md)
TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")


def calc_example(rng: random.Random) -> dict:
    """One calculator demonstration in chat format (the demo's text protocol)."""
    a, b = rng.randint(1, 99), rng.randint(1, 9)
    return {"messages": [
        {"role": "system", "content": "Answer with ANSWER n. You may use CALC a op b first."},
        {"role": "user", "content": f"What is {a} + {b}?"},
        {"role": "assistant", "content": f"CALC {a}+{b}"},
        {"role": "user", "content": f"RESULT {a + b}"},
        {"role": "assistant", "content": f"ANSWER {a + b}"},
    ]}


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread while these tests run: on a shared CI machine (other test processes
    busy on the same cores) OpenMP's spinning threads make a 2-thread torch ~5x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def calc_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "demonstrations.jsonl"
    rng = random.Random(0)
    path.write_text("".join(json.dumps(calc_example(rng)) + "\n" for _ in range(300)))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, calc_corpus):
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    return create_model_dir(tmp_path_factory.mktemp("models") / "tiny", preset="tiny",
                            corpus_files=[calc_corpus], seed=0)


@pytest.fixture(scope="session")
def make_calc_example():
    return calc_example


@pytest.fixture
def engine(tiny_model_dir):
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine

    engine = PolicyEngine.from_pretrained(tiny_model_dir, device=TEST_DEVICE, dtype="float32").start()
    yield engine
    engine.stop()


@pytest.fixture(params=["api_process", "in_thread"])
def server(engine, request):
    """The policy server on a free loopback port, stopped after the test: its HTTP front end in
    a child process (what `spanrl serve` and the training loop run), or in a thread of this one."""
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    serve = serve_in_process if request.param == "api_process" else serve_in_thread
    handle = serve(engine, "127.0.0.1", 0)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def forward_logprobs():
    """log p(response token | prefix) by one forward pass: the reference the server's
    logprobs and weight versions are checked against."""

    def compute(model, prompt_ids, response_ids):
        ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=model.device)
        with torch.no_grad():
            logits = model(ids).logits[0].float().cpu()
        logprobs = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : -1]
        return logprobs.gather(1, torch.tensor(response_ids).unsqueeze(1)).squeeze(1)

    return compute
