"""Per-agent adapters served at once: rows of different adapters in one batch equal a peft forward
of their adapter and a batch of their adapter alone; the HTTP server routes by model name and by
the caller's baggage; weight swaps replace the adapters."""

from __future__ import annotations

import openai
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine, SamplingParams
from spanrl.trainer_bridge.torch_backend.engine.requests import EngineError
from spanrl.trainer_bridge.torch_backend.multi_adapter import adapter_weights
from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

from .conftest import TEST_DEVICE
from .test_adapter_training import ADAPTERS, agent_samples

AGENTS = {"writer": ("writer",), "fixers": ("rewriter", "checker")}
PROMPT = [1, 40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A trainer whose two adapters both moved, and its checkpoint (base + adapters in peft's format)."""
    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(device=TEST_DEVICE, learning_rate=0.05, adapters=ADAPTERS))
    trainer.grpo_step(agent_samples("writer", 0) + agent_samples("rewriter", 1))
    return trainer, trainer.save_checkpoint(tmp_path_factory.mktemp("adapters") / "ckpt")


@pytest.fixture
def engine(trained):
    trainer, checkpoint = trained
    engine = PolicyEngine.from_pretrained(checkpoint, device=TEST_DEVICE, dtype="float32", model_name="policy")
    engine.attach_adapters(adapter_weights(trainer.model), AGENTS)
    engine.eos_ids = set()  # every row runs its max_tokens
    engine.start()
    yield engine
    engine.stop()


def peft_model(checkpoint, adapter: str | None):
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    if adapter is None:
        return base.eval()
    return PeftModel.from_pretrained(base, str(checkpoint / "adapters" / adapter)).eval()


def greedy(adapter: str | None, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True, adapter=adapter)


def test_a_mixed_adapter_batch_equals_peft_and_one_adapter_batches(engine, trained, forward_logprobs):
    _, checkpoint = trained
    adapters = [None, "writer", "fixers", "writer", "fixers"]
    # the first (long) row starts a batch; the others join it: every decode step mixes adapters
    jobs = [engine.submit(PROMPT, greedy(None, 20))] + [engine.submit(PROMPT[: 4 + i], greedy(a))
                                                        for i, a in enumerate(adapters[1:])]
    results = [job.wait(60) for job in jobs]
    assert engine.stats.max_rows_in_batch == 5
    for adapter, job, result in zip(adapters, jobs, results, strict=True):
        choice = result.choices[0]
        expected = forward_logprobs(peft_model(checkpoint, adapter), job.prompt_ids, choice.token_ids)
        torch.testing.assert_close(torch.tensor(choice.logprobs), expected, atol=1e-4, rtol=0)
        alone = engine.generate(job.prompt_ids, greedy(adapter, len(choice.token_ids)), timeout=60).choices[0]
        assert alone.token_ids == choice.token_ids
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(choice.logprobs), atol=1e-5, rtol=0)
    with pytest.raises(EngineError, match="serves no adapter 'nobody'"):
        engine.generate(PROMPT, greedy("nobody"), timeout=60)


def completion(api, model: str, agent: str | None = None):
    headers = {"baggage": f"spanrl.agent.name={agent}"} if agent else None
    return api.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                  extra_headers=headers, extra_body={"return_token_ids": True}).model_dump()


