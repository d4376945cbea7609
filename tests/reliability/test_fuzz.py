"""Bad input, fuzzed (hypothesis), each into its real server over real sockets: OTLP protobuf and
JSON payloads into a receiver (in process, over HTTP and over gRPC), its late-feedback route, the bridge API, the policy
server's routes with the agents' token, its weights route, the verl gateway in front of a policy
server, and slow clients of the bridge, the receiver and the policy server. Zero crashes: every
bad case gets its documented status and a message, nothing answers 5xx, a stalled client is
dropped (stdlib servers) and never stops the others being served.

``SPANRL_FUZZ_CASES`` (default 100) sets the cases per target; CI runs the default, the full
run (the figures of docs/reliability.md) is ``bench/reliability.py``.
"""

from __future__ import annotations

import os

import pytest

from spanrl.otlp_receiver.store import SpanStore

CASES = int(os.environ.get("SPANRL_FUZZ_CASES", "100"))
POLICY_CASES = max(1, CASES // 2)  # each valid case generates tokens with a real (tiny) model
SLOW_CASES = max(8, CASES // 10)  # each holds connections until the server's read timeout
AGENT_TOKEN, ADMIN_TOKEN = "agent-token", "admin-token"


@pytest.fixture(scope="module")
def fuzz():
    import reliability_fuzz  # tests/reliability/ is on sys.path (conftest.py)

    return reliability_fuzz


@pytest.fixture(scope="module")
def fuzz_http():
    import reliability_fuzz_http

    return reliability_fuzz_http


def assert_clean(report, cases: int) -> None:
    assert report.cases >= cases * 0.9, report
    assert report.crashes == [] and report.server_errors == 0, report.crashes[:5]


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_otlp_payloads_never_crash_the_receiver(encoding, fuzz, start_receiver):
    receiver = start_receiver(sync="normal", grace_s=0.0)
    report = fuzz.fuzz_otlp(receiver, CASES, encoding, transport_every=5)
    assert_clean(report, CASES)
    receiver.assembler.run_once(now=2e9)  # whatever was stored assembles; none is broken
    with SpanStore(receiver.settings.db) as store:
        assert [s for s in store.rollout_summaries() if s.state == "broken"] == []


@pytest.fixture
def bridge_api():
    from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
    from spanrl.trainer_bridge.task_dispatch import TaskDispatcher

    dispatcher = TaskDispatcher(rollout_timeout_s=30.0)
    dispatcher.open_round(0, [(f"t{i}", {"q": i}) for i in range(20)], group_size=2)
    api = BridgeAPI(dispatcher, PolicyInfo("http://127.0.0.1:9/v1", "policy"), lambda: 1, port=0,
                    token="fuzz-token", read_timeout_s=0.5).start()
    yield api
    dispatcher.close()
    api.stop()


def test_bridge_api_answers_every_bad_request(fuzz_http, bridge_api):
    assert_clean(fuzz_http.fuzz_bridge(bridge_api, "fuzz-token", CASES), CASES)


def test_feedback_route_answers_every_bad_request(fuzz_http, start_receiver):
    receiver = start_receiver(token="fuzz-token")
    assert_clean(fuzz_http.fuzz_feedback(receiver.http_port, "fuzz-token", CASES), CASES)


def test_slow_clients_are_dropped_by_the_bridge_and_the_receiver(fuzz_http, bridge_api, start_receiver):
    auth = {"Authorization": "Bearer fuzz-token"}
    port = int(bridge_api.url.rsplit(":", 1)[1])
    report = fuzz_http.fuzz_slow_clients("bridge", port, SLOW_CASES, "/v1/claim", auth["Authorization"],
                                         fuzz_http.still_answers(f"{bridge_api.url}/v1/info", auth),
                                         drops_them=True, read_timeout_s=0.5)
    assert_clean(report, SLOW_CASES)
    receiver = start_receiver(read_timeout_s=0.5)
    base = f"http://127.0.0.1:{receiver.http_port}"
    report = fuzz_http.fuzz_slow_clients("receiver", receiver.http_port, SLOW_CASES, "/v1/traces", "Bearer x",
                                         fuzz_http.still_answers(f"{base}/spanrl/v1/health", {}),
                                         drops_them=True, read_timeout_s=0.5)
    assert_clean(report, SLOW_CASES)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    import torch

    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    folder = tmp_path_factory.mktemp("fuzz-model")
    corpus = folder / "corpus.txt"
    corpus.write_text("CALC 1+2\nRESULT 3\nANSWER 3\n" * 20)
    model_dir = create_model_dir(folder / "tiny", preset="tiny", corpus_files=[corpus], seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = PolicyEngine.from_pretrained(model_dir, device="cpu", dtype="float32").start()
    yield engine
    engine.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="module")
def policy_server(tiny_engine, weights_dir):
    """One server for the module: the agents' token, and an admin for the weights route whose
    folder holds no model (so no fuzz case ever loads weights)."""
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread
    from spanrl.trainer_bridge.torch_backend.server.policy import WeightsAdmin

    handle = serve_in_thread(tiny_engine, "127.0.0.1", 0, api_token=AGENT_TOKEN,
                             weights_admin=WeightsAdmin(ADMIN_TOKEN, weights_dir))
    yield handle
    handle.stop()


def test_policy_server_answers_every_bad_request(fuzz_http, policy_server, tiny_engine):
    report = fuzz_http.fuzz_policy_server(policy_server.port, tiny_engine.model_name, POLICY_CASES, AGENT_TOKEN)
    assert_clean(report, POLICY_CASES)


def test_the_weights_route_loads_nothing_it_should_not(fuzz_http, policy_server, tiny_engine, weights_dir):
    version = tiny_engine.version
    report = fuzz_http.fuzz_weights_route(policy_server.port, CASES, ADMIN_TOKEN, AGENT_TOKEN, weights_dir)
    assert_clean(report, CASES)
    assert tiny_engine.version == version


def test_slow_clients_do_not_stop_the_policy_server(fuzz_http, policy_server):
    auth = {"Authorization": f"Bearer {AGENT_TOKEN}"}
    report = fuzz_http.fuzz_slow_clients("policy-server", policy_server.port, SLOW_CASES, "/v1/chat/completions",
                                         auth["Authorization"],
                                         fuzz_http.still_answers(f"{policy_server.url}/v1/models", auth),
                                         drops_them=False, read_timeout_s=0.0)
    assert_clean(report, SLOW_CASES)


def test_the_gateway_answers_every_bad_request(fuzz_http, policy_server):
    from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig, start_gateway

    config = GatewayConfig(served_model_name="policy", api_token="gateway-token", upstream_api_key=AGENT_TOKEN)
    with start_gateway(config, [policy_server.url]) as gateway:
        report = fuzz_http.fuzz_gateway(gateway.port, POLICY_CASES, "gateway-token")
    assert_clean(report, POLICY_CASES)


def test_a_body_that_is_not_text_is_a_400_from_the_bridge(fuzz_http, bridge_api):
    """Found by the fuzzer: bytes that are not UTF-8 made json.loads raise UnicodeDecodeError,
    which the bridge answered 500 ("internal error")."""
    case = fuzz_http.HttpCase("POST", "/v1/finish", {"Content-Type": "application/json",
                                                     "Authorization": "Bearer fuzz-token"}, b"\xbf\x00\xff")
    status, _, data = fuzz_http.send(int(bridge_api.url.rsplit(":", 1)[1]), case)
    assert status == 400
    assert "request body is not JSON" in fuzz_http.bridge_message(data)
