"""What a generation request and its result are, without torch: the policy engine's vocabulary.

Shared by the engine (``policy_engine.py`` and its scheduler, which own the model), the HTTP
app (``server/app.py``) and the HTTP front end that runs in its own process
(``server/api_process.py`` over ``link.py``, which must not import torch). ``check_request``
is the one place a request's prompt and sampling parameters are checked against the model's
limits, in whichever process takes it. ``GenerationRequest``'s methods are its lifecycle: the
engine and the link drive a request only through them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class EngineError(Exception):
    """Base of the errors a request can cause; ``status`` is the HTTP status it maps to."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class PromptTooLongError(EngineError):
    """The prompt (plus max_tokens) does not fit the model's context."""


class EngineStoppedError(EngineError):
    status = 503
    error_type = "server_error"


class EngineOverloadedError(EngineError):
    """503: the engine's queue is full; the client may retry after ``retry_after_s``."""

    status = 503
    error_type = "server_error"
    retry_after_s = 1.0


class WeightsVersionError(EngineError):
    """409: weights loaded over HTTP must carry a version above the serving (and pending) one."""

    status = 409


@dataclass
class SamplingParams:
    """How to sample one request. ``top_k`` 0 or -1 and ``top_p`` 1.0 mean off. ``grammar``: an
    llguidance grammar (Lark text or its JSON form) every choice's tokens must follow (the
    server's ``structured_output.py`` builds them); None: unconstrained, at no cost. ``adapter``:
    the per-agent LoRA adapter that generates (the server picks it, ``server/adapter_routing.py``)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str | None = None
    adapter: str | None = None  # the LoRA adapter that serves it (engine/multi_lora.py); None: the base model

    def validate(self, max_n: int) -> None:
        if self.temperature < 0:
            raise EngineError("temperature must be >= 0", "temperature")
        if not 0 < self.top_p <= 1:
            raise EngineError("top_p must be in (0, 1]", "top_p")
        if self.top_k < -1:
            raise EngineError("top_k must be -1, 0 (off) or a positive integer", "top_k")
        if not 1 <= self.n <= max_n:  # max_n is the engine's batch size: choices share a batch
            raise EngineError(f"n must be between 1 and {max_n}", "n")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise EngineError("max_tokens must be at least 1", "max_tokens")
        if not 0 <= self.top_logprobs <= 20:
            raise EngineError("top_logprobs must be between 0 and 20", "top_logprobs")
        if any(not s for s in self.stop):
            raise EngineError("stop strings must not be empty", "stop")


@dataclass
class TokenEvent:
    """One sampled token of one choice (``text`` is the newly printable text, maybe empty)."""

    choice: int
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # set on the choice's last token


@dataclass
class ChoiceResult:
    """A finished choice: every sampled id (eos included), its text and why it stopped."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    choices: list[ChoiceResult]
    policy_version: int


