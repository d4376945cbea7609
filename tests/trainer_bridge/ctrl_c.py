"""Children that take Ctrl-C as in a terminal, for the tests that send them SIGINT.

A shell's background job (`cmd &`, as CI may launch the tests) inherits SIGINT ignored, and Python
then installs no KeyboardInterrupt handler at all. ``as_in_a_terminal`` starts a command through a
small Python shim that restores SIGINT's default and execs the command (a signal's default survives
exec); no ``preexec_fn``, which runs Python between fork and exec in this threaded test process and
can crash the child.
"""

from __future__ import annotations

import sys

_SHIM = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


def as_in_a_terminal(argv: list[str]) -> list[str]:
    """``argv`` (its first item an executable's path) started with SIGINT at its default."""
    return [sys.executable, "-c", _SHIM, *argv]
