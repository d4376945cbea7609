"""A relay's upstreams: which OpenAI-compatible servers are up, how busy each is, and which
one a request goes to (the rollout's own while it is up, else the least loaded).

Used by ``forwarding.py`` and ``app.py``; a pool is touched only on the relay's event loop, so it
needs no lock. The verl gateway names its upstreams by server (``host:port``: requests go to
``/v1/...`` under it, health checks to ``/health``); ``spanrl proxy`` by OpenAI base URL (what the
``openai`` client takes as ``base_url``, e.g. ``https://api.openai.com/v1``), requests go under it.
``rollout_key`` reads a request's rollout from its headers: ``x-spanrl-rollout-id``, else the
``spanrl.rollout.id`` entry of W3C ``baggage``, else the trace id of ``traceparent`` (an agent that
propagates trace context keeps its calls together without knowing spanrl).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

from starlette.datastructures import Headers

from spanrl.instrumentation import semconv

logger = logging.getLogger(__name__)

# how many rollouts' upstreams are remembered; the least recently seen is forgotten first
STICKY_CAPACITY = 100_000

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


class NoUpstreamError(Exception):
    """Every upstream is down (or none is configured); the request is answered 503."""


def normalize_upstream_url(url: str) -> str:
    """``http://host:port`` from ``host:port`` (verl's server addresses), ``http://host:port/v1/``
    or ``http://host:port``: requests append the OpenAI path (``/v1/chat/completions``) to it."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def normalize_base_url(url: str) -> str:
    """An OpenAI base URL without its trailing slash; one without a path gets ``/v1``
    (``http://127.0.0.1:8000`` -> ``http://127.0.0.1:8000/v1``)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url if urlsplit(url).path else f"{url}/v1"


def display_url(url: str) -> str:
    """``url`` as messages and stats show it: without user info or query (they may hold a secret)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def baggage_value(baggage_headers: Iterable[str], key: str) -> str | None:
    """The value of ``key`` in W3C baggage headers (``k1=v1;prop,k2=v2``), percent-decoded."""
    for header in baggage_headers:
        for member in header.split(","):
            name, sep, rest = member.partition("=")
            if sep and name.strip() == key:
                value = unquote(rest.split(";", 1)[0].strip())
                if value:
                    return value
    return None


