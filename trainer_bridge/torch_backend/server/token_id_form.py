"""The form a route writes token ids in: vLLM's lists of ints, or one packed string per list.

spanrl's instrumentation asks for the engine's ids on each call it records (``return_token_ids``,
``enable_response_messages``) and adds ``"spanrl_token_ids": "packed"`` to the body with that flag
(a client may send the header ``x-spanrl-token-ids: packed`` instead). Each id list of the answer
is then one string (``instrumentation/packed_values.py``: base64 of little-endian unsigned 32-bit
ints), which the agent's SDK parses as one JSON string instead of one int per id, and which the
recorder reads in one C pass (docs/interfaces.md §1; docs/performance.md measures it). vLLM ignores
the field and sends lists, and the recorder reads both. Any other client (verl's agent loop, a
user's own code) gets lists unless it asks. A stream's per-token chunks keep their one id a list:
a one-element list parses for less than a packed string decodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, Field, PrivateAttr

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import asks_packed_ids, pack_token_ids


class TokenIdForm(BaseModel):
    """Base of the request bodies whose answer may carry token ids: the form the request asked for."""

    # (the alias from semconv, the one definition of the wire name; pydantic's mypy plugin wants a literal)
    token_ids_form: Literal["packed", "lists"] | None = Field(  # type: ignore[literal-required]
        None, alias=semconv.TOKEN_IDS_FORM_FIELD)
    _packed_ids: bool = PrivateAttr(False)

    def read_id_form(self, headers: Mapping[str, str]) -> None:
        """Note the form asked for: the body's ``spanrl_token_ids``, else the ``x-spanrl-token-ids``
        header of ``headers``, else lists."""
        self._packed_ids = asks_packed_ids(headers, {semconv.TOKEN_IDS_FORM_FIELD: self.token_ids_form})

    def id_list(self, ids: Sequence[int]) -> list[int] | str:
        """``ids`` as the answer carries them: a packed string, or a list of ints."""
        return pack_token_ids(ids) if self._packed_ids else list(ids)
