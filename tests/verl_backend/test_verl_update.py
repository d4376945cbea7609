"""One update through the verl backend on CPU, for real: verl's FSDP2 worker vs the embedded
trainer on the same samples, and the vLLM endpoint (behind the gateway) serving exactly the
trained weights, for a model with tied embeddings (what `spanrl model init` writes) trained on
one row per call, and an untied one trained on merged rows (``merge_trajectories``: one masked
row per multi-turn rollout, which must make the update the embedded trainer makes on the same
calls one row each: token-mean, so the same loss, gradient norm and weights after). One verl
start per case: the merged rows ride on the untied case instead of starting verl a third time.
And what the run exposes: no socket of any of its processes (Ray, verl, vLLM, the gateway)
listens beyond loopback, the gateway takes the agents' token, the replicas their own key."""

from __future__ import annotations

import dataclasses
import random

import httpx
import pytest
import torch

from spanrl.child_processes import free_port
from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.trajectory_merge import update_rows
from spanrl.trainer_bridge.verl_backend.config import VerlConfig

LEARNING_RATE = 1e-3
POLICY_TOKEN = "agents-token"
AUTH = {"Authorization": f"Bearer {POLICY_TOKEN}"}


def random_samples(count: int = 6, seed: int = 0, vocab: int = 300) -> list[TrainingSample]:
    """Training samples of random prompt/response ids, two per group, with advantages."""
    rng = random.Random(seed)
    return [TrainingSample(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 12))],
                           response_token_ids=[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 8))],
                           advantage=rng.uniform(-1, 1), group_id=f"g{i // 2}", rollout_id=f"r{i}")
            for i in range(count)]


def multi_turn_samples(rollouts: int = 4, calls: int = 3, seed: int = 0, vocab: int = 300) -> list[TrainingSample]:
    """Each rollout's calls: prompt = previous prompt + response + a tool result; an advantage per call."""
    rng = random.Random(seed)
    samples = []
    for rollout in range(rollouts):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 9))]
        for call in range(calls):
            response = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 6))]
            samples.append(TrainingSample(prompt_token_ids=list(prompt), response_token_ids=response,
                                          advantage=rng.uniform(-1, 1), group_id=f"g{rollout // 2}",
                                          rollout_id=f"r{rollout}", turn_index=call))
            prompt = prompt + response + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 4))]
    return samples


# per case (one row per call, or merged rows): the gradient norm's relative tolerance, how far
# the step must move a log-prob at least, and verl's log-probs after it against the embedded
# trainer's (merged rows: the tolerances their own test had)
TOLERANCES = {False: (1e-5, 0.1, 1e-5), True: (1e-4, 0.05, 1e-4)}


def hf_logprobs(model_dir: str, samples) -> list[list[float]]:
    """A plain transformers forward pass: each response token's log-prob, one sequence at a time."""
    from transformers import AutoModelForCausalLM

    return model_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), samples)


def model_logprobs(model, samples) -> list[list[float]]:
    """Each response token's log-prob under ``model`` (a transformers or peft model), one
    sequence at a time."""
    out = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([list(sample.prompt_token_ids) + list(sample.response_token_ids)])
            logits = model(input_ids=ids).logits[0, len(sample.prompt_token_ids) - 1:-1]
            picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.response_token_ids).unsqueeze(-1))
            out.append(picked.squeeze(-1).tolist())
    return out