def test_the_server_routes_by_model_name_then_baggage_and_swaps_adapters(engine, trained):
    trainer, _ = trained
    expected = {a: engine.generate(PROMPT, greedy(a, 5), timeout=60).choices[0] for a in (None, "writer", "fixers")}
    # both adapters moved in training: each answers differently from the base and from the other
    assert len({tuple(choice.logprobs) for choice in expected.values()}) == 3
    server = serve_in_process(engine, "127.0.0.1", 0)
    try:
        api = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        assert {m.id for m in api.models.list().data} == {"policy", "writer", "fixers"}
        routes = [("writer", None, "writer"), ("fixers", None, "fixers"), ("rewriter", None, "fixers"),
                  ("checker", "writer", "fixers"), ("policy", "checker", "fixers"), ("policy", "writer", "writer"),
                  ("policy", None, None), ("policy", "planner", None)]
        for model, agent, adapter in routes:
            body = completion(api, model, agent)
            choice = body["choices"][0]
            assert choice["token_ids"] == expected[adapter].token_ids, (model, agent)
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected[adapter].logprobs, abs=1e-5)
            assert body["model"] == model
        with pytest.raises(openai.NotFoundError, match="the model 'nobody' does not exist"):
            completion(api, "nobody")  # the endpoint's model-name rule: only listed names

        # a training step on the writer's transitions only; its new weights swapped in
        fixers_before = completion(api, "fixers")["choices"][0]
        trainer.grpo_step(agent_samples("writer", 7))
        engine.swap_adapters(adapter_weights(trainer.model), trainer.policy_version)
        writer_after = completion(api, "writer")
        assert writer_after["policy_version"] == trainer.policy_version == 2
        assert writer_after["choices"][0]["logprobs"]["token_logprobs"] != expected["writer"].logprobs
        fixers_after = completion(api, "fixers")["choices"][0]
        assert fixers_after["logprobs"]["token_logprobs"] == fixers_before["logprobs"]["token_logprobs"]
    finally:
        server.stop()


