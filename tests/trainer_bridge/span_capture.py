"""The embedded policy server's app served from a thread, its endpoint spans kept in memory: for
tests that read what the endpoint's own spans say (``trainer_bridge/endpoint_spans.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@contextmanager
def serving_with_span_capture(engine: Any, **app_options: Any) -> Iterator[tuple[str, InMemorySpanExporter]]:
    """Serve ``engine`` (already started) on a free loopback port; yields its ``/v1`` base URL and
    the exporter holding the endpoint's spans, every call's span exported once the block ends."""
    import uvicorn

    from spanrl.trainer_bridge.endpoint_spans import EndpointSpans
    from spanrl.trainer_bridge.torch_backend.server.app import create_app

    exported = InMemorySpanExporter()
    spans = EndpointSpans(exported, schedule_delay_ms=10)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, spans=spans, **app_options), host="127.0.0.1",
                                           port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}/v1", exported
    finally:
        server.should_exit = True
        thread.join(10)
        spans.flush()
        spans.shutdown()
