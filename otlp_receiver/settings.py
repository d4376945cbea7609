"""The receiver's settings: CLI flags, then ``OTEL_SPANRL_RECEIVER_*`` variables, a YAML file, defaults.

Built by ``receive_cli`` through ``core/settings_loader.py`` (and by tests and the server
directly as a dataclass). Every field ``x`` can be set by the flag ``--x`` and the variable
``OTEL_SPANRL_RECEIVER_<X>``, e.g. ``OTEL_SPANRL_RECEIVER_TOKEN`` (the prefix is RECEIVER, as the
agent-side exporter reads the same token variable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spanrl.errors import SettingError
from spanrl.settings_loader import setting

ENV_PREFIX_NAME = "RECEIVER"  # OTEL_SPANRL_RECEIVER_<FIELD>
SYNC_MODES = ("full", "normal", "extra")
CREDIT_MODES = ("identical", "discounted")
# What the receiver does with a reward event whose value lies outside [reward_min, reward_max].
OUT_OF_RANGE_MODES = ("reject", "clip")
REWARD_MIN_DEFAULT = -100.0
REWARD_MAX_DEFAULT = 100.0
FEEDBACK_TTL_S_DEFAULT = 7 * 24 * 3600.0  # 7 days
FEEDBACK_MAX_PENDING_DEFAULT = 100_000


@dataclass
class ReceiverSettings:
    host: str = setting("127.0.0.1", "address both servers bind (loopback unless told otherwise)")
    grpc_port: int = setting(4317, "OTLP/gRPC port (0 picks a free one)")
    http_port: int = setting(4318, "OTLP/HTTP port (0 picks a free one)")
    db: str = setting("spanrl.db", "span store path (SQLite)")
    token: str | None = setting(
        None, "bearer token clients must send (Authorization: Bearer TOKEN); none = no check", secret=True)
    max_message_mb: float = setting(64.0, "largest accepted request, MiB (after decompression)")
    max_pending_mb: float = setting(
        256.0, "requests waiting for the store above this size are refused as overload, MiB")
    retry_after_s: float = setting(1.0, "retry delay suggested to clients on overload, seconds")
    sync: str = setting(
        "full", "SQLite synchronous mode: full (survives power loss), normal (survives kill -9) or extra")
    grace_s: float = setting(2.0, "after a rollout ends, wait this long without new spans before assembling it")
    idle_timeout_s: float = setting(600.0, "assemble a rollout that got no span for this long (0 = never)")
    complete_on_rollout_span: bool = setting(True, "the spanrl.rollout span ending completes its rollout")
    credit: str = setting("identical", "credit assignment: identical or discounted")
    gamma: float = setting(1.0, "discount of the discounted credit assignment")
    air_rules: str = setting("off", "AIR rules: off, default, or a JSON/YAML rules file")
    reward_min: float = setting(
        REWARD_MIN_DEFAULT, "smallest reward value an agent's reward event may carry (see reward_out_of_range)")
    reward_max: float = setting(REWARD_MAX_DEFAULT, "largest reward value an agent's reward event may carry")
    reward_out_of_range: str = setting(
        "reject", "a reward value outside [reward_min, reward_max]: reject (drop the event) or clip (to the range);"
        " counted in the rollout's counters either way")
    evaluation_rewards: bool = setting(
        False, "count gen_ai.evaluation.result events as rewards (off: only spanrl.reward events count)")
    feedback_ttl_s: float = setting(
        FEEDBACK_TTL_S_DEFAULT, "late feedback whose rollout, trace, span or response id is not (yet) assembled waits"
        " this long for it, then is dropped and counted (expired), seconds")
    feedback_max_pending: int = setting(
        FEEDBACK_MAX_PENDING_DEFAULT,
        "at most this many feedback wait for their target; past it the oldest are dropped (evicted)")
    retokenize_with: str | None = setting(None, "tokenizer directory allowed to rebuild missing token ids (flagged)")
    tls_cert: str | None = setting(
        None, "PEM certificate (chain) file: serve both ports over TLS (with --tls-key); none = plaintext")
    tls_key: str | None = setting(None, "PEM private key file of --tls-cert")
    workers: int = setting(16, "gRPC worker threads")
    max_concurrent_rpcs: int = setting(
        1024, "gRPC calls running or waiting at once; more are refused with RESOURCE_EXHAUSTED (exporters retry)")
    read_timeout_s: float = setting(
        30.0, "OTLP/HTTP: a client silent this long mid-request or between requests loses its connection, seconds")
    poll_s: float = setting(0.2, "how often the assembler looks for ended rollouts, seconds")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * 1024 * 1024)

    @property
    def max_pending_bytes(self) -> int:
        return int(self.max_pending_mb * 1024 * 1024)

    def validate(self) -> ReceiverSettings:
        if self.sync not in SYNC_MODES:
            raise SettingError(f"sync must be full, normal or extra, got {self.sync!r}")
        if self.credit not in CREDIT_MODES:
            raise SettingError(f"credit must be identical or discounted, got {self.credit!r}")
        if self.reward_out_of_range not in OUT_OF_RANGE_MODES:
            raise SettingError(f"reward_out_of_range must be reject or clip, got {self.reward_out_of_range!r}")
        if not (math.isfinite(self.reward_min) and math.isfinite(self.reward_max)
                and self.reward_min < self.reward_max):
            raise SettingError(f"reward_min and reward_max must be finite numbers with reward_min < reward_max,"
                               f" got {self.reward_min!r} and {self.reward_max!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingError("TLS needs both tls_cert and tls_key (PEM files); give both or neither")
        for name in ("max_message_mb", "max_pending_mb", "workers", "poll_s", "max_concurrent_rpcs", "read_timeout_s",
                     "feedback_ttl_s", "feedback_max_pending"):
            if getattr(self, name) <= 0:
                raise SettingError(f"{name} must be positive, got {getattr(self, name)!r}")
        return self
