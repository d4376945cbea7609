"""Token ids back to text for the rollout page: the whole prompt, and the response token by token.

Called by ``rollout_view.py``. Uses the ``tokenizers`` library on the run's ``tokenizer.json``
(the ``tokenizer`` setting, else the newest checkpoint under ``output_dir/checkpoints``). Each
response token gets the text it adds (``DecodeStream``: a character split over several byte
tokens appears on the token that completes it, so the pieces join to the decoded text).
Without a tokenizer the page shows ids only and says how to give one.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Sequence

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


def find_tokenizer(tokenizer_dir: str | None, output_dir: str) -> str | None:
    """The ``tokenizer.json`` to decode with: the setting's, else the newest checkpoint's."""
    if tokenizer_dir:
        path = os.path.join(tokenizer_dir, TOKENIZER_FILE)
        return path if os.path.isfile(path) else None
    found = glob.glob(os.path.join(output_dir, "checkpoints", "*", TOKENIZER_FILE))
    return max(found, key=os.path.getmtime) if found else None


class TokenDecoder:
    """Decodes with one ``tokenizer.json``; special tokens are shown, not skipped."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self.path = path
        self.tokenizer = Tokenizer.from_file(path)

    def text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The text each token adds, in order; joined, they are the decoded text."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=False)
        pieces = []
        for token_id in ids:
            try:
                piece = stream.step(self.tokenizer, int(token_id))
            except Exception:  # an id outside the vocabulary (another model's ids): show the id
                logger.debug("cannot decode token id %s with %s", token_id, self.path)
                stream = DecodeStream(skip_special_tokens=False)
                piece = f"<{token_id}?>"
            pieces.append(piece or "")
        return _with_unfinished_tail(pieces, self.text(ids))


def _with_unfinished_tail(pieces: list[str], text: str) -> list[str]:
    """Bytes of a character never finished (a sampled byte token the response ends on) decode
    as replacement characters only in the whole text: they go on the first token of the
    trailing run of tokens that added nothing, so the pieces still join to ``text``."""
    joined = "".join(pieces)
    if not pieces or len(text) <= len(joined) or not text.startswith(joined):
        return pieces
    at = len(pieces) - 1
    while pieces[at] == "" and at > 0 and pieces[at - 1] == "":
        at -= 1
    pieces[at] += text[len(joined):]
    return pieces


_decoders: dict[tuple[str, float], TokenDecoder] = {}


def decoder_for(path: str | None) -> TokenDecoder | None:
    """A cached decoder for ``path`` (reloaded when the file changes); None without a path."""
    if path is None:
        return None
    key = (path, os.path.getmtime(path))
    if key not in _decoders:
        _decoders.clear()
        _decoders[key] = TokenDecoder(path)
    return _decoders[key]
