"""The running receiver: gRPC and HTTP servers, the ingest writer and the assembler thread.

Used by ``spanrl receive`` and by tests (in-process, on free ports)::

    with ReceiverServer(ReceiverSettings(grpc_port=0, http_port=0, db="x.db")) as server:
        ...  # export to 127.0.0.1:server.grpc_port / server.http_port

The assembler wakes every ``poll_s``, asks the store which open rollouts have ended
(their ``spanrl.rollout`` span or an explicit completion plus ``grace_s`` of quiet, or
``idle_timeout_s`` without spans), assembles each and saves the result. Because rollout state
lives in the store, a rollout open when the process died completes after a restart. After each
pass it indexes the rollouts just assembled for late feedback and joins what waited for them
(``feedback_store.FeedbackStore.catch_up``).
"""

from __future__ import annotations

import gc
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from spanrl.otlp_receiver.air import load_rules
from spanrl.otlp_receiver.assembly import AssemblyOptions, assemble_rollout
from spanrl.otlp_receiver.export_service import ExportService
from spanrl.otlp_receiver.feedback_intake import EventFeedback
from spanrl.otlp_receiver.feedback_store import FeedbackStore
from spanrl.otlp_receiver.grpc_service import GrpcExportServer
from spanrl.otlp_receiver.http_service import HttpExportServer
from spanrl.otlp_receiver.ingest import IngestWriter
from spanrl.otlp_receiver.rewards import RewardPolicy
from spanrl.otlp_receiver.settings import ReceiverSettings
from spanrl.otlp_receiver.span_tree import records_from_bodies
from spanrl.otlp_receiver.store import SpanStore, StoreError
from spanrl.otlp_receiver.store_lock import ReceiverLock
from spanrl.otlp_receiver.tls import grpc_server_credentials, http_ssl_context
from spanrl.schema.rollouts import AssembledRollout
from spanrl.server_security import warn_if_exposed

logger = logging.getLogger(__name__)


def assembly_options(settings: ReceiverSettings) -> AssemblyOptions:
    retokenizer = None
    if settings.retokenize_with:
        from spanrl.otlp_receiver.retokenize import Retokenizer

        retokenizer = Retokenizer(settings.retokenize_with)
    return AssemblyOptions(
        credit=settings.credit,
        gamma=settings.gamma,
        air_rules=load_rules(settings.air_rules),
        rewards=RewardPolicy(settings.reward_min, settings.reward_max, settings.reward_out_of_range,
                             settings.evaluation_rewards),
        retokenizer=retokenizer,
    )


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused meanwhile (nested pauses keep it off).

    Reading a rollout's spans and building its tree allocate many small linked objects, which
    the collector would rescan again and again as they pile up (measured on a 100k-span rollout:
    286 collections, 0.45 s of 2.3 s), and nothing there makes cycles to collect. Resuming, the
    objects made meanwhile are moved to the oldest generation without a scan (``freeze`` then
    ``unfreeze``: two list splices), else the first allocation after would scan them all at once
    (0.46 s). Skipped when the process froze objects itself (``unfreeze`` would thaw them)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


