"""`spanrl serve` settings: flags, then OTEL_SPANRL_SERVE_* variables, then defaults."""

from __future__ import annotations

import argparse

import pytest

from spanrl.env_settings import SettingError
from spanrl.trainer_bridge import serve_cli


def parse(argv):
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    return serve_cli.ServeSettings.from_args(parser.parse_args(["serve", *argv]))


def test_flags_beat_environment_beats_defaults(monkeypatch):
    monkeypatch.delenv("OTEL_SPANRL_SERVE_PORT", raising=False)
    assert parse(["m"]).port == 8000 and parse(["m"]).host == "127.0.0.1"
    monkeypatch.setenv("OTEL_SPANRL_SERVE_PORT", "9100")
    monkeypatch.setenv("OTEL_SPANRL_SERVE_TOKEN", "from-env")
    settings = parse(["m"])
    assert settings.port == 9100 and settings.token == "from-env"
    assert "from-env" not in str(settings.printable())
    assert parse(["m", "--port", "9200", "--max-batch-size", "8"]).port == 9200
    monkeypatch.setenv("OTEL_SPANRL_SERVE_PORT", "eighty")
    with pytest.raises(SettingError, match="OTEL_SPANRL_SERVE_PORT"):
        parse(["m"])
