"""The retrieval QA agent's search engine: BM25 over the example's corpus, with ``bm25s``.

``search(query)`` returns the ``TOP_K`` best documents' texts, one a line, as the agent's
``search`` tool shows them to the model ("no results" when no word of the query is in the
corpus). The index is built once per process from ``corpus.jsonl`` (164 short documents: a few
milliseconds). ``search_in(texts, query)`` does the same over another corpus: the warm-start
demonstrations search their own world's encyclopedia with it, so the model is trained on tool
results shaped exactly like those it will see.
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
def _index(texts: tuple[str, ...]) -> bm25s.BM25:
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(list(texts), stopwords=STOPWORDS, show_progress=False), show_progress=False)
    return retriever


@functools.cache
def _corpus_texts() -> tuple[str, ...]:
    return tuple(doc["text"] for doc in load_corpus())


def search(query: str, k: int = TOP_K) -> str:
    """The ``k`` documents of the example's corpus that best match ``query`` (BM25), one a line."""
    return search_in(_corpus_texts(), query, k)


# The same query over the same texts always finds the same documents: the warm start's
# demonstrations search a few hundred names ~80,000 times (~1 ms each, a third of it the progress
# bars bm25s builds even when told to show none), and an agent often asks again.
@functools.lru_cache(maxsize=4096)
def search_in(texts: tuple[str, ...], query: str, k: int = TOP_K) -> str:
    """The ``k`` of ``texts`` that best match ``query`` (BM25), one a line."""
    with _lock:  # each index is built once; bm25s' retrieval is not documented as thread-safe
        retriever = _index(texts)
        words = bm25s.tokenize([query], stopwords=STOPWORDS, return_ids=False, show_progress=False)[0]
        known = [word for word in words if word in retriever.vocab_dict]
        if not known:
            return "no results"
        ids, scores = retriever.retrieve([known], k=k, show_progress=False)
    return "\n".join(texts[int(i)] for i, score in zip(ids[0], scores[0], strict=True) if score > 0) or "no results"
