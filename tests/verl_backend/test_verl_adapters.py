"""Per-agent LoRA adapters with backend verl, for real on CPU: verl's LoRA actor trains each adapter
on its own agents' transitions (one after another), vLLM serves every adapter by name behind the
gateway (routed by the model name or the caller's baggage), an adapter whose agents sent nothing
stays bitwise the same, and what vLLM serves equals a peft forward of the adapter written."""

from __future__ import annotations

import dataclasses
import os

import httpx
import pytest
import torch

from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.verl_backend.config import VerlConfig

from .test_verl_update import (
    AUTH,
    POLICY_TOKEN,
    endpoint_logprobs,
    free_port,
    hf_logprobs,
    max_difference,
    model_logprobs,
    random_samples,
)

LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
ADAPTERS = {"writer": {"agents": ["writer"], **LORA}, "fixers": {"agents": ["rewriter", "checker"], **LORA}}
WEIGHTS = "adapter_model.safetensors"


def agent_samples(agent: str, count: int, seed: int):
    return [dataclasses.replace(s, agent_name=agent, group_id=f"{agent}-{s.group_id}")
            for s in random_samples(count, seed=seed)]


def peft_logprobs(model_dir: str, adapter_dir: str, samples) -> list[list[float]]:
    """A peft forward of the base with the adapter written in ``adapter_dir``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model_logprobs(PeftModel.from_pretrained(base, adapter_dir).eval(), samples)


def file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.timeout(900)
def test_verl_trains_each_adapter_on_its_agents_and_vllm_serves_them_by_agent(tiny_models, tmp_path, caplog):
    from spanrl.trainer_bridge.verl_backend.adapters import VerlAdapters
    from spanrl.trainer_bridge.verl_backend.backend import start_backend

    model_dir = tiny_models["tied"]
    run_dir = tmp_path / "run"
    settings = TrainSettings(tasks="unused.jsonl", model=model_dir, backend="verl", learning_rate=5e-2,
                             output_dir=str(run_dir), policy_port=free_port(), policy_model_name="policy",
                             checkpoint_every=0, verl=VerlConfig(cpu_mode="on"), policy_token=POLICY_TOKEN,
                             adapters=ADAPTERS)
    writer, rewriter = agent_samples("writer", 6, seed=0), agent_samples("rewriter", 4, seed=1)
    planner = agent_samples("planner", 2, seed=2)  # no adapter names this agent: not trained
    base = hf_logprobs(model_dir, writer)
    peft_dir = {name: str(run_dir / "adapters" / name) for name in ADAPTERS}

    backend = start_backend(settings.backend_run())
    try:
        url = backend.endpoint_url
        models = httpx.get(f"{url}/models", headers=AUTH, timeout=60).json()["data"]
        assert {"writer", "fixers"} <= {card["id"] for card in models}
        served, versions = endpoint_logprobs(url, "writer", writer[:2])  # (each check's calls kept few: ~1 s each)
        assert versions == {"0"} and max_difference(served, base[:2]) < 1e-4  # a fresh adapter is the base (B = 0)
        fixers_file = file_bytes(os.path.join(peft_dir["fixers"], WEIGHTS))

        stats = backend.update(writer + planner)
        assert stats.policy_version == 1 and stats.details["adapter/writer/samples"] == 6
        assert "adapter/fixers/samples" not in stats.details
        assert file_bytes(os.path.join(peft_dir["fixers"], WEIGHTS)) == fixers_file  # no transitions: untouched
        expected = peft_logprobs(model_dir, peft_dir["writer"], writer)
        assert max_difference(expected, base) > 1e-3  # the writer's adapter moved
        for model, agent, count in (("writer", None, 6), ("policy", "writer", 2)):  # by model name, by baggage
            served, versions = endpoint_logprobs(url, model, writer[:count], agent)
            assert versions == {"1"} and max_difference(served, expected[:count]) < 1e-4, (model, agent)
        assert max_difference(backend.log_probs(writer, adapter="writer"), expected) < 1e-5  # verl's actor
        for model, agent in (("policy", None), ("policy", "planner"), ("fixers", None), ("checker", None)):
            served, _ = endpoint_logprobs(url, model, writer[:2], agent)  # the base, and the untouched adapter
            assert max_difference(served, base[:2]) < 1e-4, (model, agent)

        writer_file = file_bytes(os.path.join(peft_dir["writer"], WEIGHTS))
        backend.update(rewriter)  # the fixers' turn: the writer's state is swapped out, then back in
        assert file_bytes(os.path.join(peft_dir["writer"], WEIGHTS)) == writer_file
        fixers = peft_logprobs(model_dir, peft_dir["fixers"], rewriter)
        assert max_difference(fixers, hf_logprobs(model_dir, rewriter)) > 1e-3
        served, versions = endpoint_logprobs(url, "policy", rewriter, agent="checker")
        assert versions == {"2"} and max_difference(served, fixers) < 1e-4
        assert max_difference(backend.log_probs(writer, adapter="writer"), expected) < 1e-5

        checkpoint = backend.save_checkpoint(str(run_dir / "checkpoints"))
        for name in ADAPTERS:  # peft's format, loadable by peft and by vLLM's --lora-modules
            saved = file_bytes(os.path.join(checkpoint, name, WEIGHTS))
            assert saved == file_bytes(os.path.join(peft_dir[name], WEIGHTS))
        assert max_difference(peft_logprobs(model_dir, os.path.join(checkpoint, "writer"), writer), expected) < 1e-6

        # a resumed run takes each adapter (its peft folder and verl state) from the checkpoint
        trained = backend.adapters
        backend.adapters = VerlAdapters(trained.specs, backend.workers, str(tmp_path / "resumed"))
        backend.adapters.start(saved=checkpoint)
        backend.adapters.agents_seen = trained.agents_seen  # the run's, for the warning at its end
        assert max_difference(backend.log_probs(writer, adapter="writer"), expected) < 1e-5
        assert max_difference(backend.log_probs(rewriter, adapter="fixers"), fixers) < 1e-5
        served, _ = endpoint_logprobs(url, "writer", writer[:2])
        assert max_difference(served, expected[:2]) < 1e-4
    finally:
        backend.close()
    # the checker never sent a transition: its adapter trained on the rewriter's only (said once)
    unseen = [r.getMessage() for r in caplog.records if "reached an update" in r.getMessage()]
    assert unseen == ["adapter 'fixers': no transition of its agent(s) 'checker' reached an update in this run "
                      "(2 steps; agents seen: planner, rewriter, writer): check the agent names in adapters:"]
