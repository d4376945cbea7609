"""One SFT update (``algorithm: sft``) through the verl backend on CPU, for real: verl's
``sft_loss`` on the actor worker group lowers the NLL of the selected responses, takes the same
step as the embedded trainer's SFT update on the same samples, and vLLM serves the result."""

from __future__ import annotations

import dataclasses
import random

import httpx
import pytest

from spanrl.child_processes import free_port
from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend.sft_update import sft_step
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.verl_backend.config import VerlConfig

LEARNING_RATE = 1e-3


def random_samples(count: int = 6, seed: int = 0, vocab: int = 300) -> list[TrainingSample]:
    """Samples of random prompt/response ids (the responses an SFT step learns)."""
    rng = random.Random(seed)
    return [TrainingSample(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 12))],
                           response_token_ids=[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 8))],
                           advantage=1.0, group_id=f"g{i // 2}", rollout_id=f"r{i}")
            for i in range(count)]


def endpoint_logprobs(base_url: str, samples) -> tuple[list[list[float]], set[str]]:
    """vLLM's log-prob of each response token given its prefix, through the gateway, and the
    policy versions the gateway stamped on the replies."""
    out, versions = [], set()
    for sample in samples:
        reply = httpx.post(f"{base_url}/completions", timeout=120, json={
            "model": "policy", "prompt": list(sample.prompt_token_ids) + list(sample.response_token_ids),
            "max_tokens": 1, "prompt_logprobs": 0})
        assert reply.status_code == 200, reply.text
        versions.add(reply.headers["x-spanrl-policy-version"])
        scored = reply.json()["choices"][0]["prompt_logprobs"][len(sample.prompt_token_ids):]
        out.append([entry[str(token)]["logprob"]
                    for entry, token in zip(scored, sample.response_token_ids, strict=True)])
    return out, versions


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def nll(logprobs: list[list[float]]) -> float:
    """Mean negative log-likelihood per response token."""
    values = [x for row in logprobs for x in row]
    return -sum(values) / len(values)


@pytest.mark.timeout(900)
def test_one_verl_sft_update_lowers_the_nll_of_the_selected_responses(tiny_models, tmp_path):
    from spanrl.trainer_bridge.verl_backend.backend import start_backend

    model_dir = tiny_models["tied"]
    samples = random_samples()
    settings = TrainSettings(tasks="unused.jsonl", model=model_dir, backend="verl", algorithm="sft",
                             learning_rate=LEARNING_RATE, output_dir=str(tmp_path / "run"),
                             policy_port=free_port(), policy_model_name="policy", checkpoint_every=0,
                             verl=VerlConfig(cpu_mode="on"))

    embedded = TorchTrainer(model_dir, dataclasses.replace(settings.trainer, device="cpu"))
    expected_stats = sft_step(embedded, samples)
    expected_after = embedded.sequence_logprobs(samples)

    backend = start_backend(settings.backend_run())
    try:
        before = backend.log_probs(samples)
        stats = backend.sft_update(samples)
        assert stats.policy_version == 1 and backend.policy_version == 1
        after = backend.log_probs(samples)
        # the loss is the NLL before the step; one step lowers it
        assert stats.loss == pytest.approx(nll(before), rel=1e-4)
        assert nll(after) < nll(before) - 0.05, (nll(before), nll(after))
        # the same step as the embedded trainer's SFT update (same loss, optimizer, clipping)
        assert stats.loss == pytest.approx(expected_stats["loss"], rel=1e-4)
        assert stats.grad_norm == pytest.approx(expected_stats["grad_norm"], rel=1e-4)
        assert max_difference(after, expected_after) < 1e-4
        served, versions = endpoint_logprobs(backend.endpoint_url, samples)
        assert versions == {"1"} and max_difference(served, after) < 1e-4
        with pytest.raises(Exception, match="trains with the SFT loss"):
            backend.update(samples)
    finally:
        backend.close()
