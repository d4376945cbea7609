"""Errors the user can fix, as opposed to bugs.

``core/cli.py`` maps a ``UserError`` raised anywhere in a command to one line on stderr
(``spanrl <command>: <message>``) and exit status 2; any other exception is a bug and shows its
traceback (exit status 1). Raise a ``UserError`` (or a subclass) only for things the user can
change: a setting, a missing file, a taken port. Stdlib only: agent-side code imports it.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for; the message says what to change."""


class SettingError(UserError):
    """A flag, environment variable or settings-file value that cannot be used."""