def test_spanrl_trains_adapters_behind_one_endpoint_and_warns_of_an_unseen_agent(tiny_model_dir, tmp_path, caplog):
    """The torch backend of `spanrl train` with adapters: the endpoint serves them from the start,
    each update swaps in the adapters' new weights, and the end of the run names an adapter's
    agent that never sent a transition (once)."""
    from spanrl.trainer_bridge.torch_backend.backend import start_backend
    from spanrl.trainer_bridge.train_settings import TrainSettings

    settings = TrainSettings(tasks=str(tmp_path / "unused.jsonl"), model=str(tiny_model_dir), device=TEST_DEVICE,
                             policy_port=0, learning_rate=0.05, output_dir=str(tmp_path / "run"),
                             adapters={"writer": {"rank": 4}, "fixers": {"agents": ["rewriter", "checker"]}})
    backend = start_backend(settings.backend_run())
    try:
        api = openai.OpenAI(base_url=backend.endpoint_url, api_key="unused", max_retries=0)
        assert {"writer", "fixers"} <= {m.id for m in api.models.list().data}
        before = completion(api, "writer")  # LoRA's B starts at zero: the base's answer
        assert before["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            completion(api, "policy")["choices"][0]["logprobs"]["token_logprobs"], abs=1e-6)
        for step in range(2):
            stats = backend.update(agent_samples("writer", step) + agent_samples("rewriter", 10 + step))
            assert stats.details["adapter/writer/samples"] == 4 and stats.details["adapter/fixers/samples"] == 4
        after = completion(api, "writer")
        assert after["policy_version"] == 2
        assert after["choices"][0]["logprobs"]["token_logprobs"] != before["choices"][0]["logprobs"]["token_logprobs"]
    finally:
        with caplog.at_level("WARNING", logger="spanrl.trainer_bridge.torch_backend.backend"):
            backend.close()
    warnings = [r.getMessage() for r in caplog.records if "reached an update" in r.getMessage()]
    assert len(warnings) == 1 and "adapter 'fixers'" in warnings[0] and "'checker'" in warnings[0]
    assert "'rewriter'" not in warnings[0]


def test_the_endpoint_span_names_the_adapter_that_served_the_call(engine):
    from spanrl.instrumentation import semconv
    from spanrl.instrumentation.packed_values import unpacked_attributes

    from .span_capture import serving_with_span_capture

    with serving_with_span_capture(engine) as (base_url, exported):
        api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        calls = [("writer", None), ("policy", "rewriter"), ("policy", None)]  # by name, by baggage, the base
        served = [completion(api, model, agent)["choices"][0]["token_ids"] for model, agent in calls]
    recorded = sorted(exported.get_finished_spans(), key=lambda span: span.start_time)
    assert [span.attributes.get(semconv.LLM_ADAPTER) for span in recorded] == ["writer", "fixers", None]
    response_ids = semconv.llm_response_token_ids(0)
    assert [list(unpacked_attributes(span.attributes)[response_ids]) for span in recorded] == served
    assert recorded[1].attributes[semconv.AGENT_NAME] == "rewriter"


def doubled(weights, adapter: str):
    """``adapter``'s weights with ``scaling * B`` doubled (another adapter, same shapes)."""
    return {adapter: {path: (a, 2 * b) for path, (a, b) in weights[adapter].items()}}


def test_swapping_one_adapter_leaves_the_other_rows_decoding(engine, trained):
    trainer, _ = trained
    weights = adapter_weights(trainer.model)
    fixers_alone = engine.generate(PROMPT, greedy("fixers", 600), timeout=60).choices[0]
    writer_before = engine.generate(PROMPT, greedy("writer"), timeout=60).choices[0]
    version = engine.version
    base_job = engine.submit(PROMPT, greedy(None, 600))
    fixers_job = engine.submit(PROMPT, greedy("fixers", 600))
    while base_job.policy_version is None or fixers_job.policy_version is None:
        fixers_job.done.wait(0.001)  # both rows decoding
    engine.swap_adapters(doubled(weights, "writer"), version + 1, timeout=60)
    # applied between two steps of the other rows, which decode on (the swap does not touch them)
    assert not base_job.done.is_set() and not fixers_job.done.is_set()
    assert engine.version == version + 1
    writer_after = engine.generate(PROMPT, greedy("writer"), timeout=60)
    fixers = fixers_job.wait(60)
    assert fixers.policy_version == version  # one weight set from start to end: the old version's
    assert fixers.choices[0].token_ids == fixers_alone.token_ids
    torch.testing.assert_close(torch.tensor(fixers.choices[0].logprobs), torch.tensor(fixers_alone.logprobs),
                               atol=1e-5, rtol=0)
    assert writer_after.policy_version == version + 1
    assert writer_after.choices[0].logprobs != pytest.approx(writer_before.logprobs, abs=1e-4)
    base_job.wait(60)


def test_an_adapter_swap_waits_for_that_adapters_rows(engine, trained):
    trainer, _ = trained
    weights = adapter_weights(trainer.model)
    writer_alone = engine.generate(PROMPT, greedy("writer", 300), timeout=60).choices[0]
    writer_job = engine.submit(PROMPT, greedy("writer", 300))
    while writer_job.policy_version is None:
        writer_job.done.wait(0.001)
    engine.swap_adapters(doubled(weights, "writer"), engine.version + 1, timeout=60)
    # the running writer row finished on its old weights before the swap was applied
    assert writer_job.done.is_set()
    writer = writer_job.wait(0)
    assert writer.choices[0].token_ids == writer_alone.token_ids
    torch.testing.assert_close(torch.tensor(writer.choices[0].logprobs), torch.tensor(writer_alone.logprobs),
                               atol=1e-5, rtol=0)


def test_an_adapter_of_every_agent_serves_the_calls_no_other_adapter_claims(trained):
    trainer, checkpoint = trained
    engine = PolicyEngine.from_pretrained(checkpoint, device=TEST_DEVICE, dtype="float32", model_name="policy")
    engine.attach_adapters(adapter_weights(trainer.model), {"writer": ("writer",), "fixers": ("*",)})
    engine.eos_ids = set()
    engine.start()
    server = serve_in_process(engine, "127.0.0.1", 0)
    try:
        expected = {a: engine.generate(PROMPT, greedy(a, 5), timeout=60).choices[0] for a in ("writer", "fixers")}
        api = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        assert {m.id for m in api.models.list().data} == {"policy", "writer", "fixers"}
        for model, agent, adapter in [("writer", None, "writer"), ("policy", "writer", "writer"),
                                      ("policy", "planner", "fixers"), ("policy", None, "fixers")]:
            choice = completion(api, model, agent)["choices"][0]
            assert choice["token_ids"] == expected[adapter].token_ids, (model, agent)
        with pytest.raises(openai.NotFoundError, match="the model '\\*' does not exist"):
            completion(api, "*")
    finally:
        server.stop()
        engine.stop()
