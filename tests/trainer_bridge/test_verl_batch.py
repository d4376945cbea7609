"""Batches for verl built from real receiver output equal what verl's own agent loop builds.

Rollouts go through the real OTel SDK, OTLP/gRPC, the receiver, its store, the training loop's
collect and ``training_samples``; ``build_verl_batch`` turns the samples into a ``DataProto``.
The reference is verl 0.9.1's own ``AgentLoopWorker._agent_loop_postprocess`` and
``_postprocess`` run on the same token lists. That module imports hydra and vLLM's server
client, which the main venv does not have, so the reference methods and pydantic models are
compiled from verl's installed source file itself (``verl_agent_loop_reference``), verbatim.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib.util
import json
import logging
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest
import torch
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from pydantic import BaseModel, ConfigDict
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.model import compute_position_id_with_mask
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.server import ReceiverServer
from spanrl.otlp_receiver.settings import ReceiverSettings
from spanrl.trainer_bridge.advantages import GRPO_EPSILON
from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.samples import training_samples
from spanrl.trainer_bridge.task_dispatch import Attempt, Outcome
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.training_loop import TrainingLoop
from spanrl.trainer_bridge.verl_backend.batch import (
    EmptyVerlBatch,
    VerlBatch,
    build_verl_batch,
    to_worker_tensordict,
)

REPO = Path(__file__).resolve().parents[2]
MAX_PROMPT, MAX_RESPONSE = 16, 12
TEMPERATURE = 0.75

# (task id, attempt) -> (reward, [(prompt length, response length) per call]); rewards differ
# within each group so every group advantage is non-zero
PLAN: dict[tuple[str, int], tuple[float, list[tuple[int, int]]]] = {
    ("t0", 0): (1.0, [(5, 3), (9, 6), (13, 2)]),
    ("t0", 1): (0.0, [(4, 8)]),
    ("t0", 2): (0.5, [(11, 12), (16, 1)]),
    ("t1", 0): (2.0, [(3, 4), (7, 5)]),
    ("t1", 1): (-1.0, [(6, 7), (8, 3), (10, 9)]),
}


def call_tokens(task_id: str, attempt: int, call: int, prompt_length: int, response_length: int):
    """Deterministic prompt ids, response ids and logprobs of one call (ids 10..299)."""
    rng = random.Random(f"{task_id}/{attempt}/{call}")
    prompt = [rng.randint(10, 299) for _ in range(prompt_length)]
    response = [rng.randint(10, 299) for _ in range(response_length)]
    logprobs = [-rng.random() * 3 for _ in range(response_length)]
    return prompt, response, logprobs


def emit_rollout(tracer, attempt: Attempt) -> None:
    """An instrumented agent's spans: rollout span, LLM calls with token ids and logprobs, the
    rollout's reward event."""
    reward, calls = PLAN[(attempt.task_id, attempt.attempt)]
    identity = {semconv.ROLLOUT_ID: attempt.rollout_id, semconv.TASK_ID: attempt.task_id,
                semconv.ATTEMPT: attempt.attempt}
    with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=identity) as root:
        for index, (prompt_length, response_length) in enumerate(calls):
            prompt, response, logprobs = call_tokens(attempt.task_id, attempt.attempt, index,
                                                     prompt_length, response_length)
            with tracer.start_as_current_span(f"llm-{index}", attributes={
                **identity, semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM,
                semconv.LLM_PROMPT_TOKEN_IDS: prompt, semconv.llm_response_token_ids(0): response,
                semconv.llm_response_logprobs(0): logprobs,
            }):
                pass
        root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: reward})


