"""Fixtures of the dashboard tests: the app served over real HTTP (uvicorn in a thread, on a free
port, stopped after the test), and Debian's Chromium driven by Playwright. CI installs both
(.ci/run); where either is missing the browser tests fail saying what to install (only a missing
GPU may skip a test: tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from spanrl.dashboard.settings import DashboardSettings

CHROMIUM = os.environ.get("SPANRL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    """``serve(**settings) -> base URL``: a dashboard over HTTP on 127.0.0.1 for this test."""
    import uvicorn

    from spanrl.dashboard.app import create_app

    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(**fields) -> str:
        sock = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(create_app(DashboardSettings(**fields)), log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the dashboard did not start in 30 s"
            time.sleep(0.02)
        servers.append((server, thread))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    try:
        yield start
    finally:
        for server, thread in servers:
            server.should_exit = True
            thread.join(30)


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's package, never a downloaded build) through Playwright."""
    missing = _browser_missing()
    if missing:
        pytest.fail(missing)
    from playwright import sync_api

    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def _browser_missing() -> str | None:
    if shutil.which(CHROMIUM) is None:
        return f"no Chromium at {CHROMIUM} (install Debian's: apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (pip install playwright; never `playwright install`)"
    return None


@pytest.fixture
def page(browser):
    """A fresh browser page; JavaScript errors on it fail the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda error: errors.append(str(error)))
    try:
        yield tab
    finally:
        context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
