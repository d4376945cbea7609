"""The embedded policy server's LLM span per generation request (``trainer_bridge/endpoint_spans.py``).

``app.create_app`` adds ``CallSpanMiddleware`` when spans are configured; it opens a call record
for each ``POST`` of a generating route and, once the response is sent, hands the engine's result
to ``EndpointSpans``. ``serving.py`` tells the record what the route did: ``track_job`` (the
engine request, whose result holds the prompt and response ids, logprobs and policy version),
``note_response`` / ``watch_stream`` (the response id the client got). Without a record (spans
off, or another route) these are a context-variable read and nothing else. The ids come from the
engine, whatever the client asked for; logprobs only when the request asked for them (the engine
computes them only then).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from spanrl.trainer_bridge.endpoint_spans import GENERATING_PATHS, EndpointSpans, ServedCall, served_call_for, serving

# the first "id" of a stream's first event: the chunk's id, or the Responses object's in response.created
_FIRST_ID = re.compile(r'"id"\s*:\s*"([^"\\]+)"')


@dataclass
class _CallRecord:
    served: ServedCall
    job: Any = None  # the engine's GenerationRequest
    response_id: str | None = None


_current: ContextVar[_CallRecord | None] = ContextVar("spanrl_served_call", default=None)


def track_job(job: Any) -> None:
    """The engine request the current call submitted (its result becomes the span)."""
    record = _current.get()
    if record is not None:
        record.job = job


def note_request_model(name: str) -> None:
    """The model name the current call asked for (``gen_ai.request.model`` on its span)."""
    record = _current.get()
    if record is not None:
        record.served.request_model = name


def note_response(body: Any) -> None:
    """A JSON response is being sent: remember its ``id``."""
    record = _current.get()
    if record is not None and record.response_id is None:
        response_id = getattr(body, "id", None)
        if isinstance(response_id, str):
            record.response_id = response_id


def watch_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """``events`` as they are; the first one's ``id`` is remembered as the response id."""
    record = _current.get()
    if record is None:
        return events
    return _remember_first_id(events, record)


async def _remember_first_id(events: AsyncIterator[str], record: _CallRecord) -> AsyncIterator[str]:
    try:
        async for event in events:
            if record.response_id is None:
                found = _FIRST_ID.search(event)
                if found is not None:
                    record.response_id = found.group(1)
            yield event
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()  # at once: the route's own clean-up (cancelling generation) must not wait for GC


class CallSpanMiddleware:
    """ASGI middleware: one ``ServedCall`` per generating request, handed to ``spans`` when done."""

    def __init__(self, app: Any, spans: EndpointSpans) -> None:
        self.app = app
        self.spans = spans

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        served = served_call_for(scope, "policy endpoint")
        if served is None:
            await self.app(scope, receive, send)
            return
        record = _CallRecord(served)
        token = _current.set(record)
        try:
            with serving(served):  # the prompt candidate substituted for the call is noted on it
                await self.app(scope, receive, send)
        finally:
            _current.reset(token)
            self._finish(record)

    def _finish(self, record: _CallRecord) -> None:
        job = record.job
        result = getattr(job, "result", None)
        if result is None or job.error is not None or job.is_cancelled:
            return  # no generation finished for the client: nothing to train on
        served = record.served
        served.end_ns = time.time_ns()
        choices = []
        for choice in result.choices:
            entry: dict[str, Any] = {"index": choice.index, "token_ids": choice.token_ids,
                                     "finish_reason": choice.finish_reason}
            if choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids):
                entry["logprobs"] = {"token_logprobs": choice.logprobs}
            choices.append(entry)
        # the completions shape of a body, which LLMSpanRecorder reads
        served.replies.append({"id": record.response_id, "policy_version": result.policy_version,
                               "prompt_token_ids": result.prompt_token_ids, "choices": choices})
        self.spans.submit(served)


__all__ = ["CallSpanMiddleware", "GENERATING_PATHS", "note_request_model", "note_response", "track_job",
           "watch_stream"]
