"""Zero-code instrumentation of the OpenAI Python SDK for RL: token ids on openinference's LLM span.

Loaded by ``opentelemetry-instrument`` through the ``opentelemetry_instrumentor`` entry point
``spanrl_openai`` (or called by ``spanrl.exporter.in_process.start_tracing``). It builds on
openinference's ``OpenAIInstrumentor``, which makes one LLM span per call (and is turned on
here if it is not already), and adds only what RL needs, on that same span:

- the request asks the endpoint for token ids, unless ``OTEL_SPANRL_REQUEST_TOKEN_IDS=false``,
  with vLLM's field for the route: ``return_token_ids: true`` on chat/completions and
  completions, ``enable_response_messages: true`` on responses; an endpoint that ignores the
  field still works;
- ``spanrl.llm.prompt_token_ids``, ``spanrl.llm.response.<i>.token_ids``, logprobs when
  present, ``spanrl.llm.policy_version`` and ``gen_ai.response.id``.

How: openinference wraps ``OpenAI.request`` / ``AsyncOpenAI.request`` and keeps its LLM span
current while the SDK builds the HTTP request and processes the response. We wrap three SDK
methods that run inside that window and that every chat/completions, completions and responses
call goes through, sync or async, streaming or not, with or without ``with_raw_response``:

- ``BaseClient._build_request``: add the route's token-id flag to the JSON body, and the
  ``x-spanrl-rollout-id`` header inside a rollout (sticky routing at the verl gateway);
- ``SyncAPIClient._process_response`` / ``AsyncAPIClient._process_response``: the current span
  is openinference's LLM span; remember it for this HTTP response;
- ``BaseClient._process_response_data``: every parsed JSON body or stream chunk of that
  response passes here (even when the stream is read after ``request`` returned), so the
  recorder sees the raw ids.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Collection
from importlib import import_module
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]
from wrapt import wrap_function_wrapper

from spanrl.instrumentation import semconv
from spanrl.instrumentation.llm_span_recorder import LLMSpanRecorder
from spanrl.instrumentation.package import _instruments
from spanrl.instrumentation.settings import InstrumentationSettings

logger = logging.getLogger(__name__)

_BASE_CLIENT_MODULE = "openai._base_client"
# (class name in openai._base_client, method name) -> which wrapper to install.
_PATCHED_METHODS = (
    ("BaseClient", "_build_request"),
    ("SyncAPIClient", "_process_response"),
    ("AsyncAPIClient", "_process_response"),
    ("BaseClient", "_process_response_data"),
)
# The instrumentation scope of openinference's OpenAI spans (its tracer is named after it).
_OPENINFERENCE_SCOPE = "openinference.instrumentation.openai"
# The routes whose calls are recorded, and the request field asking each for token ids.
_TOKEN_ID_FLAGS = {
    "/chat/completions": semconv.REQUEST_RETURN_TOKEN_IDS,
    "/completions": semconv.REQUEST_RETURN_TOKEN_IDS,
    "/responses": semconv.REQUEST_ENABLE_RESPONSE_MESSAGES,
}
# Hosts known to reject unknown request fields: never add a token-id flag there.
_STRICT_HOSTS = ("api.openai.com",)


class SpanrlOpenAIInstrumentor(BaseInstrumentor):
    """Adds engine token ids and the policy version to openinference's OpenAI LLM spans."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        settings = InstrumentationSettings.from_env()
        self._instrumented_openinference = False
        self._originals: dict[tuple[str, str], Any] = {}
        try:
            self._ensure_openinference(kwargs)
            self._patch_sdk(settings)
        except Exception:  # noqa: BLE001 - an SDK we do not understand must not stop the agent
            logger.exception("spanrl: could not instrument the OpenAI SDK; token ids are not recorded")
            self._uninstrument()
            return
        logger.debug("spanrl OpenAI instrumentation on (%s)", settings)

    def _patch_sdk(self, settings: InstrumentationSettings) -> None:
        base_client = import_module(_BASE_CLIENT_MODULE)
        recorders: weakref.WeakKeyDictionary[Any, LLMSpanRecorder] = weakref.WeakKeyDictionary()
        wrappers: dict[tuple[str, str], Callable[..., Any]] = {
            ("BaseClient", "_build_request"): _build_request_wrapper(settings.request_token_ids),
            ("SyncAPIClient", "_process_response"): _process_response_wrapper(recorders),
            ("AsyncAPIClient", "_process_response"): _async_process_response_wrapper(recorders),
            ("BaseClient", "_process_response_data"): _process_response_data_wrapper(recorders),
        }
        for class_name, method_name in _PATCHED_METHODS:
            original = getattr(base_client, class_name).__dict__[method_name]
            wrap_function_wrapper(
                _BASE_CLIENT_MODULE, f"{class_name}.{method_name}", wrappers[(class_name, method_name)]
            )
            self._originals[(class_name, method_name)] = original

    def _uninstrument(self, **kwargs: Any) -> None:
        base_client = import_module(_BASE_CLIENT_MODULE)
        for (class_name, method_name), original in getattr(self, "_originals", {}).items():
            setattr(getattr(base_client, class_name), method_name, original)
        self._originals = {}
        if getattr(self, "_instrumented_openinference", False):
            from openinference.instrumentation.openai import OpenAIInstrumentor

            OpenAIInstrumentor().uninstrument()
            self._instrumented_openinference = False

    def _ensure_openinference(self, kwargs: dict[str, Any]) -> None:
        """Turn on openinference's OpenAI instrumentor (it makes the LLM span) unless it is on.

        Under ``opentelemetry-instrument`` its own entry point may still be about to run; then
        this waits for the post-instrument hook (``ensure_openinference_after_auto``), so
        openinference does not warn about being instrumented twice."""
        from openinference.instrumentation.openai import OpenAIInstrumentor

        openinference = OpenAIInstrumentor()  # BaseInstrumentor subclasses are singletons
        if openinference.is_instrumented_by_opentelemetry:
            return
        if _auto_instrumentation["running"]:
            _auto_instrumentation["waiting"] = self
            return
        forwarded = {k: v for k, v in kwargs.items() if k in ("tracer_provider", "config")}
        openinference.instrument(**forwarded)
        self._instrumented_openinference = openinference.is_instrumented_by_opentelemetry
        if not self._instrumented_openinference:
            conflict = openinference._check_dependency_conflicts()
            logger.warning(
                "spanrl: openinference's OpenAI instrumentor did not turn on (%s), so no LLM spans and no "
                "token ids are recorded; install an openai version it supports, or an "
                "openinference-instrumentation-openai that supports yours", conflict or "see its log")


