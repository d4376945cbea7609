"""Faults injected into running parts, each a function that raises AssertionError when the part
does not survive it: kill -9 of the receiver mid-stream, the store's disk full, the receiver down
for a while under an agent, the bridge restarted under running runners, kill -9 of the trainer
mid-step; and a round of claims and reports between runners and the bridge, counting rollouts
lost between them.

Used by ``test_faults.py`` (each once, short) and ``bench/reliability.py`` (repeated, counted).

Disk full is made with RLIMIT_FSIZE on the receiver process, not a small filesystem (mounting a
tmpfs needs root): a write past the limit fails with EFBIG inside SQLite's own write path (the
WAL file), as ENOSPC would, and ``prlimit`` on the running process gives the space back. (SQLite's
``max_page_count`` pragma would fail earlier, in SQLite's page accounting, not in a real write.)
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from reliability_harness import ReceiverProcess, wait_for

from spanrl.child_processes import free_port
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.store import SpanStore

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
FILE_SIZE_LIMIT = 3 * 1024 * 1024
Key = tuple[bytes, bytes]


def emit_rollout(tracer, rollout_id: str, calls: int = 3, padding: int = 0) -> None:
    identity = {semconv.ROLLOUT_ID: rollout_id, semconv.TASK_ID: "faults", semconv.ATTEMPT: 0}
    with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=identity) as root:
        for i in range(calls):
            with tracer.start_as_current_span(f"llm-{i}", attributes={
                    **identity, semconv.LLM_PROMPT_TOKEN_IDS: [i, i + 1], semconv.llm_response_token_ids(0): [7],
                    "padding": "x" * padding}):
                pass
        root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 1.0})


def span_keys(spans) -> set[Key]:
    return {(s.context.trace_id.to_bytes(16, "big"), s.context.span_id.to_bytes(8, "big")) for s in spans}


def integrity(db_path) -> str:
    with sqlite3.connect(db_path) as db:
        return db.execute("PRAGMA integrity_check").fetchone()[0]


class _MemoryAgent:
    """A real SDK tracer whose finished spans are kept, to be exported by hand."""

    def __init__(self) -> None:
        self.memory = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.memory))
        self.tracer = self.provider.get_tracer("agent")

    def rollout_spans(self, rollout_id: str, calls: int = 3, padding: int = 0) -> list:
        self.memory.clear()
        emit_rollout(self.tracer, rollout_id, calls, padding)
        return list(self.memory.get_finished_spans())


def _raw_export(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, channel.unary_unary(EXPORT_METHOD, request_serializer=lambda r: r.SerializeToString(),
                                        response_deserializer=ExportTraceServiceResponse.FromString)


# --- the receiver ----------------------------------------------------------------------------

def receiver_sigkill_midstream(folder: Path, senders: int = 3, seed: int = 0) -> int:
    """kill -9 while ``senders`` exporters stream rollouts; after a restart every acknowledged span
    is there and the store is intact. Returns the number of acknowledged spans checked."""
    rng = random.Random(seed)
    db = folder / f"sigkill-{seed}.db"
    receiver = ReceiverProcess(db).start()
    agent = _MemoryAgent()
    acked: set[Key] = set()
    lock = threading.Lock()
    stop = threading.Event()

    def send(sender: int) -> None:
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{receiver.grpc_port}", insecure=True, timeout=2)
        n = 0
        while not stop.is_set():
            spans = agent.rollout_spans(f"kill-{seed}-{sender}-{n}", calls=5)
            n += 1
            if exporter.export(spans) == SpanExportResult.SUCCESS:
                with lock:
                    acked.update(span_keys(spans))
            else:
                break  # the receiver is gone
        exporter.shutdown()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(senders)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(acked) >= 30, timeout=30, what="acknowledged spans before the kill")
        more = len(acked) + rng.randint(1, 60)  # kill at a random point of the stream: after more acks
        wait_for(lambda: len(acked) >= more, timeout=30, what="more acknowledged spans")
        receiver.kill()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        agent.provider.shutdown()
    assert integrity(db) == "ok"
    restarted = ReceiverProcess(db).start()
    try:
        with SpanStore(db) as store:
            missing = acked - store.span_keys()
        assert not missing, f"{len(missing)} of {len(acked)} acknowledged spans lost by kill -9"
    finally:
        restarted.kill()
    return len(acked)


def disk_full(folder: Path) -> int:
    """The store's file-size limit is reached: a retryable error with a clear message, nothing
    acknowledged is lost, no corruption; once space returns the refused spans are stored and every
    rollout assembles. Returns the number of rollouts checked."""
    db = folder / "disk-full.db"
    receiver = ReceiverProcess(db, file_size_limit=FILE_SIZE_LIMIT).start()
    agent = _MemoryAgent()
    channel, export = _raw_export(receiver.grpc_port)
    acknowledged: set[Key] = set()
    refused_request = None
    try:
        for batch in range(400):
            spans = agent.rollout_spans(f"full-{batch}", calls=20, padding=2000)
            try:
                response = export(encode_spans(spans), timeout=30)
            except grpc.RpcError as exc:
                error, refused_request, refused_keys = exc, encode_spans(spans), span_keys(spans)
                break
            assert not response.HasField("partial_success")
            acknowledged |= span_keys(spans)
        assert refused_request is not None, "the file-size limit was never reached"
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.code()  # retryable: space may come back
        assert "cannot write" in error.details() and "is the disk full" in error.details(), error.details()
        assert "google.rpc.retryinfo-bin" in dict(error.trailing_metadata() or ())
        try:
            export(refused_request, timeout=30)
            raise AssertionError("a write past the file-size limit was acknowledged")
        except grpc.RpcError as again:  # still full: the same retryable answer
            assert again.code() == grpc.StatusCode.UNAVAILABLE
        assert receiver.proc is not None and receiver.proc.poll() is None, "the receiver died on a full disk"
        assert integrity(db) == "ok"
        with SpanStore(db) as store:
            stored = store.span_keys()
        assert acknowledged <= stored and not (refused_keys & stored)

        receiver.raise_file_size_limit()  # space returns
        export(refused_request, timeout=30)
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{receiver.grpc_port}", insecure=True, timeout=30)
        assert exporter.export(agent.rollout_spans("after-space-returns")) == SpanExportResult.SUCCESS
        exporter.shutdown()
        with SpanStore(db) as store:
            wait_for(lambda: len(store.completed_rollouts(0)[0]) == batch + 2, timeout=60,
                     what="every rollout assembled once space returned")
            assert acknowledged | refused_keys <= store.span_keys()
        assert integrity(db) == "ok"
        return batch + 2
    finally:
        channel.close()
        agent.provider.shutdown()
        receiver.kill()


class _ExporterSeenTrying(OTLPSpanExporter):
    """The OTLP/gRPC exporter, saying when it first tried to export (it then retries by itself)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tried = threading.Event()

    def export(self, spans):
        self.tried.set()
        return super().export(spans)