class Assembler:
    """Assembles ended rollouts from the store, in a thread or on demand (``run_once``)."""

    def __init__(self, store: SpanStore, settings: ReceiverSettings, options: AssemblyOptions,
                 feedback: FeedbackStore | None = None) -> None:
        self.store = store
        self.settings = settings
        self.options = options
        self.feedback = feedback  # late feedback joined as rollouts are assembled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spanrl-assembler", daemon=True)
        # one pass at a time: two passes would both see a rollout ready and assemble it twice
        self._pass_lock = threading.Lock()

    def run_once(self, now: float | None = None) -> list[AssembledRollout]:
        """Assemble every rollout ready at ``now``; safe to call while the thread runs."""
        with self._pass_lock:
            return self._assemble_ready(time.time() if now is None else now)

    def _assemble_ready(self, now: float) -> list[AssembledRollout]:
        done = []
        for ready in self.store.rollouts_ready(
            now,
            grace_s=self.settings.grace_s,
            idle_timeout_s=self.settings.idle_timeout_s,
            on_rollout_span=self.settings.complete_on_rollout_span,
        ):
            try:
                with gc_paused():
                    bodies = self.store.rollout_bodies(ready.rollout_id)
            except (sqlite3.Error, StoreError) as exc:  # busy/locked passes: retry next poll
                logger.warning("cannot read the spans of rollout %s (%s); retrying on the next poll",
                               ready.rollout_id, exc)
                continue
            try:
                rollout, span_count = self.assemble_bodies(ready.rollout_id, ready.end_reason, bodies)
            except Exception as exc:  # a bug must not stall the other rollouts, or loop forever
                logger.exception("assembly of rollout %s failed; marked broken", ready.rollout_id)
                self.store.mark_broken(ready.rollout_id, f"{type(exc).__name__}: {exc}")
                continue
            saved = self.store.save_assembled(rollout)
            done.append(saved)
            logger.info(
                "rollout %s assembled (%s): %d spans, %d transitions, total reward %s%s",
                saved.rollout_id, saved.end_reason, span_count, len(saved.transitions),
                saved.total_reward, f", {len(saved.problems)} problem(s)" if saved.problems else "",
            )
            for problem in saved.problems:
                logger.info("rollout %s: %s", saved.rollout_id, problem)
        if self.feedback is not None:
            joined = self.feedback.catch_up(self.store, now)
            if joined:
                logger.info("%d late feedback joined to their rollouts", joined)
        return done

    def assemble(self, rollout_id: str, end_reason: str) -> tuple[AssembledRollout, int]:
        """Read, decode and assemble one rollout (not saved); returns it and its span count."""
        with gc_paused():
            return self.assemble_bodies(rollout_id, end_reason, self.store.rollout_bodies(rollout_id))

    def assemble_bodies(self, rollout_id: str, end_reason: str, bodies: list[bytes]) -> tuple[AssembledRollout, int]:
        """Decode and assemble one rollout from its spans' stored ``bodies``; returns it and
        their count."""
        with gc_paused():
            records = records_from_bodies(bodies)
            rollout = assemble_rollout(rollout_id, records, end_reason, self.options)
        return rollout, len(bodies)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.poll_s):
            try:
                self.run_once()
            except Exception:  # keep assembling the other rollouts
                logger.exception("assembly failed")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class ReceiverServer:
    def __init__(self, settings: ReceiverSettings) -> None:
        self.settings = settings.validate()
        options = self.options = assembly_options(settings)
        # one receiver per store (StoreInUse otherwise), held until stop()
        self.lock = ReceiverLock(settings.db).acquire()
        try:
            self.write_store = SpanStore(settings.db, sync=settings.sync)
            self.read_store = SpanStore(settings.db, sync=settings.sync)
            self.feedback = FeedbackStore(settings.db, settings.feedback_ttl_s, settings.feedback_max_pending)
        except BaseException:
            self.lock.release()
            raise
        self.writer = IngestWriter(self.write_store, settings.max_pending_bytes, settings.retry_after_s)
        self.export = ExportService(self.writer, settings.token, EventFeedback(self.feedback, options.rewards))
        self.assembler = Assembler(self.read_store, settings, options, self.feedback)
        self.grpc: GrpcExportServer | None = None
        self.http: HttpExportServer | None = None
        self._started = False

    @property
    def grpc_port(self) -> int:
        assert self.grpc is not None, "start() first"
        return self.grpc.port

    @property
    def http_port(self) -> int:
        assert self.http is not None, "start() first"
        return self.http.port

    def start(self) -> ReceiverServer:
        s = self.settings
        self.writer.start()
        try:
            ssl_context = http_ssl_context(s.tls_cert, s.tls_key) if s.tls_cert and s.tls_key else None
            credentials = grpc_server_credentials(s.tls_cert, s.tls_key) if s.tls_cert and s.tls_key else None
            self.grpc = GrpcExportServer(self.export, s.host, s.grpc_port, s.workers, s.max_message_bytes,
                                         credentials, s.max_concurrent_rpcs)
            self.http = HttpExportServer(self.export, self.read_store, s.host, s.http_port, s.max_message_bytes,
                                         ssl_context, s.read_timeout_s, self.feedback, self.options.rewards)
        except Exception:
            if self.grpc is not None:
                self.grpc.stop(0)
            self.writer.stop()
            self.write_store.close()
            self.read_store.close()
            self.feedback.close()
            self.lock.release()
            raise
        self.grpc.start()
        self.http.start()
        self.assembler.start()
        self._started = True
        warn_if_exposed("the receiver", s.host, bool(s.token), s.tls, logger, "--token, --tls-cert/--tls-key")
        logger.info(
            "spanrl receiver: OTLP/gRPC on %s:%d%s, OTLP/HTTP on %s://%s:%d, store %s",
            s.host, self.grpc.port, " (TLS)" if s.tls else "", "https" if s.tls else "http", s.host,
            self.http.port, s.db,
        )
        return self

    def stop(self) -> None:
        """Stop taking requests, finish those in flight, then stop writing."""
        if self.http is not None:
            self.http.stop()
        if self.grpc is not None:
            self.grpc.stop()
        self.writer.stop()
        self.assembler.stop()
        self.write_store.close()
        self.read_store.close()
        self.feedback.close()
        self.lock.release()
        self._started = False

    def __enter__(self) -> ReceiverServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