@pytest.fixture(scope="module")
def scored_rollouts(tmp_path_factory):
    """The plan's rollouts sent through a real receiver and collected by the training loop."""
    root = tmp_path_factory.mktemp("verl-batch")
    server = ReceiverServer(ReceiverSettings(grpc_port=0, http_port=0, db=str(root / "spanrl.db"), grace_s=0.2,
                                             poll_s=0.05, idle_timeout_s=0)).start()
    provider = TracerProvider(resource=Resource.create({"service.name": "verl-batch-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=f"127.0.0.1:{server.grpc_port}", insecure=True, timeout=10)))
    try:
        tasks = root / "tasks.jsonl"
        tasks.write_text("".join(json.dumps({"id": task_id}) + "\n" for task_id in ("t0", "t1")))
        loop = TrainingLoop(TrainSettings(tasks=str(tasks), model="unused", store=str(root / "spanrl.db"),
                                          assembly_wait_s=20.0))
        attempts = [Attempt(f"{task_id}-{number}", task_id, number, {"id": task_id}, 0)
                    for task_id, number in PLAN]
        tracer = provider.get_tracer("verl-batch-agent")
        for attempt in attempts:
            emit_rollout(tracer, attempt)
        report = loop.collect(attempts, {a.rollout_id: Outcome("ok") for a in attempts})
        loop.store.close()
    finally:
        provider.shutdown()
        server.stop()
    assert not report.left_out and len(report.scored) == len(PLAN)
    return report.scored


@pytest.fixture(scope="module")
def samples(scored_rollouts) -> list[TrainingSample]:
    found, dropped = training_samples(scored_rollouts, "rollout", True)
    assert dropped == set()  # no group of one: every rollout is used
    return found


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    """The tiny model's tokenizer with a non-zero pad id (so a layout that pads with 0 fails)."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    loaded.pad_token = loaded.convert_ids_to_tokens(7)
    assert loaded.pad_token_id == 7
    return loaded


# ------------------------------------------------------------------ verl's own agent loop


AGENT_LOOP_CLASSES = ("AgentLoopMetrics", "AgentLoopOutput", "_InternalAgentLoopOutput")
AGENT_LOOP_METHODS = ("_pad_token_ids", "_agent_loop_postprocess", "_compute_multi_modal_inputs",
                      "_compute_position_ids", "_compute_score", "_compute_teacher_logprobs", "_postprocess",
                      "_get_mm_processor_kwargs")


def verl_agent_loop_reference() -> SimpleNamespace:
    """verl's ``AgentLoopWorker`` post-processing methods and output models, compiled from the
    installed ``verl/experimental/agent_loop/agent_loop.py`` without its hydra/vLLM imports."""
    verl_root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    path = verl_root / "experimental" / "agent_loop" / "agent_loop.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in AGENT_LOOP_CLASSES:
            body.append(node)
        if isinstance(node, ast.ClassDef) and node.name == "AgentLoopWorker":
            methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and m.name in AGENT_LOOP_METHODS]
            assert {m.name for m in methods} == set(AGENT_LOOP_METHODS), "verl's AgentLoopWorker changed"
            node.body, node.bases, node.keywords, node.decorator_list = methods, [], [], []
            body.append(node)
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    # a registered module, so pydantic resolves the models' annotations in it
    reference = sys.modules.setdefault("verl_agent_loop_reference", ModuleType("verl_agent_loop_reference"))
    reference.__dict__.update({
        "Any": Any, "Optional": Optional, "BaseModel": BaseModel, "ConfigDict": ConfigDict, "torch": torch,
        "np": np, "TensorDict": TensorDict, "DataProto": DataProto, "random": random,
        "compute_position_id_with_mask": compute_position_id_with_mask, "logger": logging.getLogger("verl-ref"),
    })
    exec(compile(module, str(path), "exec"), reference.__dict__)  # verl's own code, verbatim
    return SimpleNamespace(**{name: getattr(reference, name) for name in (*AGENT_LOOP_CLASSES, "AgentLoopWorker")})


def verl_reference_batch(samples: list[TrainingSample], tokenizer, prompt_length: int,
                         response_length: int) -> DataProto:
    """What verl's agent loop makes of one LLM call per sample (its reward as reward_score)."""
    verl = verl_agent_loop_reference()
    worker = verl.AgentLoopWorker()
    worker.tokenizer, worker.processor, worker.mm_processor_kwargs = tokenizer, None, {}
    worker.rollout_config = SimpleNamespace(prompt_length=prompt_length, response_length=response_length)
    worker.reward_loop_worker_handles, worker.distillation_enabled = None, False

    async def postprocess_all():
        return [await worker._agent_loop_postprocess(verl.AgentLoopOutput(
            prompt_ids=list(s.prompt_token_ids), response_ids=list(s.response_token_ids),
            response_mask=[1] * len(s.response_token_ids),
            response_logprobs=None if s.old_logprobs is None else list(s.old_logprobs),
            reward_score=s.reward, num_turns=2, metrics=verl.AgentLoopMetrics(),
        ), False, raw_prompt=[]) for s in samples]

    return worker._postprocess(asyncio.run(postprocess_all()))


# ------------------------------------------------------------------ tests


def test_batch_from_received_rollouts_matches_verls_agent_loop(samples, tokenizer):
    built = build_verl_batch(samples, pad_token_id=tokenizer.pad_token_id, max_prompt_length=MAX_PROMPT,
                             max_response_length=MAX_RESPONSE, temperature=TEMPERATURE)
    assert isinstance(built, VerlBatch)
    assert (built.dropped_overlong, built.dropped_empty, built.has_rollout_log_probs) == (0, 0, True)
    batch = built.data.batch
    reference = verl_reference_batch(samples, tokenizer, MAX_PROMPT, MAX_RESPONSE).batch
    rows = sum(len(calls) for _, calls in PLAN.values())
    assert len(built.data) == len(samples) == rows

    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                "rollout_log_probs"):
        assert batch[key].dtype == reference[key].dtype, key
        assert batch[key].shape == reference[key].shape, key
        assert torch.equal(batch[key], reference[key]), key
    assert batch["prompts"].shape == (rows, MAX_PROMPT)
    assert batch["input_ids"].shape == (rows, MAX_PROMPT + MAX_RESPONSE)
    # reward at the last response token, float32, as verl's rm_scores become token_level_scores
    for key in ("token_level_scores", "token_level_rewards"):
        assert batch[key].dtype == torch.float32
        assert torch.equal(batch[key], reference["rm_scores"]), key

    # the token lists are the received calls', padding on the left of prompts, right of responses
    by_call = {}
    for (task_id, attempt), (_, calls) in PLAN.items():
        for index, lengths in enumerate(calls):
            by_call[(f"{task_id}-{attempt}", index)] = call_tokens(task_id, attempt, index, *lengths)
    for row, sample in enumerate(samples):
        prompt, response, logprobs = by_call[(sample.rollout_id, sample.turn_index)]
        p, r = len(prompt), len(response)
        assert batch["prompts"][row, MAX_PROMPT - p:].tolist() == prompt
        assert batch["prompts"][row, : MAX_PROMPT - p].tolist() == [7] * (MAX_PROMPT - p)
        assert batch["responses"][row, :r].tolist() == response
        assert batch["responses"][row, r:].tolist() == [7] * (MAX_RESPONSE - r)
        assert batch["position_ids"][row, MAX_PROMPT - p: MAX_PROMPT + r].tolist() == list(range(p + r))
        assert batch["rollout_log_probs"][row, :r].tolist() == pytest.approx(logprobs, abs=1e-6)

    # advantages: the samples' own (what the torch backend trains on), GRPO over the group's scores
    rewards = {f"{task_id}-{attempt}": reward for (task_id, attempt), (reward, _) in PLAN.items()}
    for row, sample in enumerate(samples):
        group = [reward for rollout_id, reward in rewards.items() if rollout_id.startswith(sample.group_id + "-")]
        expected = (rewards[sample.rollout_id] - statistics.mean(group)) / (statistics.stdev(group) + GRPO_EPSILON)
        assert sample.advantage == pytest.approx(expected, rel=1e-5)
        length = len(sample.response_token_ids)
        assert batch["advantages"][row, :length].tolist() == [pytest.approx(sample.advantage, rel=1e-6)] * length
        assert batch["advantages"][row, length:].abs().sum() == 0
        assert sample.reward == rewards[sample.rollout_id]
    assert batch["advantages"].dtype == batch["returns"].dtype == torch.float32
    assert torch.equal(batch["advantages"], batch["returns"])

    non_tensor = built.data.non_tensor_batch
    assert list(non_tensor["uid"]) == [s.rollout_id.split("-")[0] for s in samples]
    assert list(non_tensor["rollout_id"]) == [s.rollout_id for s in samples]
    assert sorted(zip(non_tensor["rollout_id"], non_tensor["turn_index"], strict=True)) == sorted(by_call)
    assert built.data.meta_info["temperature"] == TEMPERATURE


def test_over_long_samples_are_dropped_and_counted_never_truncated(samples, tokenizer):
    limit_prompt, limit_response = 8, 5
    fits = [s for s in samples
            if len(s.prompt_token_ids) <= limit_prompt and len(s.response_token_ids) <= limit_response]
    assert 0 < len(fits) < len(samples)
    built = build_verl_batch(samples, pad_token_id=7, max_prompt_length=limit_prompt,
                             max_response_length=limit_response, temperature=1.0)
    assert built.dropped_overlong == len(samples) - len(fits)
    assert len(built.data) == len(fits)
    reference = verl_reference_batch(fits, tokenizer, limit_prompt, limit_response).batch
    for key in ("input_ids", "attention_mask", "position_ids", "response_mask", "rollout_log_probs"):
        assert torch.equal(built.data.batch[key], reference[key]), key
    assert list(built.data.non_tensor_batch["rollout_id"]) == [s.rollout_id for s in fits]

    with pytest.raises(EmptyVerlBatch, match="max_prompt_length=2"):
        build_verl_batch(samples, pad_token_id=7, max_prompt_length=2, max_response_length=limit_response,
                         temperature=1.0)


def test_rollout_weights_are_recomputed_over_the_kept_samples(scored_rollouts):
    weighted, _ = training_samples(scored_rollouts, "rollout", True, loss_weighting="rollout")
    limit_prompt, limit_response = 10, 12
    built = build_verl_batch(weighted, pad_token_id=0, max_prompt_length=limit_prompt,
                             max_response_length=limit_response, temperature=1.0)
    kept = [s for s in weighted if len(s.prompt_token_ids) <= limit_prompt]
    assert built.dropped_overlong == len(weighted) - len(kept) > 0
    advantages = built.data.batch["advantages"]
    tokens = built.data.batch["response_mask"].sum(dim=1).tolist()
    # each kept rollout's tokens carry 1/R of the token-mean loss: sum of its weights x tokens = N / R
    share: dict[str, float] = {}
    for row, sample in enumerate(kept):
        weight = float(advantages[row, 0]) / sample.group_advantage
        share[sample.rollout_id] = share.get(sample.rollout_id, 0.0) + weight * tokens[row]
    assert len(share) == len({s.rollout_id for s in kept})
    for value in share.values():
        assert value == pytest.approx(sum(tokens) / len(share), rel=1e-5)
    # the weights the loop folded in (over all samples) would no longer give every rollout 1/R
    stale = {}
    for row, sample in enumerate(kept):
        stale[sample.rollout_id] = stale.get(sample.rollout_id, 0.0) + sample.loss_weight * tokens[row]
    assert max(stale.values()) - min(stale.values()) > 0.1 * sum(tokens) / len(stale)


def test_samples_without_engine_logprobs_leave_rollout_log_probs_out(samples):
    built = build_verl_batch(samples, pad_token_id=0, max_prompt_length=MAX_PROMPT,
                             max_response_length=MAX_RESPONSE, temperature=1.0)
    assert "rollout_log_probs" in built.data.batch.keys()
    for broken in (dataclasses.replace(samples[1], old_logprobs=None),
                   dataclasses.replace(samples[1], old_logprobs=list(samples[1].old_logprobs)[:-1])):
        mixed = [samples[0], broken, *samples[2:]]
        built = build_verl_batch(mixed, pad_token_id=0, max_prompt_length=MAX_PROMPT,
                                 max_response_length=MAX_RESPONSE, temperature=1.0)
        assert built.has_rollout_log_probs is False
        assert "rollout_log_probs" not in built.data.batch.keys()
        assert len(built.data) == len(samples)


def test_worker_tensordict_has_the_layout_verls_update_actor_sends(samples):
    built = build_verl_batch(samples, pad_token_id=7, max_prompt_length=MAX_PROMPT,
                             max_response_length=MAX_RESPONSE, temperature=TEMPERATURE)
    meta = dict(calculate_entropy=True, global_batch_size=len(samples), mini_batch_size=len(samples), epochs=1,
                seed=11, dataloader_kwargs={"shuffle": False}, compute_loss=True)
    worker = to_worker_tensordict(built, **meta)
    by_hand = left_right_2_no_padding(built.data.to_tensordict())
    tu.assign_non_tensor(by_hand, **meta)

    assert set(worker.keys()) == set(by_hand.keys())
    assert "input_ids" in built.data.batch.keys()  # the DataProto itself is left as it was
    for key in ("input_ids", "position_ids"):
        assert worker[key].is_nested
        assert torch.equal(worker[key].values(), by_hand[key].values()), key
        assert torch.equal(worker[key].offsets(), by_hand[key].offsets()), key
    assert torch.equal(worker["loss_mask"], built.data.batch["response_mask"])
    assert tu.get_non_tensor_data(worker, "max_seq_len", None) == MAX_PROMPT + MAX_RESPONSE
    assert tu.get_non_tensor_data(worker, "max_response_len", None) == MAX_RESPONSE
    for key, value in {**meta, "temperature": TEMPERATURE}.items():
        assert tu.get_non_tensor_data(worker, key, None) == value, key

    # unpadded rows are exactly the calls' tokens, positions 0.. per row
    lengths = [len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples]
    expected_ids = [t for s in samples for t in (*s.prompt_token_ids, *s.response_token_ids)]
    assert worker["input_ids"].values().tolist() == expected_ids
    assert worker["input_ids"].offsets().tolist() == np.cumsum([0, *lengths]).tolist()
    assert worker["position_ids"].values().tolist() == [p for n in lengths for p in range(n)]
    # the worker reads a per-token model output back at the response: the value at the token
    # before each response token (the logits that predict it)
    as_output = worker["input_ids"].values().float()
    back = no_padding_2_padding(as_output, worker)
    for row, sample in enumerate(samples):
        predicted_from = [sample.prompt_token_ids[-1], *sample.response_token_ids[:-1]]
        assert back[row, : len(predicted_from)].tolist() == [float(t) for t in predicted_from]


def test_package_imports_neither_torch_nor_verl_and_batch_needs_no_vllm():
    code = (
        "import sys\n"
        "import spanrl.trainer_bridge.verl_backend\n"
        "assert 'torch' not in sys.modules and 'verl' not in sys.modules, 'package import pulled torch/verl'\n"
        "sys.modules['vllm'] = None  # any import of vllm now fails\n"
        "import spanrl.trainer_bridge.verl_backend.batch\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
