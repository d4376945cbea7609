"""Progress a person can read (``spanrl.progress``): a tqdm bar only on a terminal, plain lines
when stderr is a file or a pipe, and no library's bar redraws into a log.

The terminal is a real pseudo-terminal (``pty``); the log cases are a file and a real
``python -m spanrl`` whose stderr is a pipe.
"""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

from spanrl.progress import PlainProgress, progress_bar


def test_on_a_terminal_it_is_a_tqdm_bar():
    from tqdm import tqdm

    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as terminal:
            bar = progress_bar(10, "spanrl train", unit="step", stream=terminal)
            assert isinstance(bar, tqdm)
            bar.update(1)
            bar.close()
        assert b"\r" in os.read(leader, 4096)  # a bar redraws in place on a terminal
    finally:
        os.close(leader)
        os.close(follower)


def test_in_a_file_it_writes_a_plain_line_per_interval_and_one_at_the_end(tmp_path):
    log = tmp_path / "train.log"
    with log.open("w") as stream:
        quiet = progress_bar(50, "spanrl train", unit="step", stream=stream, interval_s=3600)
        assert isinstance(quiet, PlainProgress)
        for step in range(50):
            quiet.update(1)
            quiet.set_postfix(reward=f"{step / 50:.2f}", version=step + 1)
        quiet.close()
        every = progress_bar(3, "sft", unit="step", stream=stream, interval_s=0)
        for _ in range(3):
            every.update(1)
        every.close()
        every.close()  # a second close writes nothing
    lines = log.read_text().splitlines()
    assert "\r" not in log.read_text()
    assert lines[0].startswith("spanrl train: 50/50 step (100%), 0m") and lines[0].endswith("reward=0.98, version=50")
    assert [line.split(",")[0] for line in lines[1:]] == [
        "sft: 1/3 step (33%)", "sft: 2/3 step (67%)", "sft: 3/3 step (100%)", "sft: 3/3 step (100%)"]


def test_disabled_progress_writes_nothing():
    stream = io.StringIO()
    bar = progress_bar(5, "sft", stream=stream, disable=True, interval_s=0)
    bar.update(5)
    bar.close()
    assert stream.getvalue() == ""


def test_a_command_whose_stderr_is_a_pipe_draws_no_library_bar(tmp_path):
    """``spanrl model init`` saves weights through transformers, which draws a bar ("Writing
    model shards") on a terminal; into a pipe, nothing of it."""
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    done = subprocess.run([sys.executable, "-m", "spanrl", "model", "init", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "%|" not in done.stderr, done.stderr
