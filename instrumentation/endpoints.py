"""Which endpoint an SDK call goes to, and what spanrl has learned of it.

- Its host: hosts that refuse unknown request fields (``SdkCalls.strict_hosts``) get none of
  spanrl's fields.
- Whether it answered as spanrl's own server and relays do, with a ``policy_version`` in the body:
  such an endpoint packs token ids when asked (``"spanrl_token_ids": "packed"``, docs/interfaces.md
  §1). spanrl asks only those. vLLM ignores the field, but from 0.7.1 until early 2026 it logged a
  warning for every request carrying a field it does not know, which costs a busy server. So the
  first call of a process to an endpoint gets lists, which the recorder reads too, and its answer
  teaches the rest (``LLMSpanRecorder.packing_endpoint``).
"""

from __future__ import annotations

from typing import Any

# The endpoints (``endpoint_of``'s key) that answered as spanrl's server or relay: asked for packed ids.
PACKING_ENDPOINTS: set[str] = set()

# (a client's base URL, its host, its key): httpx computes ``URL.host`` and ``str(URL)`` on each read,
# and an agent mostly calls through one client. The URL object is immutable; a client given a new
# one misses the cache.
_last_base_url: tuple[Any, Any, str] = (None, None, "")


def endpoint_of(client: Any) -> tuple[Any, str]:
    """The host of ``client.base_url`` (None when it has none) and the endpoint's key (the base URL
    as text)."""
    global _last_base_url
    # read where the SDKs keep it (``_configured_base_url`` in openai 3, ``_base_url`` before): the
    # ``base_url`` property of openai 3 imports a module on each read (~1 us, ~3k instructions)
    fields = getattr(client, "__dict__", {})
    base_url = fields.get("_configured_base_url") or fields.get("_base_url") or getattr(client, "base_url", None)
    cached_url, host, key = _last_base_url
    if base_url is not cached_url or base_url is None:
        host, key = getattr(base_url, "host", None), str(base_url)
        _last_base_url = (base_url, host, key)
    return host, key
