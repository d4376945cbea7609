"""The receiver's settings: CLI flags, then ``OTEL_SPANRL_RECEIVER_*`` variables, then defaults.

Built by ``receive_cli`` (and by tests, directly as a dataclass). Every field ``x`` can be set
by the environment variable ``OTEL_SPANRL_RECEIVER_<X>``, e.g. ``OTEL_SPANRL_RECEIVER_TOKEN``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from spanrl.env_settings import SettingError, env_value
from spanrl.instrumentation import semconv

ENV_PREFIX = semconv.ENV_PREFIX + "RECEIVER_"

HELP = {
    "host": "address both servers bind (loopback unless told otherwise)",
    "grpc_port": "OTLP/gRPC port (0 picks a free one)",
    "http_port": "OTLP/HTTP port (0 picks a free one)",
    "db": "span store path (SQLite)",
    "token": "bearer token clients must send (Authorization: Bearer TOKEN); none = no check",
    "max_message_mb": "largest accepted request, MiB (after decompression)",
    "max_pending_mb": "requests waiting for the store above this size are refused as overload, MiB",
    "retry_after_s": "retry delay suggested to clients on overload, seconds",
    "sync": "SQLite synchronous mode: full (survives power loss) or normal (survives kill -9)",
    "grace_s": "after a rollout ends, wait this long without new spans before assembling it",
    "idle_timeout_s": "assemble a rollout that got no span for this long (0 = never)",
    "complete_on_rollout_span": "the spanrl.rollout span ending completes its rollout",
    "credit": "credit assignment: identical or discounted",
    "gamma": "discount of the discounted credit assignment",
    "air_rules": "AIR rules: off, default, or a JSON/YAML rules file",
    "retokenize_with": "tokenizer directory allowed to rebuild missing token ids (flagged)",
    "workers": "gRPC worker threads",
    "poll_s": "how often the assembler looks for ended rollouts, seconds",
}


@dataclass
class ReceiverSettings:
    host: str = "127.0.0.1"
    grpc_port: int = 4317
    http_port: int = 4318
    db: str = "spanrl.db"
    token: str | None = None
    max_message_mb: float = 64.0
    max_pending_mb: float = 256.0
    retry_after_s: float = 1.0
    sync: str = "full"
    grace_s: float = 2.0
    idle_timeout_s: float = 600.0
    complete_on_rollout_span: bool = True
    credit: str = "identical"
    gamma: float = 1.0
    air_rules: str = "off"
    retokenize_with: str | None = None
    workers: int = 16
    poll_s: float = 0.2

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * 1024 * 1024)

    @property
    def max_pending_bytes(self) -> int:
        return int(self.max_pending_mb * 1024 * 1024)

    def validate(self) -> ReceiverSettings:
        if self.sync not in ("full", "normal", "extra"):
            raise SettingError(f"sync must be full, normal or extra, got {self.sync!r}")
        if self.credit not in ("identical", "discounted"):
            raise SettingError(f"credit must be identical or discounted, got {self.credit!r}")
        for name in ("max_message_mb", "max_pending_mb", "workers", "poll_s"):
            if getattr(self, name) <= 0:
                raise SettingError(f"{name} must be positive, got {getattr(self, name)!r}")
        return self

    def describe(self) -> str:
        """One line per setting, the token hidden, for the start-up log."""
        lines = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "token" and value:
                value = "***"
            lines.append(f"  {f.name} = {value}   ({env_name(f.name)})")
        return "\n".join(lines)


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _optional_str(text: str) -> str:
    return text


def settings_from(flags: dict[str, Any] | None = None) -> ReceiverSettings:
    """Fill settings: a flag that is not None wins, then the environment, then the default."""
    flags = flags or {}
    values: dict[str, Any] = {}
    for f in fields(ReceiverSettings):
        flag = flags.get(f.name)
        if flag is not None:
            values[f.name] = flag
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        parse = _optional_str if default is None else None
        values[f.name] = env_value(env_name(f.name), default, parse)
    return ReceiverSettings(**values).validate()