def traceparent_trace_id(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` header; None when absent, malformed or all zeros."""
    if not traceparent:
        return None
    match = _TRACEPARENT.match(traceparent.strip().lower())
    if match is None or match.group(1) == "0" * 32:
        return None
    return match.group(1)


def rollout_key(headers: Headers) -> str | None:
    """What keeps a request with the rest of its rollout, or None for a request of no rollout."""
    explicit = (headers.get(semconv.ROLLOUT_ID_HEADER) or "").strip()
    if explicit:
        return f"rollout:{explicit}"
    from_baggage = baggage_value(headers.getlist("baggage"), semconv.ROLLOUT_ID)
    if from_baggage:
        return f"rollout:{from_baggage}"
    trace_id = traceparent_trace_id(headers.get("traceparent"))
    return f"trace:{trace_id}" if trace_id else None


@dataclass(frozen=True)
class UpstreamStats:
    """One upstream as ``GatewayHandle.stats()`` and ``GET /spanrl/gateway/stats`` report it."""

    url: str
    model: str | None  # the name the upstream serves its model under, once asked
    up: bool
    down_reason: str  # why it was taken out of rotation ("" while up)
    in_flight: int
    requests: int  # requests sent to it since it joined the pool
    failures: int  # of those, how many got no answer or a 5xx
    rollouts: int  # rollouts routed to it that are remembered


@dataclass
class Upstream:
    """An upstream's live state (mutated on the relay's loop only). ``url`` names it (messages,
    stats, its ``/health``); ``base_url`` is where an OpenAI route's path goes (``/chat/completions``)."""

    url: str
    base_url: str = ""
    model: str | None = None
    up: bool = True
    down_reason: str = ""
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    rollouts: int = 0

    def __post_init__(self) -> None:
        self.base_url = self.base_url or f"{self.url}/v1"

    def stats(self) -> UpstreamStats:
        return UpstreamStats(display_url(self.url), self.model, self.up, self.down_reason, self.in_flight,
                             self.requests, self.failures, self.rollouts)


class UpstreamPool:
    """The upstreams in rotation and the rollout -> upstream table. ``base_urls``: the URLs are
    OpenAI base URLs (the proxy's), not servers (the gateway's ``host:port``)."""

    def __init__(self, urls: Iterable[str], sticky_capacity: int = STICKY_CAPACITY, base_urls: bool = False):
        self._upstreams: dict[str, Upstream] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._capacity = sticky_capacity
        self._base_urls = base_urls
        self.set_urls(urls)

    def set_urls(self, urls: Iterable[str]) -> None:
        """Replace the upstreams; one kept keeps its state and its rollouts, a removed one's
        rollouts move to others on their next request."""
        normalize = normalize_base_url if self._base_urls else normalize_upstream_url
        wanted = list(dict.fromkeys(normalize(u) for u in urls))
        self._upstreams = {url: self._upstreams.get(url) or self._new(url) for url in wanted}
        for key in [k for k, url in self._sticky.items() if url not in self._upstreams]:
            del self._sticky[key]

    @property
    def upstreams(self) -> list[Upstream]:
        return list(self._upstreams.values())

    def _new(self, url: str) -> Upstream:
        return Upstream(url, base_url=url) if self._base_urls else Upstream(url)

    def pick(self, key: str | None) -> Upstream:
        """The upstream for a request of rollout ``key`` (None: any); raises ``NoUpstreamError``."""
        if key is not None:
            url = self._sticky.get(key)
            current = self._upstreams.get(url) if url else None
            if current is not None and current.up:
                self._sticky.move_to_end(key)
                return current
        candidates = [u for u in self._upstreams.values() if u.up]
        if not candidates:
            raise NoUpstreamError(self._describe_none_up())
        chosen = min(candidates, key=lambda u: (u.in_flight, u.rollouts, u.requests))
        if key is not None:
            self._remember(key, chosen)
        return chosen

    def _remember(self, key: str, upstream: Upstream) -> None:
        previous = self._upstreams.get(self._sticky.pop(key, ""))
        if previous is not None:
            previous.rollouts -= 1
        self._sticky[key] = upstream.url
        upstream.rollouts += 1
        while len(self._sticky) > self._capacity:
            _, forgotten_url = self._sticky.popitem(last=False)
            forgotten = self._upstreams.get(forgotten_url)
            if forgotten is not None:
                forgotten.rollouts -= 1

    def mark_down(self, upstream: Upstream, reason: str) -> None:
        """Out of rotation: its rollouts go elsewhere until a health check brings it back."""
        if upstream.up:
            logger.warning("relay: upstream %s is out of rotation: %s", display_url(upstream.url), reason)
        upstream.up, upstream.down_reason = False, reason

    def mark_up(self, upstream: Upstream) -> None:
        if not upstream.up:
            logger.info("relay: upstream %s is back in rotation", display_url(upstream.url))
        upstream.up, upstream.down_reason = True, ""

    def _describe_none_up(self) -> str:
        if not self._upstreams:
            return "the relay has no upstream servers (set_upstreams was given none)"
        down = "; ".join(f"{display_url(u.url)} ({u.down_reason})" for u in self._upstreams.values())
        return f"no upstream server is up: {down}"


__all__ = ["NoUpstreamError", "STICKY_CAPACITY", "Upstream", "UpstreamPool", "UpstreamStats", "baggage_value",
           "display_url", "normalize_base_url", "normalize_upstream_url", "rollout_key", "traceparent_trace_id"]
