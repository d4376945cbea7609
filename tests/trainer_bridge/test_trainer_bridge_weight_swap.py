"""Weight swaps during a stream of concurrent requests: each response comes from one version.

Two weight sets with clearly different next-token distributions alternate as versions
1, 2, 3, ... (odd: set A, even: set B). Every token's served logprob identifies the weights
that produced it: a response that switched weights mid-way would match neither set.
"""

from __future__ import annotations

import contextlib
import threading
import time

import openai
import torch

MESSAGES = [{"role": "user", "content": "What is 12 + 7?"}]


def test_every_response_is_entirely_from_one_policy_version(server, engine, forward_logprobs):
    from transformers import AutoModelForCausalLM

    weights_a = {k: v.clone() for k, v in engine.model.state_dict().items()}
    torch.manual_seed(1)
    weights_b = {k: v + 0.3 * torch.randn_like(v) if v.dim() > 1 else v.clone() for k, v in weights_a.items()}
    model_a = AutoModelForCausalLM.from_pretrained(engine.model.name_or_path)
    model_a.load_state_dict(weights_a)
    model_b = AutoModelForCausalLM.from_pretrained(engine.model.name_or_path)
    model_b.load_state_dict(weights_b)
    engine.swap_weights(weights_a, 1)

    results: list[dict] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def one_client(number: int) -> None:
        api = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        while not stop.is_set():
            try:
                streaming = number % 2 == 0
                if streaming:
                    ids, logprobs, versions, prompt = [], [], set(), None
                    with api.chat.completions.with_streaming_response.create(
                            model=engine.model_name, messages=MESSAGES, max_tokens=24, stream=True,
                            logprobs=True, extra_body={"return_token_ids": True}) as response:
                        header = int(response.headers["x-spanrl-policy-version"])
                        for chunk in response.parse():
                            data = chunk.model_dump()
                            versions.add(data["policy_version"])
                            prompt = data.get("prompt_token_ids") or prompt
                            for choice in data["choices"]:
                                ids.extend(choice["token_ids"])
                                if choice["logprobs"]:
                                    logprobs.extend(c["logprob"] for c in choice["logprobs"]["content"])
                    assert versions == {header}, (versions, header)
                else:
                    raw = api.chat.completions.with_raw_response.create(
                        model=engine.model_name, messages=MESSAGES, max_tokens=24, n=2, logprobs=True,
                        extra_body={"return_token_ids": True})
                    header = int(raw.headers["x-spanrl-policy-version"])
                    body = raw.parse().model_dump()
                    assert body["policy_version"] == header
                    prompt = body["prompt_token_ids"]
                    for choice in body["choices"]:
                        results.append({"version": header, "prompt": prompt, "ids": choice["token_ids"],
                                        "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]]})
                    continue
                results.append({"version": header, "prompt": prompt, "ids": ids, "logprobs": logprobs})
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                return

    clients = [threading.Thread(target=one_client, args=(n,)) for n in range(8)]
    for thread in clients:
        thread.start()
    try:
        for version in range(2, 9):
            time.sleep(0.15)
            engine.swap_weights(weights_b if version % 2 == 0 else weights_a, version)
        time.sleep(0.15)
    finally:
        stop.set()
        for thread in clients:
            thread.join(60)
    assert not errors, errors[0]
    assert engine.version == 8
    seen_versions = {r["version"] for r in results}
    assert len(seen_versions) >= 4, seen_versions  # the swaps really happened during the stream
    for result in results:
        assert result["ids"] and len(result["logprobs"]) == len(result["ids"])
        served = torch.tensor(result["logprobs"])
        own, other = (model_b, model_a) if result["version"] % 2 == 0 else (model_a, model_b)
        expected = forward_logprobs(own, result["prompt"], result["ids"])
        assert torch.allclose(served, expected, atol=1e-3), (result["version"], served, expected)
        # the other weight set would have given different logprobs: a mix would be caught
        differs = (forward_logprobs(other, result["prompt"], result["ids"]) - served).abs()
        assert float(differs.max()) > 1e-2


def test_a_superseded_swap_fails_at_once_and_only_the_newest_weights_are_loaded(engine):
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import EngineError, SamplingParams

    key = "model.layers.0.self_attn.q_proj.weight"
    weights_1 = {k: v.clone() for k, v in engine.model.state_dict().items()}
    weights_2 = {k: v + 0.1 if v.dim() > 1 else v.clone() for k, v in weights_1.items()}
    outcomes: dict[int, object] = {}

    def swap(weights, version: int) -> None:
        try:
            engine.swap_weights(weights, version, timeout=30)
            outcomes[version] = "applied"
        except BaseException as exc:  # checked by the test
            outcomes[version] = exc

    first = threading.Thread(target=swap, args=(weights_1, 1))
    second = threading.Thread(target=swap, args=(weights_2, 2))
    try:
        with engine_thread_held(engine, "hello", SamplingParams(max_tokens=2)) as request:
            first.start()
            wait_until_a_swap_is_pending(engine)
            assert engine.pending_swap is not None and engine.pending_swap[1] == 1
            second.start()
            first.join(10)
            assert not first.is_alive(), "the superseded caller still waits"
            assert isinstance(outcomes[1], EngineError), outcomes
            assert "superseded by version 2" in str(outcomes[1])
            assert engine.version == 0 and second.is_alive()  # the engine is still busy
    finally:
        for thread in (first, second):
            if thread.ident is not None:
                thread.join(30)
    request.wait(30)
    assert outcomes[2] == "applied" and engine.version == 2
    assert torch.equal(engine.model.state_dict()[key], weights_2[key])


def wait_until_a_swap_is_pending(engine, timeout_s: float = 10.0) -> None:
    """Polls until the engine holds a pending weight swap (or the timeout passes)."""
    deadline = time.monotonic() + timeout_s
    while engine.pending_swap is None and time.monotonic() < deadline:
        time.sleep(0.01)


@contextlib.contextmanager
def engine_thread_held(engine, prompt: str, params):
    """Holds the engine thread inside a running batch (in a token callback) until exit;
    yields the running request."""
    busy, release = threading.Event(), threading.Event()

    def hold_the_engine_thread(_event) -> None:  # on_token runs on the engine thread
        busy.set()
        release.wait(30)

    running = engine.submit(engine.encode_text(prompt), params, on_token=hold_the_engine_thread)
    try:
        assert busy.wait(30)
        yield running
    finally:
        release.set()


@contextlib.contextmanager
def swap_pending_mid_batch(engine, weights: dict, version: int, prompt: str, params):
    """Holds the engine thread inside a running batch, asks for a weight swap and yields (the
    running request, the swap's outcome list) once the swap is pending; on exit lets the
    batch go on and waits for the swap."""
    swapped: list = []
    swapper = threading.Thread(target=lambda: swapped.append(engine.swap_weights(weights, version, timeout=30)))
    with engine_thread_held(engine, prompt, params) as running:
        swapper.start()
        wait_until_a_swap_is_pending(engine)
        assert engine.pending_swap is not None
        yield running, swapped
    running.wait(60)
    swapper.join(30)


def test_a_swap_asked_for_mid_batch_waits_for_the_batch_and_newcomers_get_the_new_weights(engine, forward_logprobs):
    """Continuous batching: while a swap is pending no row joins; the running rows finish on the
    old weights, then the swap is applied (with nothing else queued), then the newcomers start."""
    from transformers import AutoModelForCausalLM

    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import SamplingParams

    old_model = AutoModelForCausalLM.from_pretrained(engine.model.name_or_path)
    torch.manual_seed(2)
    new_weights = {k: v + 0.3 * torch.randn_like(v) if v.dim() > 1 else v.clone()
                   for k, v in engine.model.state_dict().items()}
    params = SamplingParams(max_tokens=6, logprobs=True)
    with swap_pending_mid_batch(engine, new_weights, 1, "CALC 12+", params) as (running, swapped):
        newcomer = engine.submit(engine.encode_text("RESULT 19"), params)
    old_result, new_result = running.wait(60), newcomer.wait(60)
    assert swapped and engine.version == 1
    assert old_result.policy_version == 0 and new_result.policy_version == 1
    for result, model in ((old_result, old_model), (new_result, engine.model)):
        choice = result.choices[0]
        expected = forward_logprobs(model, result.prompt_token_ids, choice.token_ids)
        assert torch.allclose(torch.tensor(choice.logprobs), expected, atol=1e-4)


def test_a_swap_asked_for_mid_batch_is_applied_when_the_batch_ends_with_nothing_else_queued(engine):
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import SamplingParams

    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with swap_pending_mid_batch(engine, weights, 7, "hello", SamplingParams(max_tokens=3)) as (_job, applied):
        pass
    assert applied and engine.version == 7
