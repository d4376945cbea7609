"""Bad input, fuzzed (hypothesis): OTLP protobuf and JSON payloads into a real receiver (in
process, over HTTP and over gRPC), the bridge API and the policy server's API over HTTP. Zero
crashes: every bad case gets its documented status and a message, nothing answers 5xx.

``SPANRL_FUZZ_CASES`` (default 100) sets the cases per target; CI runs the default, the full
run (>= 10^5 cases in all) is ``bench/reliability.py``.
"""

from __future__ import annotations

import os

import pytest

from spanrl.otlp_receiver.store import SpanStore

CASES = int(os.environ.get("SPANRL_FUZZ_CASES", "100"))
POLICY_CASES = max(1, CASES // 2)  # each valid case generates tokens with a real (tiny) model


@pytest.fixture(scope="module")
def fuzz():
    import reliability_fuzz  # tests/reliability/ is on sys.path (conftest.py)

    return reliability_fuzz


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_otlp_payloads_never_crash_the_receiver(encoding, fuzz, start_receiver):
    receiver = start_receiver(sync="normal", grace_s=0.0)
    report = fuzz.fuzz_otlp(receiver, CASES, encoding, transport_every=5)
    assert report.cases >= CASES * 0.9
    assert report.crashes == []
    receiver.assembler.run_once(now=2e9)  # whatever was stored assembles; none is broken
    with SpanStore(receiver.settings.db) as store:
        assert [s for s in store.rollout_summaries() if s.state == "broken"] == []


def test_bridge_api_answers_every_bad_request(fuzz):
    from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
    from spanrl.trainer_bridge.task_dispatch import TaskDispatcher

    dispatcher = TaskDispatcher(rollout_timeout_s=30.0)
    dispatcher.open_round(0, [(f"t{i}", {"q": i}) for i in range(20)], group_size=2)
    api = BridgeAPI(dispatcher, PolicyInfo("http://127.0.0.1:9/v1", "policy"), lambda: 1, port=0,
                    token="fuzz-token").start()
    try:
        report = fuzz.fuzz_bridge(api, "fuzz-token", CASES)
    finally:
        dispatcher.close()
        api.stop()
    assert report.cases >= CASES * 0.9
    assert report.crashes == []


def test_policy_server_answers_every_bad_request(fuzz, tmp_path):
    import torch

    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("CALC 1+2\nRESULT 3\nANSWER 3\n" * 20)
    model_dir = create_model_dir(tmp_path / "tiny", preset="tiny", corpus_files=[corpus], seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = PolicyEngine.from_pretrained(model_dir, device="cpu", dtype="float32").start()
    handle = serve_in_thread(engine, "127.0.0.1", 0)
    try:
        report = fuzz.fuzz_policy_server(handle.port, engine.model_name, POLICY_CASES)
    finally:
        handle.stop()
        engine.stop()
        torch.set_num_threads(threads)
    assert report.cases >= POLICY_CASES * 0.9
    assert report.crashes == []


def test_a_body_that_is_not_text_is_a_400_from_the_bridge(fuzz):
    """Found by the fuzzer: bytes that are not UTF-8 made json.loads raise UnicodeDecodeError,
    which the bridge answered 500 ("internal error")."""
    from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
    from spanrl.trainer_bridge.task_dispatch import TaskDispatcher

    dispatcher = TaskDispatcher(rollout_timeout_s=30.0)
    api = BridgeAPI(dispatcher, PolicyInfo("http://127.0.0.1:9/v1", "policy"), lambda: 1, port=0).start()
    try:
        case = fuzz.HttpCase("POST", "/v1/finish", {"Content-Type": "application/json"}, b"\xbf\x00\xff")
        status, _, data = fuzz.send(int(api.url.rsplit(":", 1)[1]), case)
    finally:
        dispatcher.close()
        api.stop()
    assert status == 400
    assert "request body is not JSON" in fuzz.bridge_message(data)
