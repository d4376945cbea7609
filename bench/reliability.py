"""The reliability figures of spanrl, each printed on its own line:

- spans sent / acked / stored / lost, with Python and Node.js agents exporting at about twice
  the receiver's measured capacity (plus the spans clients failed or dropped on their side);
- faults injected / survived: kill -9 of the receiver mid-stream, the store's disk full, the
  receiver down for a while, the bridge restarted under running runners, kill -9 of the trainer
  mid-step;
- cases fuzzed / 5xx answered / crashes, per server: OTLP protobuf and JSON into the receiver,
  the bridge API, the policy server's API with the agents' token, its weights route, the verl
  gateway in front of a policy server, and slow clients of the receiver, the bridge and the
  policy server (docs/reliability.md has the figures);
- rollouts lost between runner and bridge at 1, 32 and 256 concurrent agents.

    python bench/reliability.py            # the full run (>= 10^5 fuzz cases; see the time below)
    python bench/reliability.py --short    # small numbers (CI: tests/reliability/test_bench_short.py)

Time: the full fuzz section (95,800 cases over nine targets) ran in 1,473 s on a shared, busy
2-core machine (`--only fuzz`); the other sections take a few minutes. Exits 1 when anything was
lost, crashed or not survived. The scenarios live in tests/reliability/ (``reliability_*.py``),
shared with the test suite; this needs the dev extra (hypothesis) and, for the Node.js agents,
``npm install`` in tests/node.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "reliability"))

import reliability_faults as faults  # noqa: E402
import reliability_fuzz as fuzz  # noqa: E402
import reliability_fuzz_http as fuzz_http  # noqa: E402
import reliability_overload as overload  # noqa: E402
from reliability_harness import ReceiverProcess  # noqa: E402

MAX_RSS_GROWTH_MIB = 200  # the receiver's memory under overload: bounded by --max-pending-mb, not by load
FUZZ_SHARES = {"fuzz_protobuf": 30, "fuzz_json": 20, "fuzz_bridge": 12, "fuzz_policy": 12, "fuzz_weights": 8,
               "fuzz_gateway": 12, "fuzz_slow": 6}  # percent of --fuzz-cases per target
FULL = {"fuzz_protobuf": 30_000, "fuzz_json": 20_000, "fuzz_bridge": 12_000, "fuzz_policy": 12_000,
        "fuzz_weights": 8_000, "fuzz_gateway": 12_000, "fuzz_slow": 600,
        "overload_s": 20.0, "python_agents": 4, "node_agents": 4, "receiver_kills": 5, "disk_full": 2,
        "receiver_down": 2, "bridge_restarts": 3, "trainer_kills": 3, "agents": (1, 32, 256),
        "max_pending_mb": "1", "capacity_s": 3.0, "form": "full"}
SHORT = {"fuzz_protobuf": 40, "fuzz_json": 40, "fuzz_bridge": 40, "fuzz_policy": 0, "fuzz_weights": 0,
         "fuzz_gateway": 0, "fuzz_slow": 16,
         "overload_s": 1.5, "python_agents": 2, "node_agents": 2, "receiver_kills": 1, "disk_full": 1,
         "receiver_down": 1, "bridge_restarts": 1, "trainer_kills": 0, "agents": (1, 32, 256),
         "max_pending_mb": "0.05", "capacity_s": 1.0, "form": "short"}


class Figures:
    def __init__(self) -> None:
        self.failed = False

    def line(self, text: str, bad: bool = False) -> None:
        self.failed |= bad
        print(text, flush=True)


def run_spans(figures: Figures, folder: Path, plan: dict) -> None:
    node = shutil.which("node") if (overload.NODE_DIR / "node_modules").is_dir() else None
    # a small pending limit: the receiver pushes back (retryable refusals) rather than queueing
    receiver = ReceiverProcess(folder / "overload.db", "--max-pending-mb", plan["max_pending_mb"]).start()
    try:
        report = overload.run_overload(receiver, plan["overload_s"], plan["python_agents"], plan["node_agents"],
                                       node, capacity_s=plan["capacity_s"])
    finally:
        receiver.kill()
    consistent = report.stored == report.acked - report.rejected_late + report.stored_failed
    accounted = report.acked + report.failed + report.dropped_by_clients == report.sent
    figures.line(f"spans: sent {report.sent} / acked {report.acked} / stored {report.stored} / lost {report.lost}",
                 bad=report.lost != 0 or not consistent or not accounted)
    for text in report.lines():
        figures.line(f"  {text}")
    if report.overloaded_requests == 0:
        figures.line("  the receiver never pushed back: the load did not exceed its capacity", bad=True)
    growth = (report.rss_peak_bytes - report.rss_start_bytes) / (1024 * 1024)
    if growth > MAX_RSS_GROWTH_MIB:
        figures.line(f"  receiver memory grew {growth:.0f} MiB (> {MAX_RSS_GROWTH_MIB} MiB)", bad=True)
    if node is None:
        figures.line("  (no Node.js agents: node or tests/node/node_modules missing)")


def run_faults(figures: Figures, folder: Path, plan: dict) -> None:
    scenarios: list[tuple[str, int, Callable[[int], object]]] = [
        ("receiver kill -9 mid-stream", plan["receiver_kills"],
         lambda n: faults.receiver_sigkill_midstream(folder, seed=n)),
        ("store disk full (RLIMIT_FSIZE)", plan["disk_full"], lambda n: faults.disk_full(_fresh(folder, f"full{n}"))),
        ("receiver down for a while", plan["receiver_down"],
         lambda n: faults.receiver_down_for_a_while(_fresh(folder, f"down{n}"))),
        ("bridge restarted under 32 runners", plan["bridge_restarts"], lambda n: _bridge_restart()),
    ]
    if plan["trainer_kills"]:
        model_dir = faults.tiny_model_dir(_fresh(folder, "model"))
        scenarios.append(("trainer kill -9 mid-step", plan["trainer_kills"],
                          lambda n: faults.trainer_kill_rounds(model_dir, _fresh(folder, f"ckpt{n}"), 1, seed=n)))
    injected = survived = 0
    details = []
    for name, times, scenario in scenarios:
        ok = 0
        for n in range(times):
            try:
                scenario(n)
                ok += 1
            except Exception as exc:  # noqa: BLE001 - a fault not survived is a figure, not a stop
                details.append(f"  {name} #{n}: NOT survived: {type(exc).__name__}: {exc}")
                traceback.print_exc(file=sys.stderr)
        injected += times
        survived += ok
        details.append(f"  {name}: {ok}/{times}")
    figures.line(f"faults: injected {injected} / survived {survived}", bad=survived != injected)
    for text in details:
        figures.line(text)


def _bridge_restart() -> None:
    result = faults.runner_bridge_round(32, restart_bridge=True)
    assert result.lost == 0 and not result.client_errors, result


def _fresh(folder: Path, name: str) -> Path:
    path = folder / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_fuzz(figures: Figures, folder: Path, plan: dict) -> None:
    from spanrl.otlp_receiver.server import ReceiverServer
    from spanrl.otlp_receiver.settings import ReceiverSettings

    reports = []
    settings = ReceiverSettings(grpc_port=0, http_port=0, db=str(folder / "fuzz.db"), sync="normal", grace_s=0.0,
                                poll_s=0.2, idle_timeout_s=0, read_timeout_s=SLOW_CLIENT_TIMEOUT_S)
    with ReceiverServer(settings) as receiver:
        reports.append(fuzz.fuzz_otlp(receiver, plan["fuzz_protobuf"], "protobuf"))
        reports.append(fuzz.fuzz_otlp(receiver, plan["fuzz_json"], "json"))
        if plan["fuzz_slow"]:
            health = fuzz_http.still_answers(f"http://127.0.0.1:{receiver.http_port}/spanrl/v1/health", {})
            reports.append(fuzz_http.fuzz_slow_clients("receiver", receiver.http_port, plan["fuzz_slow"], "/v1/traces",
                                                       "Bearer x", health, True, SLOW_CLIENT_TIMEOUT_S))
    reports += _fuzz_bridge(plan)
    if plan["fuzz_policy"]:
        reports += _fuzz_policy(folder, plan)
    cases = sum(r.cases for r in reports)
    server_errors = sum(r.server_errors for r in reports)
    crashes = sum(len(r.crashes) for r in reports)
    figures.line(f"fuzz: cases {cases} / 5xx {server_errors} / crashes {crashes}", bad=crashes + server_errors != 0)
    for report in reports:
        figures.line(f"  {report.target}: cases {report.cases} / 5xx {report.server_errors} / crashes "
                     f"{len(report.crashes)}")
        for crash in report.crashes[:5]:
            figures.line(f"    {crash}")


SLOW_CLIENT_TIMEOUT_S = 0.5  # the stdlib servers' read timeout in the fuzz (30 s by default)


def _fuzz_bridge(plan: dict) -> list:
    from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
    from spanrl.trainer_bridge.task_dispatch import TaskDispatcher

    dispatcher = TaskDispatcher(rollout_timeout_s=30.0)
    dispatcher.open_round(0, [(f"t{i}", {"q": i}) for i in range(50)], group_size=2)
    api = BridgeAPI(dispatcher, PolicyInfo("http://127.0.0.1:9/v1", "policy"), lambda: 1, port=0,
                    token="fuzz-token", read_timeout_s=SLOW_CLIENT_TIMEOUT_S).start()
    try:
        reports = [fuzz_http.fuzz_bridge(api, "fuzz-token", plan["fuzz_bridge"])]
        if plan["fuzz_slow"]:
            auth = {"Authorization": "Bearer fuzz-token"}
            info = fuzz_http.still_answers(f"{api.url}/v1/info", auth)
            reports.append(fuzz_http.fuzz_slow_clients("bridge", int(api.url.rsplit(":", 1)[1]), plan["fuzz_slow"],
                                                       "/v1/claim", auth["Authorization"], info, True,
                                                       SLOW_CLIENT_TIMEOUT_S))
        return reports
    finally:
        dispatcher.close()
        api.stop()


def _fuzz_policy(folder: Path, plan: dict) -> list:
    """The policy server with the agents' token and an admin, its weights route, the gateway in
    front of it, and its slow clients."""
    import torch

    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread
    from spanrl.trainer_bridge.torch_backend.server.policy import WeightsAdmin
    from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig, start_gateway

    torch.set_num_threads(1)
    model_dir = faults.tiny_model_dir(_fresh(folder, "policy-model"))
    weights_dir = str(_fresh(folder, "weights"))  # no model in it: no fuzz case loads weights
    engine = PolicyEngine.from_pretrained(model_dir, device="cpu", dtype="float32").start()
    handle = serve_in_thread(engine, "127.0.0.1", 0, api_token="agent-token", log_level="error",
                             weights_admin=WeightsAdmin("admin-token", weights_dir))
    try:
        reports = [fuzz_http.fuzz_policy_server(handle.port, engine.model_name, plan["fuzz_policy"], "agent-token"),
                   fuzz_http.fuzz_weights_route(handle.port, plan["fuzz_weights"], "admin-token", "agent-token",
                                                weights_dir)]
        config = GatewayConfig(served_model_name="policy", api_token="gateway-token", upstream_api_key="agent-token",
                               log_level="error")  # uvicorn's line per request its parser refuses
        with start_gateway(config, [handle.url]) as gateway:
            reports.append(fuzz_http.fuzz_gateway(gateway.port, plan["fuzz_gateway"], "gateway-token"))
        auth = {"Authorization": "Bearer agent-token"}
        models = fuzz_http.still_answers(f"{handle.url}/v1/models", auth)
        reports.append(fuzz_http.fuzz_slow_clients("policy-server", handle.port, plan["fuzz_slow"],
                                                   "/v1/chat/completions", auth["Authorization"], models, False, 0.0))
        return reports
    finally:
        handle.stop()
        engine.stop()


def run_runner_bridge(figures: Figures, plan: dict) -> None:
    for agents in plan["agents"]:
        result = faults.runner_bridge_round(agents)
        figures.line(f"runner<->bridge at {agents} concurrent agents: rollouts lost {result.lost} of"
                     f" {result.attempts} (client errors {len(result.client_errors)}, retries {result.retries})",
                     bad=result.lost != 0 or bool(result.client_errors))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="small numbers (CI)")
    parser.add_argument("--fuzz-cases", type=int, default=None,
                        help="total fuzz cases, split over the targets as FUZZ_SHARES says")
    parser.add_argument("--only", choices=("spans", "faults", "fuzz", "bridge"), action="append",
                        help="run only these sections (repeatable)")
    args = parser.parse_args(argv)
    plan = dict(SHORT if args.short else FULL)
    if args.fuzz_cases is not None:
        for key, share in FUZZ_SHARES.items():
            plan[key] = args.fuzz_cases * share // 100 if plan[key] else 0
    logging.basicConfig(level=logging.ERROR)  # exporters' retry warnings are expected here
    figures = Figures()
    sections = set(args.only or ("spans", "faults", "fuzz", "bridge"))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spanrl-reliability-") as tmp:
        folder = Path(tmp)
        print(f"bench/reliability.py ({plan['form']} form)", flush=True)
        if "spans" in sections:
            run_spans(figures, folder, plan)
        if "faults" in sections:
            run_faults(figures, folder, plan)
        if "fuzz" in sections:
            run_fuzz(figures, folder, plan)
        if "bridge" in sections:
            run_runner_bridge(figures, plan)
    figures.line(f"result: {'FAILED' if figures.failed else 'ok'} in {time.monotonic() - started:.0f} s")
    return 1 if figures.failed else 0


if __name__ == "__main__":
    sys.exit(main())
