// A Node.js agent exporting spans at a fixed rate through the OTel Node SDK's BatchSpanProcessor
// and OTLP exporter, for the receiver's overload test (tests/reliability, bench/reliability.py).
// Usage: node flood.js <grpc|http-json> <endpoint> <rollout-prefix> <spans-per-second> <seconds> <out.json>
// Writes one JSON object to out.json: emitted (spans ended), acked / failed ("traceId:spanId" of spans whose
// export succeeded / failed after the exporter's retries). Spans emitted but in neither list
// were dropped by the processor (its queue was full). FLOOD_DEBUG=1 prints each failed export's error.
'use strict';

const { TracerProvider, BatchSpanProcessor } = require('@opentelemetry/sdk-trace');
const { resourceFromAttributes } = require('@opentelemetry/resources');
const { ExportResultCode } = require('@opentelemetry/core');
const api = require('@opentelemetry/api');
const fs = require('fs');

const [protocol, endpoint, prefix, rateText, secondsText, outPath] = process.argv.slice(2);
const rate = Number(rateText);
const seconds = Number(secondsText);
const SPANS_PER_ROLLOUT = 10;

function makeExporter() {
  const options = { url: endpoint, timeoutMillis: 30000 };
  if (protocol === 'grpc') {
    const { OTLPTraceExporter } = require('@opentelemetry/exporter-trace-otlp-grpc');
    return new OTLPTraceExporter(options);
  }
  const { OTLPTraceExporter } = require('@opentelemetry/exporter-trace-otlp-http');
  return new OTLPTraceExporter(options);
}

const inner = makeExporter();
const acked = [];
const failed = [];
const exporter = {
  export(spans, done) {
    inner.export(spans, (result) => {
      const keys = spans.map((s) => `${s.spanContext().traceId}:${s.spanContext().spanId}`);
      (result.code === ExportResultCode.SUCCESS ? acked : failed).push(...keys);
      if (result.code !== ExportResultCode.SUCCESS && process.env.FLOOD_DEBUG) console.error("export failed:", result.error && result.error.message);
      done(result);
    });
  },
  shutdown: () => inner.shutdown(),
  forceFlush: () => (inner.forceFlush ? inner.forceFlush() : Promise.resolve()),
};

const provider = new TracerProvider({
  resource: resourceFromAttributes({ 'service.name': 'node-flood' }),
  spanProcessors: [new BatchSpanProcessor({ exporter, scheduledDelayMillis: 100, maxExportBatchSize: 256 })],
});
const tracer = provider.getTracer('node-flood');

let emitted = 0;
let rollouts = 0;

function emitRollout() {
  const identity = { 'spanrl.rollout.id': `${prefix}-${rollouts}`, 'spanrl.task.id': 'flood', 'spanrl.attempt': 0 };
  rollouts += 1;
  const root = tracer.startSpan('spanrl.rollout', { attributes: identity });
  const context = api.trace.setSpan(api.context.active(), root);
  for (let i = 0; i < SPANS_PER_ROLLOUT - 1; i += 1) {
    tracer.startSpan(`llm-${i}`, { attributes: {
      ...identity, 'spanrl.llm.prompt_token_ids': [1, 2, 3, i], 'spanrl.llm.response.0.token_ids': [4, i],
    } }, context).end();
  }
  root.addEvent('spanrl.reward', { 'spanrl.reward.value': 1.0 });
  root.end();
  emitted += SPANS_PER_ROLLOUT;
}

const started = Date.now();
function tick() {
  const elapsed = (Date.now() - started) / 1000;
  if (elapsed >= seconds) {
    finish();
    return;
  }
  while (emitted < rate * elapsed) {
    emitRollout();
  }
  setTimeout(tick, 5);
}

function finish() {
  // A failed export makes forceFlush/shutdown reject; it is counted in `failed` already.
  const ignore = (error) => console.error('flush:', error && error.message);
  provider.forceFlush()
    .catch(ignore)
    .then(() => provider.shutdown())
    .catch(ignore)
    .then(() => {
      // a file, not stdout: process.exit() does not wait for a pipe to drain
      fs.writeFileSync(outPath, JSON.stringify({ emitted, acked, failed }));
      process.exit(0);
    });
}

tick();
