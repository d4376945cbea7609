"""The form a route writes token ids in: vLLM's lists of ints, or one packed string per list.

spanrl's instrumentation asks for the engine's ids on each call it records (``return_token_ids``,
``enable_response_messages``) and sends ``x-spanrl-token-ids: packed`` with that flag. Each id list
of the answer is then one string (``instrumentation/packed_values.py``: base64 of little-endian
unsigned 32-bit ints), which the agent's SDK parses as one JSON string instead of one int per id,
and which the recorder reads in one C pass (docs/interfaces.md §1; docs/performance.md measures
it). vLLM ignores the header and sends lists, and the recorder reads both. Any other client (verl's
agent loop, a user's own code) gets lists unless it sends the header. A stream's per-token chunks
keep their one id a list: a one-element list parses for less than a packed string decodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, PrivateAttr

from spanrl.instrumentation.packed_values import asks_packed_ids, pack_token_ids


class TokenIdForm(BaseModel):
    """Base of the request bodies whose answer may carry token ids: the form the request asked for."""

    _packed_ids: bool = PrivateAttr(False)

    def read_id_form(self, headers: Mapping[str, str]) -> None:
        """Note the form the request's ``headers`` ask for (lists unless ``x-spanrl-token-ids: packed``)."""
        self._packed_ids = asks_packed_ids(headers)

    def id_list(self, ids: Sequence[int]) -> list[int] | str:
        """``ids`` as the answer carries them: a packed string, or a list of ints."""
        return pack_token_ids(ids) if self._packed_ids else list(ids)
