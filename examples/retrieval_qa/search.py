"""The retrieval QA agent's search engine: BM25 over the example's corpus, with ``bm25s``.

``search(query)`` returns the ``TOP_K`` best documents' texts, one a line, as the agent's
``search`` tool shows them to the model ("no results" when no word of the query is in the
corpus). The index is built once per process from ``corpus.jsonl`` (164 short documents: a few
milliseconds). Both the agent (``agent.py``) and the warm-start demonstrations use it, so the
model is trained on exactly the tool results it will see.
"""

from __future__ import annotations

import functools
import threading

import bm25s

from .corpus import load_corpus

TOP_K = 2
STOPWORDS = "en"

_lock = threading.Lock()


@functools.cache
def _index() -> tuple[bm25s.BM25, list[str]]:
    texts = [doc["text"] for doc in load_corpus()]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords=STOPWORDS, show_progress=False), show_progress=False)
    return retriever, texts


def search(query: str, k: int = TOP_K) -> str:
    """The ``k`` documents that best match ``query`` (BM25), one a line."""
    with _lock:  # the index is built once; bm25s' retrieval is not documented as thread-safe
        retriever, texts = _index()
        words = bm25s.tokenize([query], stopwords=STOPWORDS, return_ids=False, show_progress=False)[0]
        known = [word for word in words if word in retriever.vocab_dict]
        if not known:
            return "no results"
        ids, scores = retriever.retrieve([known], k=k, show_progress=False)
    return "\n".join(texts[int(i)] for i, score in zip(ids[0], scores[0], strict=True) if score > 0) or "no results"