def receiver_down_for_a_while(folder: Path) -> int:
    """An agent runs while the receiver is down: it is not held up (its rollouts end while nothing
    listens), and once the receiver is up the exporter's retries deliver; spans sent after it
    returned assemble too. Returns rollouts checked."""
    port = free_port()
    exporter = _ExporterSeenTrying(endpoint=f"http://127.0.0.1:{port}", insecure=True, timeout=60)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=100))
    tracer = provider.get_tracer("agent")
    receiver = None
    try:
        for i in range(3):
            emit_rollout(tracer, f"while-down-{i}")  # returns: spans are queued, never sent in the agent's thread
        wait_for(exporter.tried.is_set, timeout=30, what="the exporter trying the closed port")
        receiver = ReceiverProcess(folder / "down.db").start(grpc_port=port)
        for i in range(2):
            emit_rollout(tracer, f"after-return-{i}")
        assert provider.force_flush(60_000)
        expected = sorted([f"while-down-{i}" for i in range(3)] + [f"after-return-{i}" for i in range(2)])
        with SpanStore(receiver.db) as store:
            rollouts = wait_for(lambda: (r := store.completed_rollouts(0)[0]) and len(r) == 5 and r,
                                timeout=30, what="all five rollouts assembled")
            assert sorted(r.rollout_id for r in rollouts) == expected
            assert all(len(r.transitions) == 3 and r.total_reward == 1.0 for r in rollouts)
        return len(expected)
    finally:
        provider.shutdown()
        if receiver is not None:
            receiver.kill()


