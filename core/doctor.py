"""``spanrl doctor``: check that an environment can train, and say what to fix.

Registered by ``core/cli.py``; run it where the agent runs (the same Python environment).
Checks, in order: the versions of spanrl, openai, the OTel API/SDK/instrumentation, the OTLP
exporters and protobuf; whether the OTel SDK can start (``exporter/telemetry_status.py``: the
imports its start-up makes) and is not disabled; the entry points ``opentelemetry-instrument``
loads (spanrl's instrumentor and hooks, a distro and a configurator) are registered and load,
and spanrl's instrumentor is not skipped for a dependency conflict; the receiver's OTLP port
answers and a test span goes through it (exported with the real OTLP exporter and acknowledged,
which the receiver does only once it is stored; the span carries no rollout id, so it never
becomes training data); the policy endpoint answers ``GET /models``. Each line is ``ok``,
``warn`` or ``FAIL`` with what to do; the exit status is 1 when anything failed, else 0.
Imports nothing heavy at module level (``spanrl --help`` loads it).
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from spanrl.settings_loader import CommandSettings, setting

DEFAULT_RECEIVER = {"grpc": "http://127.0.0.1:4317", "http/protobuf": "http://127.0.0.1:4318"}
DEFAULT_POLICY_URL = "http://127.0.0.1:8000/v1"
TEST_SPAN_NAME = "spanrl.doctor"
# (distribution, what it is for, required)
PACKAGES = (
    ("spanrl", "this package", True),
    ("openai", "the OpenAI SDK spanrl instruments (agents on other clients can skip it)", False),
    ("opentelemetry-api", "OTel API", True),
    ("opentelemetry-sdk", "OTel SDK", True),
    ("opentelemetry-instrumentation", "opentelemetry-instrument", True),
    ("opentelemetry-distro", "sets up the SDK under opentelemetry-instrument", True),
    ("opentelemetry-exporter-otlp-proto-grpc", "OTLP/gRPC exporter", False),
    ("opentelemetry-exporter-otlp-proto-http", "OTLP/HTTP exporter", False),
    ("protobuf", "what the OTLP exporters encode with", True),
    ("openinference-instrumentation-openai", "the LLM span spanrl adds token ids to", True),
)
SPANRL_ENTRY_POINTS = (
    ("opentelemetry_instrumentor", "spanrl_openai"),
    ("opentelemetry_pre_instrument", "spanrl"),
    ("opentelemetry_post_instrument", "spanrl"),
    ("opentelemetry_environment_variables", "spanrl"),
)




@dataclass(frozen=True)
class DoctorSettings:
    receiver: str | None = setting(
        None, "the receiver's OTLP endpoint (default: OTEL_EXPORTER_OTLP_ENDPOINT, else 127.0.0.1:4317 for gRPC, "
        ":4318 for HTTP)")
    protocol: str | None = setting(
        None, "grpc or http/protobuf (default: OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)")
    policy_url: str | None = setting(
        None, "the policy endpoint's base URL (default: OPENAI_BASE_URL, else http://127.0.0.1:8000/v1)")
    token: str | None = setting(
        None, "the receiver's bearer token (default: OTEL_SPANRL_RECEIVER_TOKEN)", secret=True)
    timeout_s: float = setting(5.0, "how long each network check may take, seconds")


SETTINGS = CommandSettings("doctor", DoctorSettings, "DOCTOR")


@dataclass(frozen=True)
class Finding:
    """One check's outcome: ``status`` is ok, warn or FAIL; ``fix`` says what to do when not ok."""

    status: str
    check: str
    detail: str
    fix: str = ""

    def lines(self) -> str:
        text = f"{self.status:<4} {self.check}: {self.detail}"
        return f"{text}\n     fix: {self.fix}" if self.fix else text


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("doctor", help="check this environment (versions, entry points, receiver, "
                                                  "endpoint, a test span) and say what to fix")
    SETTINGS.add_to(parser)
    parser.set_defaults(func=_doctor)


def _doctor(settings: DoctorSettings) -> int:
    findings = run_checks(settings)
    for finding in findings:
        print(finding.lines(), flush=True)
    failed = sum(1 for f in findings if f.status == "FAIL")
    print(f"{failed} problem(s) to fix" if failed else "everything needed to train from this environment works")
    return 1 if failed else 0


def run_checks(settings: DoctorSettings) -> list[Finding]:
    protocol = settings.protocol or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    findings = [_versions(protocol), *_sdk(), *_entry_points()]
    receiver = settings.receiver or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_RECEIVER.get(
        protocol, DEFAULT_RECEIVER["grpc"])
    reachable = _reachable(receiver, protocol, settings.timeout_s)
    findings.append(reachable)
    if reachable.status == "ok":
        findings.append(_test_span(receiver, protocol, settings))
    findings.append(_policy_endpoint(settings.policy_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_POLICY_URL,
                                     settings.timeout_s))
    return findings


def _versions(protocol: str) -> Finding:
    from importlib.metadata import PackageNotFoundError, version

    found, missing = [], []
    for name, role, required in PACKAGES:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            needed = required or name.endswith("grpc") and protocol == "grpc" or (
                name.endswith("http") and protocol.startswith("http"))
            if needed:
                missing.append(f"{name} ({role})")
    if missing:
        return Finding("FAIL", "versions", "missing: " + ", ".join(missing) + "; found: " + ", ".join(found),
                       "pip install " + " ".join(m.split(" ")[0] for m in missing))
    return Finding("ok", "versions", ", ".join(found))