# Set by the opentelemetry-instrument hooks (spanrl.exporter.hook) around the instrumentors.
_auto_instrumentation: dict[str, Any] = {"running": False, "waiting": None}


def auto_instrumentation_started() -> None:
    """Called by the pre-instrument hook: instrumentors are about to be loaded."""
    _auto_instrumentation["running"] = True


def ensure_openinference_after_auto() -> None:
    """Called by the post-instrument hook: if spanrl's instrumentor is on and openinference's
    entry point did not turn its instrumentor on (disabled, or failed), turn it on now."""
    _auto_instrumentation["running"] = False
    waiting = _auto_instrumentation["waiting"]
    _auto_instrumentation["waiting"] = None
    if waiting is not None and waiting.is_instrumented_by_opentelemetry:
        waiting._ensure_openinference({})


def _token_id_flag(options: Any) -> str | None:
    """The request field asking for token ids when ``options`` is a call we record, else None."""
    method = getattr(options, "method", "")
    url = getattr(options, "url", "")
    if not (isinstance(method, str) and method.lower() == "post" and isinstance(url, str)):
        return None
    path = url.rstrip("/")
    for route, flag in _TOKEN_ID_FLAGS.items():
        if path.endswith(route):
            return flag
    return None


def _wants_token_ids(options: Any) -> bool:
    return _token_id_flag(options) is not None


def _build_request_wrapper(request_token_ids: bool) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        try:
            if request_token_ids:
                args, kwargs = _with_return_token_ids(instance, args, kwargs)
            args, kwargs = _with_rollout_header(instance, args, kwargs)
        except Exception:  # noqa: BLE001 - never break the agent
            logger.exception("spanrl: could not add spanrl's fields to the request")
        return wrapped(*args, **kwargs)

    return wrapper


def _current_rollout_id() -> str | None:
    """The rollout this call belongs to: ``rollout()`` / W3C baggage, else the process's
    resource attribute (what ``spanrl run`` gives each agent process)."""
    from .rollout import current_identity

    identity = current_identity()
    if identity is not None:
        return identity.rollout_id
    resource = getattr(trace_api.get_current_span(), "resource", None)
    value = getattr(resource, "attributes", {}).get(semconv.ROLLOUT_ID) if resource is not None else None
    return value if isinstance(value, str) and value else None


