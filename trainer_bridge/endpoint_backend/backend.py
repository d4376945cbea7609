"""``backend: endpoint``: the agents call an OpenAI-compatible endpoint that spanrl does not start
or train, such as ``spanrl proxy`` in front of a hosted model, or a ``spanrl serve`` already running.

Only ``algorithm: apo`` runs on it: the prompt search sets the endpoint's prompt candidates over
its ``/spanrl/v1/prompts`` routes (``prompt_resources.py``) and never asks for an update, so the
weights (a hosted model's included) are never touched. The endpoint's URL is ``endpoint_url``
(its ``/v1`` base), its bearer token ``policy_token``. Started by ``backend.make_backend`` like the
torch and verl backends; imports only the seam. Torch-free.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from spanrl.errors import SettingError, UserError
from spanrl.trainer_bridge.backend import BackendRun, TrainingSample, UpdateStats

logger = logging.getLogger(__name__)

PROMPTS_ROUTE = "/spanrl/v1/prompts"


@dataclass(frozen=True)
class EndpointOptions:
    """``backend: endpoint``'s own settings (from the top-level ``endpoint_url``)."""

    url: str  # the endpoint's OpenAI base URL, e.g. http://127.0.0.1:8300/v1


def check_backend(run: BackendRun) -> None:
    """Refuse what cannot run on an endpoint spanrl does not train (said before any waiting)."""
    options = run.options
    if not isinstance(options, EndpointOptions) or not options.url:
        raise SettingError("backend endpoint needs endpoint_url: the OpenAI base URL (.../v1) of the endpoint the "
                           "agents call (e.g. `spanrl proxy --upstream ...`)")
    if not options.url.startswith(("http://", "https://")):
        raise SettingError(f"endpoint_url must be an http(s) URL ending in /v1, got {options.url!r}")


def start_backend(run: BackendRun) -> EndpointBackend:
    """The endpoint at ``endpoint_url``, once it answers its prompt route (it must serve prompt resources)."""
    check_backend(run)
    backend = EndpointBackend(run.options.url.rstrip("/"), run.endpoint.token)
    backend.check_reachable()
    return backend


class EndpointBackend:
    """A ``PolicyBackend`` whose policy never changes: the endpoint serves what it serves."""

    def __init__(self, url: str, token: str | None):
        self._url = url
        self._token = token

    @property
    def policy_version(self) -> int:
        return 0

    @property
    def endpoint_url(self) -> str:
        return self._url

    def check_reachable(self) -> None:
        """``GET /spanrl/v1/prompts``: the endpoint is up, takes the token and serves prompt resources."""
        import httpx  # not in a plain install (agents' environments), whose `spanrl` CLI imports this module

        root = self._url.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        try:
            reply = httpx.get(root + PROMPTS_ROUTE, headers=headers, timeout=10.0)
        except httpx.HTTPError as exc:
            raise UserError(f"the endpoint {self._url} cannot be reached ({type(exc).__name__}): start it (e.g. "
                            "`spanrl proxy --upstream URL`) or fix endpoint_url") from exc
        if reply.status_code in (401, 403):
            raise UserError(f"the endpoint {self._url} refused the policy_token ({reply.status_code}): set "
                            "policy_token to the endpoint's --token")
        if reply.status_code != 200:
            raise UserError(f"the endpoint {self._url} answered GET {PROMPTS_ROUTE} with {reply.status_code}: "
                            "APO needs an endpoint that serves prompt resources (spanrl proxy or spanrl serve)")
        logger.info("endpoint backend: %s serves prompt resources; its weights are not trained", self._url)

    def update(self, samples: Sequence[TrainingSample]) -> UpdateStats:
        raise UserError("backend endpoint trains no weights: it runs algorithm apo (prompts) only")

    def save_checkpoint(self, root: str) -> str:
        return root  # nothing of the endpoint's is ours to save; APO writes prompts.yaml itself

    def close(self) -> None:
        return None
