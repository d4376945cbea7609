"""Settings of ``spanrl dashboard``: flags, ``OTEL_SPANRL_DASHBOARD_*`` variables, a YAML file.

Built by ``dashboard_cli`` through ``core/settings_loader.py`` (flag > variable > file >
default) and read by the web app (``app.py``), which keeps them on ``app.state``. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spanrl.errors import SettingError

ENV_PREFIX_NAME = "DASHBOARD"  # OTEL_SPANRL_DASHBOARD_<FIELD>


def _setting(default: Any, help_text: str, **more: Any) -> Any:
    return field(default=default, metadata={"help": help_text, **more})


@dataclass
class DashboardSettings:
    store: str = _setting("spanrl.db", "span store to read (the receiver's --db; opened read-only)")
    output_dir: str = _setting("runs/spanrl", "the training run's output_dir (metrics.jsonl, checkpoints/)")
    host: str = _setting("127.0.0.1", "address to bind (loopback unless told otherwise)")
    port: int = _setting(8300, "HTTP port (0 picks a free one)")
    token: str | None = _setting(
        None, "token a browser must give once (?token=...; then a cookie) or send as 'Authorization: Bearer"
        " TOKEN'; none = no check", secret=True)
    tokenizer: str | None = _setting(
        None, "folder with tokenizer.json to decode token ids; none = the newest checkpoint's under output_dir")
    refresh_s: float = _setting(2.0, "how often an open run page asks for new steps, seconds")
    page_size: int = _setting(50, "rollouts per page")

    def __post_init__(self) -> None:
        if self.refresh_s <= 0:
            raise SettingError(f"refresh_s must be positive, got {self.refresh_s!r}")
        if not 1 <= self.page_size <= 1000:
            raise SettingError(f"page_size must be between 1 and 1000, got {self.page_size!r}")
        if not 0 <= self.port <= 65535:
            raise SettingError(f"port must be between 0 and 65535, got {self.port!r}")