def _with_rollout_header(instance: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The ``_build_request`` arguments with the ``x-spanrl-rollout-id`` header on LLM calls made
    inside a rollout (the verl gateway keeps a rollout's calls on one vLLM replica)."""
    options = args[0] if args else kwargs.get("options")
    if options is None or _token_id_flag(options) is None:
        return args, kwargs
    if getattr(getattr(instance, "base_url", None), "host", None) in _STRICT_HOSTS:
        return args, kwargs
    rollout_id = _current_rollout_id()
    headers = options.headers if isinstance(options.headers, dict) else {}
    if rollout_id is None or any(k.lower() == semconv.ROLLOUT_ID_HEADER for k in headers):
        return args, kwargs
    options = options.model_copy()
    options.headers = {**headers, semconv.ROLLOUT_ID_HEADER: rollout_id}
    if args:
        return (options, *args[1:]), kwargs
    return args, {**kwargs, "options": options}


def _with_return_token_ids(instance: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The ``_build_request`` arguments with the route's token-id flag (``return_token_ids`` or
    ``enable_response_messages``) set to true in the JSON body."""
    options = args[0] if args else kwargs.get("options")
    key = _token_id_flag(options) if options is not None else None
    if options is None or key is None:
        return args, kwargs
    host = getattr(getattr(instance, "base_url", None), "host", None)
    if host in _STRICT_HOSTS:
        return args, kwargs
    json_data = options.json_data if isinstance(options.json_data, dict) else {}
    extra_json = options.extra_json if isinstance(options.extra_json, dict) else {}
    if options.json_data is not None and not isinstance(options.json_data, dict):
        return args, kwargs  # not a JSON object body; leave it alone
    if key in json_data or key in extra_json:
        return args, kwargs  # the agent decided itself
    # A copy: the SDK reuses its options for retries and for openinference's input capture.
    options = options.model_copy()
    options.extra_json = {**extra_json, key: True}
    if args:
        return (options, *args[1:]), kwargs
    return args, {**kwargs, "options": options}


def _recorder_for(response: Any, options: Any, stream: bool) -> LLMSpanRecorder | None:
    """A recorder for this HTTP response when it answers a chat/completions, completions or
    responses call inside openinference's LLM span, else None."""
    if not _wants_token_ids(options):
        return None
    span = trace_api.get_current_span()
    if not span.is_recording():
        return None
    scope = getattr(span, "instrumentation_scope", None)
    if getattr(scope, "name", None) != _OPENINFERENCE_SCOPE:
        return None  # openinference made no span for this call (suppressed or not ours)
    headers = getattr(response, "headers", None)
    header_version = headers.get(semconv.POLICY_VERSION_HEADER) if headers is not None else None
    return LLMSpanRecorder(span, streaming=bool(stream), header_policy_version=header_version)


def _register(recorders: Any, kwargs: dict) -> bool:
    """Start recording this HTTP response's call when it is one we record; True when it is."""
    try:
        response = kwargs.get("response")
        recorder = _recorder_for(response, kwargs.get("options"), kwargs.get("stream", False))
        if recorder is not None:
            recorders[response] = recorder
            return True
    except Exception:  # noqa: BLE001 - never break the agent
        logger.exception("spanrl: could not start recording an LLM call")
    return False


def _process_response_wrapper(recorders: Any) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        _register(recorders, kwargs)
        return wrapped(*args, **kwargs)

    return wrapper


def _async_process_response_wrapper(recorders: Any) -> Callable[..., Any]:
    async def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        recording = _register(recorders, kwargs)
        result = await wrapped(*args, **kwargs)
        if recording:
            await _parse_async_stream(result)
        return result

    return wrapper


async def _parse_async_stream(result: Any) -> None:
    """Parse a streamed ``with_streaming_response`` result (``AsyncAPIResponse``) now, once.

    openinference keeps its span open over a stream only when it finds the parsed stream in the
    response's cache, but on ``AsyncAPIResponse`` its ``parse()`` is a coroutine it does not await:
    the span would end before any event arrived, without ids (the OpenAI Agents SDK streams this
    way). Parsing here fills that cache (an SSE stream is not read by parsing); the caller's own
    ``await parse()`` then gets the same, traced, stream."""
    if type(result).__name__ != "AsyncAPIResponse" or not getattr(result, "_is_sse_stream", False):
        return
    try:
        await result.parse()
    except Exception:  # noqa: BLE001 - the caller's own parse() will raise it again
        logger.debug("spanrl: could not parse a streamed response ahead of openinference", exc_info=True)


def _process_response_data_wrapper(recorders: Any) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        try:
            response = kwargs.get("response")
            recorder = recorders.get(response) if response is not None else None
            if recorder is not None:
                recorder.observe(kwargs.get("data"))
                if not recorder.streaming:
                    del recorders[response]  # a whole body is read once
        except Exception:  # noqa: BLE001 - never break the agent
            logger.exception("spanrl: could not record token ids of an LLM call")
        return wrapped(*args, **kwargs)

    return wrapper
