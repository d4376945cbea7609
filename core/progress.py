"""Progress of long work that a person can read: a bar on a terminal, plain lines in a log.

Called by the training loop (``trainer_bridge/training_loop.py``: one step a tick) and SFT
(``trainer_bridge/torch_backend/sft.py``), and by ``cli.main`` (``quiet_library_bars``). A
progress bar redraws itself many times a second; written to a file or a pipe every redraw is
kept (a demo's log grew to 380 KB of them). So ``progress_bar`` draws a tqdm bar only when its
stream is a terminal; otherwise it writes one plain line every ``interval_s`` seconds (default
30, variable ``OTEL_SPANRL_PROGRESS_INTERVAL_S``) and one at the end, e.g.
``spanrl train: 12/50 step (24%), 3m05s, reward=0.42, version=12``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

INTERVAL_ENV = "OTEL_SPANRL_PROGRESS_INTERVAL_S"
DEFAULT_INTERVAL_S = 30.0


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress_bar(total: int | None, desc: str, unit: str = "it", initial: int = 0, disable: bool = False,
                 stream: TextIO | None = None, interval_s: float | None = None) -> Any:
    """A tqdm bar on a terminal, else a ``PlainProgress`` with the same methods (``update``,
    ``set_postfix``, ``set_postfix_str``, ``close``)."""
    stream = stream if stream is not None else sys.stderr
    if is_terminal(stream):
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, disable=disable, desc=desc, unit=unit, dynamic_ncols=True,
                    file=stream)
    if interval_s is None:
        interval_s = float(os.environ.get(INTERVAL_ENV) or DEFAULT_INTERVAL_S)
    return PlainProgress(total, desc, unit, initial, disable, stream, interval_s)


def quiet_library_bars(stream: Any = None) -> None:
    """When ``stream`` (stderr) is not a terminal, turn off the tqdm bars of the libraries this
    process and its children use (transformers' weight loading, datasets, ...): tqdm reads
    ``TQDM_DISABLE`` for its default, and children inherit it."""
    if not is_terminal(stream if stream is not None else sys.stderr):
        os.environ.setdefault("TQDM_DISABLE", "1")


class PlainProgress:
    """Plain progress lines: one when ``interval_s`` has passed since the last (checked at each
    ``update`` or postfix change) and one at ``close``; nothing at all when ``disable``."""

    def __init__(self, total: int | None, desc: str, unit: str, initial: int, disable: bool, stream: TextIO,
                 interval_s: float):
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.disable, self.stream, self.interval_s = disable, stream, interval_s
        self.started = self.last_line = time.monotonic()
        self.postfix = ""
        self.closed = False

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def update(self, count: int = 1) -> None:
        self.n += count
        self._maybe_write()

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())
        self._maybe_write()

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text
        self._maybe_write()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.write_line()

    def _maybe_write(self) -> None:
        if time.monotonic() - self.last_line >= self.interval_s:
            self.write_line()

    def write_line(self) -> None:
        if self.disable:
            return
        self.last_line = time.monotonic()
        done = f"{self.n}/{self.total}" if self.total else str(self.n)
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        elapsed = int(self.last_line - self.started)
        line = f"{self.desc}: {done} {self.unit}{share}, {elapsed // 60}m{elapsed % 60:02d}s"
        if self.postfix:
            line += f", {self.postfix}"
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: progress is never worth a crash
            pass


__all__ = ["DEFAULT_INTERVAL_S", "INTERVAL_ENV", "PlainProgress", "is_terminal", "progress_bar",
           "quiet_library_bars"]
