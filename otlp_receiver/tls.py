"""TLS for the receiver's two ports: the gRPC server credentials and the HTTP SSL context.

Used by ``server.py`` when ``ReceiverSettings.tls_cert``/``tls_key`` are set (both ports then
speak TLS only; a plaintext client is refused by the handshake). Both are built from the same
PEM files, read once at start-up, so a bad file fails ``spanrl receive`` before it serves. The
SSL context is the one every spanrl server uses (``spanrl.server_security``).
"""

from __future__ import annotations

import grpc

from spanrl.server_security import TlsSetupError, read_pem
from spanrl.server_security import server_ssl_context as http_ssl_context

__all__ = ["TlsSetupError", "grpc_server_credentials", "http_ssl_context"]


def grpc_server_credentials(cert_path: str, key_path: str) -> grpc.ServerCredentials:
    # grpcio only checks the pair when the port is added; http_ssl_context has checked it first.
    return grpc.ssl_server_credentials([(read_pem(key_path, "key"), read_pem(cert_path, "certificate"))])
