"""TLS for the receiver's two ports: the gRPC server credentials and the HTTP SSL context.

Used by ``server.py`` when ``ReceiverSettings.tls_cert``/``tls_key`` are set (both ports then
speak TLS only; a plaintext client is refused by the handshake). Both are built from the same
PEM files, read once at start-up, so a bad file fails ``spanrl receive`` before it serves.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc


class TlsSetupError(OSError):
    """The certificate or key cannot be read or do not form a usable pair; the message says which."""


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsSetupError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN" not in data:
        raise TlsSetupError(f"the TLS {what} {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def http_ssl_context(cert_path: str, key_path: str) -> ssl.SSLContext:
    """A server-side context (TLS 1.2+) holding the certificate chain and its key."""
    _read(cert_path, "certificate")
    _read(key_path, "key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_path, key_path)
    except ssl.SSLError as exc:
        raise TlsSetupError(
            f"the TLS certificate {cert_path} and key {key_path} do not load as a pair: {exc.reason or exc}"
        ) from exc
    return context


def grpc_server_credentials(cert_path: str, key_path: str) -> grpc.ServerCredentials:
    # grpcio only checks the pair when the port is added; http_ssl_context has checked it first.
    return grpc.ssl_server_credentials([(_read(key_path, "key"), _read(cert_path, "certificate"))])
