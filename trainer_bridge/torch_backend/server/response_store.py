"""The Responses API's server-side state: stored responses, so a request can continue one with
``previous_response_id``. In memory, bounded: the least recently used response is dropped when
the store is full (a follow-up to it then gets a 404, as for an unknown id).

Created with the app's ``ServerState`` (``serving.py``); read and written by ``responses.py``.
A stored response keeps the conversation it ended (its chat messages, without its
``instructions``, which OpenAI does not carry over) and its body, for ``GET /v1/responses/{id}``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_STORED_RESPONSES = 4096


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: the chat messages up to and including its reply, and its body."""

    messages: tuple[dict[str, Any], ...]
    body: Any  # responses_protocol.ResponsesResponse


class ResponseStore:
    """Responses by id, at most ``max_entries`` of them (least recently used dropped first)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_entries < 1:
            raise ValueError(f"a response store holds at least 1 response, got max_entries={max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            self._entries[response_id] = entry
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None


__all__ = ["DEFAULT_MAX_STORED_RESPONSES", "ResponseStore", "StoredResponse"]
