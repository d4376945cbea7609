"""The recorder's short path for a whole body as spanrl's server answers (``_record_whole_body``):
for that body and for every near miss, what lands on the span, what is left in the agent's body,
what is logged and what is learned of the endpoint are exactly what the general path gives."""

from __future__ import annotations

import copy
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from spanrl.instrumentation import semconv
from spanrl.instrumentation.endpoints import PACKING_ENDPOINTS
from spanrl.instrumentation.llm_span_recorder import LLMSpanRecorder
from spanrl.instrumentation.packed_values import pack_token_ids

PROMPT, REPLY = pack_token_ids([1, 2, 3]), pack_token_ids([40, 41])
CHAT = {"id": "chatcmpl-1", "object": "chat.completion", "policy_version": 7, "prompt_token_ids": PROMPT,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                     "finish_reason": "stop", "token_ids": REPLY}]}
COMPLETION = {"id": "cmpl-1", "object": "text_completion", "policy_version": 7,
              "choices": [{"index": 0, "text": "hi", "prompt_token_ids": PROMPT, "token_ids": REPLY}]}


def _with(body, **top):
    return {**copy.deepcopy(body), **top}


def _with_choice(body, **fields):
    changed = copy.deepcopy(body)
    changed["choices"][0].update(fields)
    return changed


BODIES = {
    "chat": CHAT,
    "completion": COMPLETION,
    "no index": {**CHAT, "choices": [{k: v for k, v in CHAT["choices"][0].items() if k != "index"}]},
    "index 1": _with_choice(CHAT, index=1),
    "index false": _with_choice(CHAT, index=False),
    "two choices": _with(CHAT, choices=[CHAT["choices"][0], {**CHAT["choices"][0], "index": 1}]),
    "logprobs": _with_choice(CHAT, logprobs={"content": [{"logprob": -0.5}, {"logprob": -0.25}]}),
    "id lists": _with_choice(_with(CHAT, prompt_token_ids=[1, 2, 3]), token_ids=[40, 41]),
    "a malformed reply": _with_choice(CHAT, token_ids=REPLY + "!"),
    "a malformed prompt": _with(CHAT, prompt_token_ids=PROMPT[:-1]),
    "prompt on the body and the choice": _with_choice(CHAT, prompt_token_ids=PROMPT),
    "no policy version": {k: v for k, v in CHAT.items() if k != "policy_version"},
    "a bool policy version": _with(CHAT, policy_version=True),
    "no response id": {k: v for k, v in CHAT.items() if k != "id"},
    "no prompt ids": {k: v for k, v in CHAT.items() if k != "prompt_token_ids"},
    "choices not a list": _with(CHAT, choices={"0": CHAT["choices"][0]}),
}


def _record(*bodies, general_path, removes_id_fields, caplog):
    """The span's attributes, the bodies as the agent then sees them, the log, and whether the
    endpoint was learned as spanrl's, for one recorder fed ``bodies``."""
    PACKING_ENDPOINTS.discard("endpoint-under-test")
    span = TracerProvider().get_tracer("whole-body-test").start_span("llm")
    recorder = LLMSpanRecorder(span, streaming=False, header_policy_version="3")
    recorder.removes_id_fields = removes_id_fields
    recorder.packing_endpoint = "endpoint-under-test"
    bodies = copy.deepcopy(bodies)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spanrl"):
        for body in bodies:
            if general_path:
                recorder._observe_any(body)
            else:
                recorder.observe(body)
    span.end()
    learned = "endpoint-under-test" in PACKING_ENDPOINTS
    PACKING_ENDPOINTS.discard("endpoint-under-test")
    return dict(span.attributes), bodies, [r.getMessage() for r in caplog.records], learned


@pytest.mark.parametrize("removes_id_fields", [True, False], ids=["spanrl-asked", "agent-asked"])
@pytest.mark.parametrize("name", list(BODIES))
def test_a_whole_body_is_recorded_as_the_general_path_records_it(name, removes_id_fields, caplog):
    short = _record(BODIES[name], general_path=False, removes_id_fields=removes_id_fields, caplog=caplog)
    general = _record(BODIES[name], general_path=True, removes_id_fields=removes_id_fields, caplog=caplog)
    assert short == general


def test_a_second_body_on_one_recorder_is_recorded_as_the_general_path_records_it(caplog):
    """(The SDK hook reads a whole body once; a recorder fed two keeps the first's id, version and
    prompt, and the last reply, either way.)"""
    second = _with(CHAT, id="chatcmpl-2", policy_version=8, prompt_token_ids=pack_token_ids([9]))
    second["choices"][0]["token_ids"] = pack_token_ids([50])
    for bodies in [(CHAT, second), (BODIES["logprobs"], second), (CHAT, BODIES["logprobs"])]:
        short = _record(*bodies, general_path=False, removes_id_fields=True, caplog=caplog)
        assert short == _record(*bodies, general_path=True, removes_id_fields=True, caplog=caplog)


def test_spanrls_answer_gives_its_four_attributes_and_hides_the_ids_it_asked_for(caplog):
    attributes, (body,), log, learned = _record(CHAT, general_path=False, removes_id_fields=True, caplog=caplog)
    assert attributes == {semconv.GENAI_RESPONSE_ID: "chatcmpl-1", semconv.LLM_POLICY_VERSION: 7,
                          semconv.LLM_PROMPT_TOKEN_IDS: PROMPT, semconv.llm_response_token_ids(0): REPLY}
    assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert log == [] and learned
