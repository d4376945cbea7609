"""The runner loop: N workers claim attempts from the bridge, run the agent, report back.

A failed or hung agent is reported as a failed rollout and the worker takes the next task;
the runner stops when the bridge says training finished, or when the bridge has been
unreachable for ``bridge_wait_s``. The rollout spans come from ``tracer_provider`` (default:
the global provider, which ``spanrl run`` sets up with ``start_tracing``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable

from opentelemetry.trace import TracerProvider

from spanrl.bridge_protocol import BridgeInfo, ClaimedAttempt
from spanrl.import_path import load_callable

from .attempts import AbandonedAgents, AttemptResult, run_callable_attempt, run_command_attempt
from .bridge_client import BridgeClient, BridgeRefused, BridgeUnavailable, TrainingFinished
from .settings import RunnerSettings

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.1


class Runner:
    def __init__(self, settings: RunnerSettings, *, tracer_provider: TracerProvider | None = None) -> None:
        self.settings = settings
        self.tracer_provider = tracer_provider
        self._stop = threading.Event()
        self.client = BridgeClient(settings.bridge_url, token=settings.bridge_token, stop=self._stop)
        self.counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self.gave_up = False  # a worker stopped: the bridge stayed unreachable, or agents hang
        self.stop_reason: str | None = None  # why, when gave_up
        self.abandoned = AbandonedAgents(settings.max_abandoned_agents)
        self._run_attempt: Callable[[ClaimedAttempt], AttemptResult] = self._prepare_agent()

    def _prepare_agent(self) -> Callable[[ClaimedAttempt], AttemptResult]:
        settings, provider = self.settings, self.tracer_provider
        if settings.agent is not None:
            agent = load_callable(settings.agent, settings.python_path)
            return lambda claim: run_callable_attempt(agent, claim, tracer_provider=provider,
                                                      abandoned=self.abandoned)
        command = list(settings.command or [])
        return lambda claim: run_command_attempt(
            command, claim, settings.otlp_endpoint, settings.wrap_command, settings.env,
            tracer_provider=provider,
        )

    def wait_for_bridge(self) -> BridgeInfo:
        """The bridge's info, retrying until it answers or ``bridge_wait_s`` passes."""
        deadline = time.monotonic() + self.settings.bridge_wait_s
        while True:
            try:
                return self.client.info()
            except BridgeUnavailable:
                if time.monotonic() > deadline or self._stop.is_set():
                    raise
                time.sleep(0.5)

    def point_agents_at_policy(self, info: BridgeInfo) -> None:
        """In-process agents read the policy endpoint from the usual OpenAI variables."""
        os.environ["OPENAI_BASE_URL"] = info.policy_base_url
        os.environ["OPENAI_MODEL"] = info.model
        if self.settings.policy_token:
            os.environ["OPENAI_API_KEY"] = self.settings.policy_token
        os.environ.setdefault("OPENAI_API_KEY", "spanrl")
        for key, value in self.settings.env.items():
            os.environ[str(key)] = str(value)

    def run(self) -> Counter:
        info = self.wait_for_bridge()
        self.point_agents_at_policy(info)
        logger.info("runner: %d workers, policy %s (%s)", self.settings.concurrency,
                    info.policy_base_url, info.model)
        workers = [
            threading.Thread(target=self._work, name=f"spanrl-runner-{i}", daemon=True)
            for i in range(self.settings.concurrency)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        logger.info("runner finished: %s", dict(self.counts))
        return self.counts

    def stop(self) -> None:
        self._stop.set()

    def _count(self, key: str) -> None:
        with self._counts_lock:
            self.counts[key] += 1

    def _give_up(self, reason: str, stop_all: bool) -> None:
        logger.error("giving up: %s", reason)
        self.gave_up = True
        self.stop_reason = reason
        if stop_all:
            self._stop.set()

    def _work(self) -> None:
        unreachable_since: float | None = None
        while not self._stop.is_set():
            if self.abandoned.full():  # claim nothing more: each new hang would add a thread
                self._give_up(
                    f"{self.abandoned.count()} in-process agent threads still run past their rollout timeout "
                    f"(max_abandoned_agents: {self.abandoned.limit}); a Python thread cannot be killed: make the "
                    "agent's own calls time out, or run it as a command (command: [...]), which the runner kills "
                    "at the timeout", stop_all=True)
                return
            try:
                claim = self.client.claim()
                unreachable_since = None
            except TrainingFinished:
                self._stop.set()  # one worker hearing it is enough: the bridge goes away next
                return
            except BridgeRefused as exc:
                self._give_up(str(exc), stop_all=True)
                return
            except BridgeUnavailable as exc:
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since > self.settings.bridge_wait_s:
                    self._give_up(f"the bridge at {self.settings.bridge_url} stayed unreachable: {exc}",
                                  stop_all=False)
                    return
                time.sleep(0.5)
                continue
            if claim is None:
                time.sleep(IDLE_POLL_S)
                continue
            try:
                result = self._run_attempt(claim)
            except Exception as exc:  # a runner bug must not silently kill this worker
                logger.exception("running rollout %s failed", claim.rollout_id)
                result = AttemptResult("failed", f"runner error: {type(exc).__name__}: {exc}")
            self._count(result.status)
            if result.status != "ok":
                logger.warning("rollout %s %s: %s", claim.rollout_id, result.status, result.error)
            try:  # retried inside on transient faults; the bridge counts a repeated report once
                self.client.finish(claim.rollout_id, result.status, result.error)
            except (BridgeUnavailable, BridgeRefused) as exc:
                logger.warning("could not report rollout %s: %s", claim.rollout_id, exc)
