"""What crosses the link between the policy engine's process and the HTTP front end's: frames and messages.

Used by ``link.py`` on both sides. ``FrameChannel`` carries length-prefixed pickle frames over
an anonymous Unix socketpair (both ends are our own processes; nothing else can reach the
socket, so unpickling is safe). Each frame is one of the small frozen dataclasses below, one
per kind of message; ``ErrorInfo`` carries an exception across. Torch-free: the front end
imports it.
"""

from __future__ import annotations

import pickle
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from spanrl.trainer_bridge.torch_backend.engine.requests import (
    EngineError,
    EngineLimits,
    EngineOverloadedError,
    EngineStoppedError,
    GenerationResult,
    PromptTooLongError,
    SamplingParams,
    TokenEvent,
    WeightsVersionError,
)

_HEADER_BYTES = 4
_ERRORS = {cls.__name__: cls for cls in (EngineError, PromptTooLongError, EngineStoppedError, EngineOverloadedError,
                                          WeightsVersionError)}


class FrameChannel:
    """Pickled messages over a stream socket, each prefixed with its length; ``send`` may be
    called from any thread, ``frames`` is read by one thread."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: Any) -> bool:
        """Send one message; False (and nothing raised) when the other side is gone."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self.sock.sendall(len(data).to_bytes(_HEADER_BYTES, "big") + data)
            return True
        except OSError:
            return False

    def frames(self) -> Iterator[Any]:
        """Messages as they arrive, until the socket closes."""
        buffer = bytearray()
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            start = 0
            while len(buffer) - start >= _HEADER_BYTES:
                size = int.from_bytes(buffer[start:start + _HEADER_BYTES], "big")
                end = start + _HEADER_BYTES + size
                if len(buffer) < end:
                    break
                yield pickle.loads(memoryview(buffer)[start + _HEADER_BYTES:end])
                start = end
            del buffer[:start]

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        except OSError:
            pass
        self.sock.close()


@dataclass(frozen=True)
class ErrorInfo:
    """An exception as it crosses the link: its class name, message and offending parameter."""

    kind: str
    message: str
    param: str | None = None

    @classmethod
    def of(cls, error: BaseException | None) -> ErrorInfo | None:
        if error is None:
            return None
        return cls(type(error).__name__, getattr(error, "message", None) or str(error), getattr(error, "param", None))

    def to_exception(self) -> EngineError:
        """The same ``EngineError`` subclass on this side; any other failure of the engine is a 500."""
        known = _ERRORS.get(self.kind)
        if known is not None:
            return known(self.message, self.param)
        # its text stays in the engine's log (EngineHost logs it): no exception text in a response
        error = EngineError("internal error of the policy engine (its details are in the server's log)", self.param)
        error.status, error.error_type = 500, "server_error"
        return error


# front end -> engine


@dataclass(frozen=True)
class Submit:
    """Run a request; only the messages the front end asks for come back (a non-streaming
    request gets just its ``Done``)."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    wants_tokens: bool
    wants_start: bool
    text_deltas: bool


@dataclass(frozen=True)
class Cancel:
    request_id: int


@dataclass(frozen=True)
class Call:
    """Call one of ``EngineHost.CALLS`` on the engine; answered by a ``Reply``."""

    call_id: int
    name: str
    args: tuple


@dataclass(frozen=True)
class Ready:
    """The front end is listening for HTTP."""


# engine -> front end


@dataclass(frozen=True)
class Hello:
    """The engine's first message: what the front end needs to check and encode requests."""

    model_name: str
    version: int
    limits: EngineLimits
    tokenizer: Any
    adapters: dict = field(default_factory=dict)  # adapter name -> its agents (PolicyEngine.adapters)


@dataclass(frozen=True)
class Started:
    request_id: int
    version: int


@dataclass(frozen=True)
class Token:
    request_id: int
    event: TokenEvent


@dataclass(frozen=True)
class Done:
    request_id: int
    result: GenerationResult | None
    error: ErrorInfo | None


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any
    error: ErrorInfo | None


@dataclass(frozen=True)
class VersionPush:
    """New weights were swapped in (pushed with no request in between)."""

    version: int


__all__ = ["FrameChannel", "ErrorInfo", "Submit", "Cancel", "Call", "Ready", "Hello", "Started", "Token", "Done",
           "Reply", "VersionPush"]
