"""Token ids to text for the policy engine: end of sequence, stop strings, printable deltas.

Used by ``scheduler.py`` after each sampled token. ``Detokenizer.end_reason`` says whether a
row ends on its new token (an end-of-sequence id, or its token budget); ``Detokenizer.advance``
decodes the row's text, cuts it at a stop string and returns the newly printable piece for
streaming, holding back what could still become a stop string or an unfinished UTF-8 character.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spanrl.trainer_bridge.torch_backend.engine.requests import GenerationRequest

if TYPE_CHECKING:
    from spanrl.trainer_bridge.torch_backend.engine.kv_cache import Row


def end_of_sequence_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a sequence: the generation config's, the model config's, the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class Detokenizer:
    """Turns each row's sampled ids into text; ``eos_ids`` may be changed (tests forbid eos)."""

    def __init__(self, tokenizer: Any, eos_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids

    def end_reason(self, row: Row, token_id: int) -> str | None:
        """"stop" when ``token_id`` (just appended to ``row.ids``) ends a sequence, "length" when
        the row has used its token budget, else None."""
        if token_id in self.eos_ids:
            return "stop"
        if len(row.ids) >= row.request.max_new_tokens:
            return "length"
        return None

    @staticmethod
    def reads_text(request: GenerationRequest, reason: str | None) -> bool:
        """Whether the row's text is needed now: for stop strings, for streamed text, or at its end
        (a request nobody reads before the end skips the per-token decode)."""
        return bool(request.params.stop) or request.text_deltas or reason is not None

    def advance(self, row: Row, reason: str | None) -> tuple[str, str | None]:
        """Decode ``row``'s ids into ``row.text`` (cut at its first stop string, which ends it);
        return (the newly printable text, the row's finish reason or None)."""
        stop = row.request.params.stop
        text = self.tokenizer.decode(row.ids, skip_special_tokens=True)
        if stop:
            hits = [text.find(s, max(0, row.emitted_chars - len(s))) for s in stop]
            hits = [h for h in hits if h >= 0]
            if hits:
                text = text[: min(hits)]
                reason = "stop"
        row.text = text
        if reason is None:
            holdback = max((len(s) - 1 for s in stop), default=0)
            printable = len(text) - holdback
            while printable > row.emitted_chars and text[printable - 1] == "\ufffd":
                printable -= 1  # an unfinished UTF-8 sequence: wait for its next byte
        else:
            printable = len(text)
        delta = text[row.emitted_chars:printable] if printable > row.emitted_chars else ""
        row.emitted_chars = max(row.emitted_chars, printable)
        return delta, reason
