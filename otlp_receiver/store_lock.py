"""One receiver per span store: an exclusive lock held for as long as the receiver runs.

Two receivers writing the same SQLite store would each assemble the same rollouts (the second
save fails) and split the agents' spans between them. ``ReceiverServer`` takes the lock before
it opens the store and gives it back in ``stop()``; a second receiver on the same store stops
at start-up with ``StoreInUse`` naming the first one's process id. ``spanrl train`` asks
``receiver_running`` whether any receiver is writing the store it reads.

The lock is ``flock`` on the file ``<store>-receiver.lock`` beside the store: the kernel drops
it when the process dies, even by kill -9, so a crashed receiver never leaves a stale lock. On
systems without ``fcntl`` (Windows) there is no lock and no check.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .store import StoreError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on the platforms spanrl runs on
    fcntl = None  # type: ignore[assignment]

LOCK_SUFFIX = "-receiver.lock"
ACQUIRE_WAIT_S = 1.0  # a `spanrl train` probing the lock holds it for microseconds


class StoreInUse(StoreError):
    """Another receiver is writing this store."""


def lock_path(store_path: str | Path) -> Path:
    return Path(f"{os.fspath(store_path)}{LOCK_SUFFIX}")


class ReceiverLock:
    """The exclusive right to write ``store_path``; ``acquire()`` then ``release()``."""

    def __init__(self, store_path: str | Path) -> None:
        self.store_path = Path(store_path)
        self.path = lock_path(store_path)
        self._fd: int | None = None

    def acquire(self) -> ReceiverLock:
        if fcntl is None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StoreError(f"cannot create the lock file {self.path}: {exc.strerror}") from exc
        deadline = time.monotonic() + ACQUIRE_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise StoreInUse(
                        f"the span store {self.store_path} is in use by another receiver (process {holder}); "
                        "stop that receiver, or give this one another store with --db") from exc
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def receiver_running(store_path: str | Path) -> bool:
    """True when a receiver holds the lock of ``store_path`` (always True without ``fcntl``)."""
    if fcntl is None:
        return True
    try:
        fd = os.open(lock_path(store_path), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
