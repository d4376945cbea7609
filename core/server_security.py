"""Who may call a spanrl server, said the same way by all of them: a bearer token compared as
bytes, TLS from a PEM certificate and key (``tls_cert``/``tls_key``), and one start-up warning
when a server can be reached from other machines without a token, or with its token in plain
HTTP.

Used by the receiver (``otlp_receiver/export_service.py``, ``tls.py``, ``server.py``), the
bridge API (``trainer_bridge/bridge_api.py``), the policy server (``torch_backend/server/``)
and the verl gateway. Stdlib only: the torch-free policy front end and the receiver import it.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
import ssl
from pathlib import Path

__all__ = ["TlsSetupError", "agent_token_matches", "bearer_token_matches", "check_tls_pair", "is_loopback", "read_pem",
           "server_ssl_context", "warn_if_exposed"]

BEARER = b"Bearer "


def _raw_bytes(value: str | bytes) -> bytes:
    """A header's bytes as they came: HTTP servers decode headers as latin-1, so encoding back
    to latin-1 restores them; any other text (gRPC metadata) is taken as UTF-8."""
    if isinstance(value, bytes):
        return value
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogatepass")


def bearer_token_matches(header: str | bytes | None, token: str) -> bool:
    """Whether an ``Authorization`` header is ``Bearer <token>``, in constant time.

    Compared as bytes, so a header with non-ASCII characters is a wrong token (a 401), never a
    ``TypeError`` (``hmac.compare_digest`` refuses non-ASCII ``str``)."""
    if header is None:
        return False
    return hmac.compare_digest(_raw_bytes(header).strip(), BEARER + token.encode("utf-8"))


def agent_token_matches(authorization: str | bytes | None, api_key: str | bytes | None, token: str) -> bool:
    """Whether a request carries ``token``: as ``Authorization: Bearer <token>`` (OpenAI's
    clients) or as ``x-api-key: <token>`` (Anthropic's), each compared in constant time."""
    if bearer_token_matches(authorization, token):
        return True
    return api_key is not None and hmac.compare_digest(_raw_bytes(api_key).strip(), token.encode("utf-8"))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is reachable from this machine only."""
    name = host.strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a host name: loopback if every address it resolves to is
        try:
            addresses = {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
        except OSError:
            return False
        return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def warn_if_exposed(server: str, host: str, token: bool, tls: bool, logger: logging.Logger,
                    settings_hint: str = "") -> str | None:
    """Log one warning when ``server`` listens on ``host`` beyond loopback without a token, or
    with a token but no TLS (anyone on the network path reads it). Returns the warning, or None.

    ``settings_hint`` names the settings that fix it (e.g. "--token, --tls-cert/--tls-key")."""
    if is_loopback(host):
        return None
    hint = f" ({settings_hint})" if settings_hint else ""
    if not token:
        message = (f"{server} listens on {host}, reachable from other machines, without a token: anyone who "
                   f"can reach it can use it; set a token and TLS{hint}, or bind 127.0.0.1")
    elif not tls:
        message = (f"{server} listens on {host}, reachable from other machines, and its token travels in plain "
                   f"HTTP where anyone on the network path can read it; set TLS{hint}")
    else:
        return None
    logger.warning("%s", message)
    return message


class TlsSetupError(OSError):
    """The certificate or key cannot be read or do not form a usable pair; the message says which."""


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file (``what``: "certificate" or "key"); ``TlsSetupError`` otherwise."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsSetupError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN" not in data:
        raise TlsSetupError(f"the TLS {what} {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def server_ssl_context(cert_path: str, key_path: str) -> ssl.SSLContext:
    """A server-side context (TLS 1.2+) holding the certificate chain and its key, both read
    now, so a bad file fails a server's start rather than its first client."""
    read_pem(cert_path, "certificate")
    read_pem(key_path, "key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_path, key_path)
    except ssl.SSLError as exc:
        raise TlsSetupError(
            f"the TLS certificate {cert_path} and key {key_path} do not load as a pair: {exc.reason or exc}"
        ) from exc
    return context


def check_tls_pair(cert_path: str | None, key_path: str | None, what: str) -> bool:
    """Whether TLS is on (both files given, and they load as a pair); ``TlsSetupError`` when only
    one is given or they do not load. ``what`` names the settings in the message."""
    if (cert_path is None) != (key_path is None):
        raise TlsSetupError(f"{what}: TLS needs both a certificate and a key (PEM files); give both or neither")
    if cert_path is None or key_path is None:
        return False
    server_ssl_context(cert_path, key_path)
    return True