class GenerationRequest:
    """A request in flight: prompt, params, callbacks, and its result once ``done``.

    Created by ``PolicyEngine.submit`` or by the API process's ``RemoteEngine`` (whose subclass
    also sends ``cancel`` to the engine's process). Its lifecycle, driven by whoever runs it:
    ``begin(version)`` when its batch starts, ``emit_token(event)`` per sampled token,
    ``finish_choice(choice)`` per finished choice (the last one completes it), or at once
    ``finish(result)`` / ``finish_unstarted(version)`` / ``fail(error)``. Each completion sets
    ``done`` and calls ``on_done``, once; later completions are ignored. ``cancel()`` only asks:
    the runner sees ``is_cancelled`` and finishes the request at its next step.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                 on_token: Callable[[TokenEvent], None] | None,
                 on_start: Callable[[int], None] | None,
                 on_done: Callable[[], None] | None = None, text_deltas: bool = True):
        self.text_deltas = text_deltas
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.on_token = on_token
        self.on_start = on_start
        self.on_done = on_done
        self.done = threading.Event()
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.policy_version: int | None = None  # set when its batch starts
        self._cancelled = False
        self._choices: list[ChoiceResult] = []  # finished so far

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled

    @property
    def wants_tokens(self) -> bool:
        """Whether anyone reads its tokens as they come (else the runner need not build events)."""
        return self.on_token is not None

    def cancel(self) -> None:
        """Stop decoding this request's rows at the next step (a client went away)."""
        self._cancelled = True

    def begin(self, version: int) -> None:
        """Its batch starts on policy ``version``: recorded, and ``on_start`` called."""
        self.policy_version = version
        if self.on_start is not None:
            safe_call(self.on_start, version)

    def emit_token(self, event: TokenEvent) -> None:
        if self.on_token is not None:
            safe_call(self.on_token, event)

    def finish_choice(self, choice: ChoiceResult) -> None:
        """One choice ended; the last of its ``params.n`` choices completes the request."""
        self._choices.append(choice)
        if len(self._choices) == self.params.n:
            choices = sorted(self._choices, key=lambda c: c.index)
            self.finish(GenerationResult(self.prompt_ids, choices, int(self.policy_version or 0)))

    def finish_unstarted(self, version: int) -> None:
        """Cancelled before its batch started: every choice ends empty ("stop") on policy
        ``version``, without a forward pass (and without ``on_start``)."""
        if self.policy_version is None:
            self.policy_version = version
        params = self.params
        for index in range(params.n):
            self.finish_choice(ChoiceResult(index, [], "", "stop", [] if params.logprobs else None,
                                            [] if params.top_logprobs else None))

    def finish(self, result: GenerationResult) -> None:
        if not self.done.is_set():
            self.result = result
            self._complete(None)

    def fail(self, error: BaseException) -> None:
        self._complete(error)

    def _complete(self, error: BaseException | None) -> None:
        if self.done.is_set():
            return
        self.error = error
        self.done.set()
        if self.on_done is not None:
            safe_call(self.on_done)

    def wait(self, timeout: float | None = None) -> GenerationResult:
        if not self.done.wait(timeout):
            raise TimeoutError("generation did not finish in time")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@dataclass
class EngineStats:
    """Counters since start. ``batches``: prefill passes, each admitting a group of requests
    (into an idle engine or a running batch); ``forward_passes``: prefill and decode passes."""

    batches: int = 0
    forward_passes: int = 0
    tokens_generated: int = 0
    max_rows_in_batch: int = 0


@dataclass(frozen=True)
class EngineLimits:
    """What a request is checked against: the model's vocabulary and context, and the most
    choices (``n``) one request may ask for (its choices decode in one batch)."""

    vocab_size: int
    context_length: int
    max_n: int


# how a user gets a longer context, said with every context error
RAISE_CONTEXT = (" (the model's config.json max_position_embeddings; `spanrl model init --context-length N` "
                 "creates a model with more)")


def check_request(prompt_ids: list[int], params: SamplingParams, limits: EngineLimits) -> int:
    """Raise ``EngineError`` for bad params or a prompt that does not fit; return the most
    tokens the request may generate (``max_tokens``, else the room left in the context)."""
    params.validate(limits.max_n)
    if not prompt_ids:
        raise EngineError("the prompt is empty", "prompt")
    vocab = limits.vocab_size
    if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_ids):
        raise EngineError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
    room = limits.context_length - len(prompt_ids)
    if room < 1:
        raise PromptTooLongError(
            f"the prompt has {len(prompt_ids)} tokens; this model's context is "
            f"{limits.context_length} tokens{RAISE_CONTEXT}", "messages")
    if params.max_tokens is not None and params.max_tokens > room:
        raise PromptTooLongError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"this model's context of {limits.context_length} tokens{RAISE_CONTEXT}", "max_tokens")
    return params.max_tokens or room


def safe_call(callback, *args) -> None:
    """Call a request's callback; a broken one is logged and never stops a batch or a link."""
    try:
        callback(*args)
    except Exception:
        logger.exception("a generation callback failed")
