"""The skip rule of every test run (the main suite, `.venv-verl`'s tests/verl_backend, the
frameworks' tests/frameworks: all collect this file): a skipped test fails the run unless its
reason says that this machine has no GPU, the one thing CI cannot install. A package CI installs
is imported plainly (a missing one fails the test that needs it), and a skip for any other
reason is listed under "skips that are not allowed" and turns the exit status to 1.

Folders whose environment a run lacks (tests/verl_backend without vLLM, tests/frameworks before
their venvs are built) are not collected there (``collect_ignore``), which is no skip.

Under pytest-xdist (``-n 3`` for the main suite in CI, ``-n 2`` for the verl step) each worker runs
torch on one thread, and the long folders are collected first (below).

And fixtures every test folder may use: a self-signed TLS certificate made here (``cryptography``),
for the servers that speak HTTPS from ``tls_cert``/``tls_key`` (receiver, bridge, policy
server, gateway, proxy).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re

import pytest

ALLOWED_SKIP = re.compile(r"\bno (CUDA )?GPU\b", re.IGNORECASE)  # e.g. "no GPU on this machine"

_not_allowed: list[tuple[str, str]] = []


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _check(report: pytest.CollectReport | pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        if not ALLOWED_SKIP.search(reason):
            _not_allowed.append((report.nodeid, reason))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (CI runs ``-n 3`` and ``-n 2`` on 2 cores) each worker, and every process
    it starts, runs torch and OpenMP on one thread: workers with a thread per core each oversubscribe
    the cores, and OpenMP's spinning threads then make torch several times slower."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


# Folders whose files run longest (their servers, agents and training runs): collected first, so
# that with pytest-xdist (``--dist loadfile --no-loadscope-reorder`` in pyproject) the workers
# start on them and end on short files instead of one worker finishing a long file alone.
LONG_FOLDERS_FIRST = ("tests/loop/", "tests/trainer_bridge/", "tests/verl_backend/")
# ... except this one: it needs the demo's warm model, which the worker running the async demo
# test (early in tests/loop) builds for ~90 s; collected last, it finds the model made instead of
# holding the other worker idle while it waits.
COLLECTED_LAST = ("tests/loop/test_loop_demo_short.py",)


# The verl step's files (each starts Ray, verl's workers and vLLM), in an order that splits them
# evenly over the step's two workers. xdist (``--dist loadfile``) hands a worker the next file
# whenever two or fewer of its tests are left, so each worker's share is settled early and the order
# is the split: the first worker takes the update file (two tests, ~175 + ~125 s in CI on
# 2026-12-04) and then the adapters file (~175 s); the second apo (~135) and the demo (~150), then
# every shorter file as it frees up (~65, ~65 for the three sharing one vLLM server, ~60, ~15):
# ~475 s against ~490. Longest first instead (update, adapters, apo, demo, ...) put update, apo and
# the off-policy and SFT files on one worker: ~560 s against ~400 (the 575 s verl step of that run).
# Files not named here follow, in their own order.
VERL_FILE_ORDER = tuple(f"tests/verl_backend/{name}.py" for name in (
    "test_verl_update", "test_verl_apo", "test_verl_adapters", "test_verl_demo", "test_verl_gateway_port",
    "test_avx2_emulation", "test_verl_off_policy", "test_proxy_vllm", "test_verl_gateway_structured",
    "test_vllm_live", "test_verl_sft"))


def collection_rank(nodeid: str) -> tuple[int, int]:
    """Where a test goes in the run: its folder's place in LONG_FOLDERS_FIRST, then its file's in
    VERL_FILE_ORDER; COLLECTED_LAST after everything."""
    if nodeid.startswith(COLLECTED_LAST):
        return len(LONG_FOLDERS_FIRST) + 1, 0
    folder = next((i for i, name in enumerate(LONG_FOLDERS_FIRST) if nodeid.startswith(name)), len(LONG_FOLDERS_FIRST))
    file = next((i for i, name in enumerate(VERL_FILE_ORDER) if nodeid.startswith(name)), len(VERL_FILE_ORDER))
    return folder, file


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: collection_rank(item.nodeid))  # stable: each file keeps its own order


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` (pyproject's addopts), except that the modules against a running vLLM
    (tests/verl_backend/vllm_server.py) go to one worker together: they share its session
    fixture, slow to start, which then starts once per run instead of once per worker. (xdist's
    own ``--dist loadgroup`` groups by marks, but not with pytest 9.2: it renames test ids through
    an attribute pytest no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    from tests.verl_backend.vllm_server import VLLM_MODULES

    shared = {path: "vllm-server" for path in VLLM_MODULES}

    class GroupedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return shared.get(file, file)

    return GroupedFileScheduling(config, log)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _check(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _check(report)


def pytest_terminal_summary(terminalreporter) -> None:
    if _not_allowed:
        terminalreporter.section("skips that are not allowed", red=True)
        terminalreporter.line("only a missing GPU may skip a test (its reason says 'no GPU'); install what the "
                              "others need (README, 'Tests and development')")
        for nodeid, reason in _not_allowed:
            terminalreporter.line(f"{nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _not_allowed and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def self_signed(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and localhost: (cert.pem, key.pem) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture()
def private_tracing():
    """A private SDK TracerProvider exporting to memory, with the OpenAI SDK instrumented
    (openinference + spanrl) against it; uninstrumented in teardown."""
    from types import SimpleNamespace

    from openinference.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from spanrl.instrumentation.openai_instrumentor import SpanrlOpenAIInstrumentor

    for already_on in (OpenAIInstrumentor(), SpanrlOpenAIInstrumentor()):
        assert not already_on.is_instrumented_by_opentelemetry, (
            f"{type(already_on).__name__} is already on in this process (left by another test?)"
        )
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = SpanrlOpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield SimpleNamespace(provider=provider, exporter=exporter, instrumentor=instrumentor)
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
