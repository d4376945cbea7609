"""An agent that exercises the exporter defaults (no spanrl import): one span with 300
attributes, one span under a remote parent that was not sampled, a counter and a log record.
Prints how many attributes the SDK kept on the big span."""

import logging
import time

from opentelemetry import context, metrics, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

tracer = trace.get_tracer("signals-agent")
with tracer.start_as_current_span("big") as span:
    for i in range(300):
        span.set_attribute(f"attribute.{i:03d}", i)
    kept = len(span.attributes)

unsampled_parent = SpanContext(trace_id=0x1234, span_id=0x5678, is_remote=True,
                               trace_flags=TraceFlags(TraceFlags.DEFAULT))
ctx = trace.set_span_in_context(NonRecordingSpan(unsampled_parent), context.Context())
tracer.start_span("under-unsampled-parent", context=ctx).end()

metrics.get_meter("signals-agent").create_counter("calls").add(1)
logging.getLogger("signals-agent").warning("a log record")
time.sleep(0.6)  # > OTEL_METRIC_EXPORT_INTERVAL: a periodic metrics export would happen now
print(kept)
