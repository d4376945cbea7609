"""How long spanrl's HTTP servers keep a caller's idle connection open: one figure for all of them.

An agent's SDK keeps its connections to the policy endpoint open between calls and reuses them
(httpx, under the OpenAI and Anthropic SDKs, for up to 5 s idle). uvicorn closes an idle
connection after 5 s by default too: a call sent on a connection as the server closes it fails
with a connection error, and an agent built with ``max_retries=0`` loses that rollout (a test
saw it: a call made 5.0 s after the connection's last one). A server that keeps idle connections
longer than its callers do leaves the closing to the caller, which never races with itself.

The other side of the same rule: where spanrl is the client of a server it does not run (the relay
in front of vLLM, whose uvicorn closes idle connections after 5 s, or in front of a hosted API),
it reuses an idle connection for less than that server's limit (``IDLE_CONNECTION_REUSE_S``).

Used by the policy server (``torch_backend/server/``), the relay (``spanrl proxy``, the verl
gateway: both sides) and the dashboard. Stdlib only.
"""

from __future__ import annotations

__all__ = ["IDLE_CONNECTION_REUSE_S", "IDLE_CONNECTION_TIMEOUT_S"]

# Above the idle limits of the clients agents use (httpx 5 s, aiohttp 15 s) and of the load
# balancers in front of services (60 s is common), so the caller closes first.
IDLE_CONNECTION_TIMEOUT_S = 75
# Below uvicorn's default 5 s (vLLM's servers keep it), with room for the clocks of two processes.
IDLE_CONNECTION_REUSE_S = 3.0