def endpoint_logprobs(base_url: str, model: str, samples,
                      agent: str | None = None) -> tuple[list[list[float]], set[str]]:
    """vLLM's log-prob of each response token given its prefix (``prompt_logprobs``), through
    the gateway, called as ``model`` (by ``agent``: W3C baggage, as spanrl's instrumentation
    sends it); and the policy versions the gateway stamped on the replies."""
    headers = {**AUTH, **({"baggage": f"spanrl.agent.name={agent}"} if agent else {})}
    out, versions = [], set()
    for sample in samples:
        ids = list(sample.prompt_token_ids) + list(sample.response_token_ids)
        reply = httpx.post(f"{base_url}/completions", timeout=120, headers=headers, json={
            "model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0})
        assert reply.status_code == 200, reply.text
        versions.add(reply.headers["x-spanrl-policy-version"])
        scored = reply.json()["choices"][0]["prompt_logprobs"][len(sample.prompt_token_ids):]
        out.append([entry[str(token)]["logprob"]
                    for entry, token in zip(scored, sample.response_token_ids, strict=True)])
    return out, versions


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("embeddings", "merge"), [("tied", False), ("untied", True)],
                         ids=["tied", "untied-merged-rows"])
def test_verl_update_equals_embedded_trainer_and_the_endpoint_serves_it(embeddings, merge, tiny_models, tmp_path,
                                                                       exposed_sockets):
    from spanrl.trainer_bridge.verl_backend.backend import VerlWorkerFailed, start_backend

    model_dir = tiny_models[embeddings]
    samples = multi_turn_samples() if merge else random_samples()
    trained_rows, merge_metrics = update_rows(samples, merge)  # the loop's own step (merge_trajectories)
    if merge:
        assert merge_metrics["merged_rows"] == 4 and merge_metrics["merge_prefix_mismatches"] == 0
    grad_norm_rel, least_move, after_tolerance = TOLERANCES[merge]
    settings = TrainSettings(tasks="unused.jsonl", model=model_dir, backend="verl", learning_rate=LEARNING_RATE,
                             output_dir=str(tmp_path / "run"), policy_port=free_port(), policy_model_name="policy",
                             checkpoint_every=0, verl=VerlConfig(cpu_mode="on"), policy_token=POLICY_TOKEN)

    # the embedded trainer's update on the same samples (old log-probs recomputed on both sides)
    embedded = TorchTrainer(model_dir, dataclasses.replace(settings.trainer, device="cpu"))
    expected_stats = embedded.grpo_step(samples)
    expected_after = embedded.sequence_logprobs(samples)

    backend = start_backend(settings.backend_run())
    try:
        url = backend.endpoint_url
        assert url == f"http://127.0.0.1:{settings.policy_port}/v1"
        assert exposed_sockets() == []  # Ray, verl's workers, vLLM, the gateway: loopback only
        prompt = {"model": "policy", "prompt": [5, 6], "max_tokens": 1}
        assert httpx.post(f"{url}/completions", json=prompt, timeout=120).status_code == 401  # the agents' token
        for replica in backend.workers.server_urls:  # only the gateway holds the replicas' key
            assert httpx.post(f"{replica}/v1/completions", json=prompt, timeout=120).status_code == 401
        served_before, versions = endpoint_logprobs(url, "policy", samples)
        assert versions == {"0"}
        initial = hf_logprobs(model_dir, samples)
        assert max_difference(served_before, initial) < 1e-4
        assert max_difference(backend.log_probs(samples), initial) < 1e-5  # verl's actor forward

        stats = backend.update(trained_rows)
        assert stats.policy_version == 1 and backend.policy_version == 1
        assert stats.details["samples"] == len(trained_rows)
        assert abs(stats.loss - expected_stats["pg_loss"]) < 1e-5
        assert stats.grad_norm == pytest.approx(expected_stats["grad_norm"], rel=grad_norm_rel)
        for part in ("old_log_prob_s", "update_s", "weight_sync_s", "batch_s"):
            assert stats.details[part] >= 0

        served_after, versions = endpoint_logprobs(url, "policy", samples)
        assert versions == {"1"}
        assert max_difference(served_after, served_before) > 1e-3  # the endpoint serves new weights
        trained = backend.log_probs(samples)
        assert max_difference(trained, initial) > least_move  # a real step (AdamW at 1e-3 moved every weight)
        assert max_difference(trained, expected_after) < after_tolerance  # the same update as the embedded trainer
        assert max_difference(served_after, trained) < 1e-4  # the endpoint serves what verl trained

        # the endpoint serves exactly what verl trained: its Hugging Face checkpoint, forwarded by
        # transformers, gives the endpoint's log-probs
        checkpoint = backend.save_checkpoint(str(tmp_path / "run" / "checkpoints"))
        assert max_difference(served_after, hf_logprobs(checkpoint, samples)) < 1e-4

        # a vLLM replica that dies: agents get an error naming it (not a hang), and the next update
        # stops with one clear error instead of waiting on the dead replica
        import ray

        for server in backend.workers.llm_servers.get_replicas()[0].servers:
            ray.kill(server)
        reply = httpx.post(f"{url}/completions", timeout=120, headers=AUTH, json=prompt)
        assert reply.status_code in (502, 503) and "upstream" in reply.text.lower(), reply.text
        with pytest.raises(VerlWorkerFailed, match="vLLM replica failed during update 2"):
            backend.update(samples)
    finally:
        backend.close()