# --- runners and the bridge --------------------------------------------------------------------

@dataclass(frozen=True)
class RoundResult:
    agents: int
    attempts: int
    reported_ok: int
    lost: int  # attempts the bridge counted lost or never heard of
    client_errors: list[str]
    retries: int


def runner_bridge_round(agents: int, restart_bridge: bool = False, work_s: float = 0.3) -> RoundResult:
    """``agents`` concurrent runner workers (the runner's ``BridgeClient``, real HTTP) each claim one
    attempt, work ``work_s`` and report it. With ``restart_bridge`` the bridge's HTTP server is
    stopped once all claimed, and started again on the same port once every worker's report was
    refused at least once (each retries meanwhile)."""
    from spanrl.runner.bridge_client import BridgeClient
    from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
    from spanrl.trainer_bridge.task_dispatch import TaskDispatcher

    policy = PolicyInfo("http://127.0.0.1:9/v1", "policy")
    dispatcher = TaskDispatcher(rollout_timeout_s=60.0)
    attempts = dispatcher.open_round(0, [(f"t{i}", {"i": i}) for i in range(agents)], group_size=1)
    port = free_port()
    api = BridgeAPI(dispatcher, policy, lambda: 0, port=port).start()
    errors: list[str] = []
    retries: list[int] = []
    claimed = threading.Barrier(agents + 1) if restart_bridge else None
    bridge_down = threading.Event()
    clients: list[BridgeClient] = []

    def worker() -> None:
        client = BridgeClient(f"http://127.0.0.1:{port}", retry_for_s=60.0)
        clients.append(client)
        try:
            claim = client.claim()
            if claimed is not None:
                claimed.wait(timeout=120)
                bridge_down.wait(timeout=120)  # report only once the bridge went away
            if claim is None:
                errors.append("nothing to claim")
                return
            time.sleep(work_s)  # the agent's work
            client.finish(claim.rollout_id, "ok")
        except Exception as exc:  # noqa: BLE001 - counted and reported
            errors.append(repr(exc))
        finally:
            retries.append(client.retries)

    threads = [threading.Thread(target=worker) for _ in range(agents)]
    try:
        for thread in threads:
            thread.start()
        if claimed is not None:
            claimed.wait(timeout=120)  # every worker holds an attempt: now the bridge goes away
            api.stop()
            bridge_down.set()
            wait_for(lambda: all(c.retries for c in clients), timeout=120,
                     what="every runner retrying its report against the stopped bridge")
            api = BridgeAPI(dispatcher, policy, lambda: 0, port=port).start()
        for thread in threads:
            thread.join(timeout=180)
        outcomes = dispatcher.wait_round(poll_s=0.05, idle_after_s=0)
    finally:
        dispatcher.close()
        api.stop()
    ok = sum(1 for o in outcomes.values() if o.status == "ok")
    return RoundResult(agents, len(attempts), ok, len(attempts) - ok, errors, sum(retries))



# --- the trainer ---------------------------------------------------------------------------------