def _sdk() -> list[Finding]:
    from spanrl.exporter import telemetry_status

    if telemetry_status.sdk_disabled():
        return [Finding("FAIL", "OTel SDK", "OTEL_SDK_DISABLED=true: agents here send no span",
                        "unset OTEL_SDK_DISABLED (or set it to false) where the agent runs")]
    problem = telemetry_status.sdk_start_problem()
    if problem is not None:
        return [Finding("FAIL", "OTel SDK", f"would fail to start: {problem}", telemetry_status._sdk_fix(problem))]
    return [Finding("ok", "OTel SDK", "starts (its distro, configurator and span exporter load)")]


def _entry_points() -> list[Finding]:
    from importlib.metadata import entry_points

    from spanrl.exporter import telemetry_status

    findings = []
    for group, name in SPANRL_ENTRY_POINTS:
        matches = list(entry_points(group=group, name=name))
        if not matches:
            findings.append(Finding("FAIL", f"entry point {group}:{name}", "not registered",
                                    "reinstall spanrl in this environment (pip install --force-reinstall spanrl)"))
            continue
        try:
            matches[0].load()
        except Exception as exc:  # noqa: BLE001 - reported, whatever it is
            findings.append(Finding("FAIL", f"entry point {group}:{name}", f"fails to load: {type(exc).__name__}: "
                                    f"{exc}", "reinstall spanrl and its dependencies in this environment"))
            continue
        findings.append(Finding("ok", f"entry point {group}:{name}", matches[0].value))
    for group, package in (("opentelemetry_distro", "opentelemetry-distro"),
                           ("opentelemetry_configurator", "opentelemetry-distro")):
        names = [ep.name for ep in entry_points(group=group)]
        if names:
            findings.append(Finding("ok", f"entry point {group}", ", ".join(names)))
        else:
            findings.append(Finding("FAIL", f"entry point {group}", "none registered: opentelemetry-instrument "
                                    "would set up no SDK", f"pip install {package}"))
    problem = telemetry_status.instrumentor_problem()
    if problem is None:
        findings.append(Finding("ok", "spanrl instrumentor", "opentelemetry-instrument will load it"))
    elif "no installed version was found" in problem:
        findings.append(Finding("warn", "spanrl instrumentor", problem,
                                "pip install openai, or rely on the policy endpoint's own spans"))
    else:
        findings.append(Finding("FAIL", "spanrl instrumentor", f"skipped: {problem}",
                                "install a version in the range named, or remove it from "
                                "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"))
    return findings


def _host_port(url: str, protocol: str) -> tuple[str, int]:
    parsed = urlparse(url if "://" in url else f"http://{url}")
    default = 4317 if protocol == "grpc" else 4318
    return parsed.hostname or "127.0.0.1", parsed.port or default


def _reachable(receiver: str, protocol: str, timeout_s: float) -> Finding:
    host, port = _host_port(receiver, protocol)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        return Finding("FAIL", "receiver", f"{receiver} ({protocol}) does not answer: {exc}",
                       "start `spanrl receive`, or point OTEL_EXPORTER_OTLP_ENDPOINT (or --receiver) at it")
    return Finding("ok", "receiver", f"{receiver} ({protocol}) answers")


def _test_span(receiver: str, protocol: str, settings: DoctorSettings) -> Finding:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from spanrl.exporter.in_process import headers_with_token, span_exporter

    headers = {"authorization": f"Bearer {settings.token}"} if settings.token else None
    exporter = span_exporter(receiver, protocol, headers_with_token(headers), timeout_s=settings.timeout_s)
    results: list[SpanExportResult] = []

    class Recording(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            results.append(exporter.export(spans))
            return results[-1]

        def shutdown(self) -> None:
            exporter.shutdown()

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Recording()))
    try:
        provider.get_tracer(__name__).start_span(TEST_SPAN_NAME).end()  # no rollout id: never training data
    finally:
        provider.shutdown()
    if results == [SpanExportResult.SUCCESS]:
        return Finding("ok", "test span", "exported over OTLP and acknowledged (the receiver stored it)")
    return Finding("FAIL", "test span", f"the receiver did not acknowledge it ({protocol})",
                   "check the receiver's token (OTEL_SPANRL_RECEIVER_TOKEN or --token) and the protocol "
                   "(OTEL_EXPORTER_OTLP_PROTOCOL or --protocol: grpc on 4317, http/protobuf on 4318)")


def _policy_endpoint(base_url: str, timeout_s: float) -> Finding:
    url = base_url.rstrip("/") + "/models"
    request = urllib.request.Request(url)
    api_key = os.environ.get("OPENAI_API_KEY")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = json.loads(response.read() or b"{}")
            version = response.headers.get("x-spanrl-policy-version")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return Finding("FAIL", "policy endpoint", f"GET {url} failed: {reason}",
                       "start `spanrl serve` (or `spanrl train`), or point OPENAI_BASE_URL (or --policy-url) at it")
    models = ", ".join(str(m.get("id")) for m in body.get("data", []) if isinstance(m, dict)) or "no model"
    if version is None:
        return Finding("warn", "policy endpoint", f"{base_url} serves {models} but is not spanrl's server or "
                       "gateway", "make sure it returns token ids (vLLM: return_token_ids) or emits its own spans")
    return Finding("ok", "policy endpoint", f"{base_url} serves {models} (policy version {version})")


__all__ = ["DoctorSettings", "Finding", "SETTINGS", "add_parser", "run_checks"]
