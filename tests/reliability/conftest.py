"""Fixtures for the reliability suite: in-process receivers on free ports, a self-signed TLS
certificate made here (``cryptography``), and the Node.js SDK directory of ``tests/node``."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from spanrl.otlp_receiver.server import ReceiverServer
from spanrl.otlp_receiver.settings import ReceiverSettings

sys.path.insert(0, str(Path(__file__).parent))  # the suite's plain modules, shared with bench/reliability.py
from reliability_harness import ReceiverProcess, free_port, wait_for  # noqa: E402

NODE_DIR = Path(__file__).resolve().parents[1] / "node"


@pytest.fixture
def start_receiver(tmp_path):
    """Start in-process receivers on free ports (stopped at teardown)."""
    started: list[ReceiverServer] = []

    def start(**overrides) -> ReceiverServer:
        settings = ReceiverSettings(grpc_port=0, http_port=0, db=str(tmp_path / "spanrl.db"), grace_s=0.2,
                                    poll_s=0.05, idle_timeout_s=0)
        server = ReceiverServer(replace(settings, **overrides)).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


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


@pytest.fixture(scope="session")
def node():
    executable = shutil.which("node")
    assert executable, "node is not installed: the Node.js client tests need Node.js >= 18"
    assert (NODE_DIR / "node_modules" / "@opentelemetry" / "sdk-trace").is_dir(), (
        f"the Node.js OTel packages are missing: run `npm install` in {NODE_DIR} (.ci/run does)"
    )
    return executable


@pytest.fixture
def kit():
    return SimpleNamespace(wait_for=wait_for, node_dir=NODE_DIR, free_port=free_port)


@pytest.fixture
def receiver_process(tmp_path):
    made: list[ReceiverProcess] = []

    def make(*extra: str, db: Path | None = None, file_size_limit: int | None = None) -> ReceiverProcess:
        process = ReceiverProcess(db or tmp_path / "spanrl.db", *extra, file_size_limit=file_size_limit)
        made.append(process)
        return process

    yield make
    for process in made:
        process.kill()