TRAINING_RUN = textwrap.dedent("""
    import random, sys
    from pathlib import Path
    from spanrl.trainer_bridge.backend import TrainingSample
    from spanrl.trainer_bridge.torch_backend.checkpoints import list_checkpoints
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer
    model_dir, checkpoints = sys.argv[1:3]
    config = TrainerConfig(device="cpu", learning_rate=1e-3, checkpoint_every=1, checkpoint_dir=checkpoints,
                           keep_checkpoints=2)
    if list_checkpoints(checkpoints):
        trainer = TorchTrainer.resume(checkpoints, config)
    else:
        trainer = TorchTrainer(model_dir, config)
    print(f"started at version {trainer.policy_version}", flush=True)
    rng = random.Random(trainer.step)
    while True:
        batch = [TrainingSample([1] + [rng.randrange(3, 200) for _ in range(6)], [rng.randrange(3, 200), 2],
                                rng.uniform(-1, 1)) for _ in range(8)]
        trainer.grpo_step(batch)  # saves step-NNNNNN after every step
        print(f"version {trainer.policy_version}", flush=True)
""")


def tiny_model_dir(folder: Path) -> Path:
    """A tiny model made here (the tokenizer trained on a few lines), as the trainer tests do."""
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    corpus = folder / "corpus.txt"
    corpus.write_text("CALC 1+2\nRESULT 3\nANSWER 3\n" * 20)
    return create_model_dir(folder / "tiny", preset="tiny", corpus_files=[corpus], seed=0)


def _run_until_killed(model_dir, checkpoints: Path, steps_before_kill: int,
                      mid_checkpoint: bool) -> tuple[int, int]:
    """Train until ``steps_before_kill`` steps were reported, then kill -9 in the next step: right
    away (mid-training) or, with ``mid_checkpoint``, once its checkpoint is being written (its
    staging directory appeared). Returns (version started at, last version reported, i.e. saved)."""
    process = subprocess.Popen([sys.executable, "-c", TRAINING_RUN, str(model_dir), str(checkpoints)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.stdout is not None
    started_at, reported, steps = None, None, 0
    try:
        for line in process.stdout:
            if line.startswith("started at version"):
                started_at = int(line.split()[-1])
            elif line.startswith("version"):
                reported = int(line.split()[-1])
                steps += 1
                if steps >= steps_before_kill:
                    break
        assert started_at is not None and reported is not None, "the training run did not start"
        if mid_checkpoint:  # its staging directory: .step-NNNNNN.partial-<the trainer's pid>
            staging = f".partial-{process.pid}"
            wait_for(lambda: process.poll() is not None
                     or any(p.name.endswith(staging) for p in checkpoints.iterdir()),
                     timeout=120, interval=0.002, what="the next checkpoint being written")
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return started_at, reported


def trainer_kill_rounds(model_dir: Path, checkpoints: Path, kills: int, seed: int = 0) -> int:
    """``kills`` times: train (resuming from the newest checkpoint), kill -9 mid-step. Checks the
    resume never goes back and the newest checkpoint is whole. Returns the version reached."""
    from transformers import AutoModelForCausalLM

    from spanrl.trainer_bridge.torch_backend.checkpoints import STATE_FILE, list_checkpoints
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

    highest_saved = 0
    for kill in range(kills):  # mid-checkpoint and mid-training kills alternate (the seed picks the first)
        started_at, reported = _run_until_killed(model_dir, checkpoints, 2, mid_checkpoint=(kill + seed) % 2 == 0)
        assert started_at >= highest_saved, f"resumed at version {started_at} after {highest_saved} was saved"
        highest_saved = max(highest_saved, reported)
        complete = list_checkpoints(checkpoints)
        assert complete, "no complete checkpoint after the kill"
        newest = complete[-1]
        state = json.loads((newest / STATE_FILE).read_text())
        assert state["policy_version"] >= highest_saved
        # what a policy server would load from the newest checkpoint is whole
        assert AutoModelForCausalLM.from_pretrained(newest) is not None
        for entry in checkpoints.iterdir():  # anything else is a hidden staging or replaced directory
            assert entry in complete or entry.name.startswith("."), entry
    resumed = TorchTrainer.resume(checkpoints)
    assert resumed.policy_version >= highest_saved >= 2 * kills
    return resumed.policy_version
