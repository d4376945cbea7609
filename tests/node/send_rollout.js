// A foreign OTLP client for the spanrl receiver tests: the Node.js OpenTelemetry SDK sends one
// agent rollout (root span, two LLM calls with int-array token ids, a reward event).
// Usage: node send_rollout.js <grpc|http-json> <endpoint> <rollout-id> [gzip]
// Prints "exported" and exits 0 when the exporter reported success.
'use strict';

const { TracerProvider, SimpleSpanProcessor } = require('@opentelemetry/sdk-trace');
const { resourceFromAttributes } = require('@opentelemetry/resources');
const { ExportResultCode } = require('@opentelemetry/core');
const api = require('@opentelemetry/api');

const [protocol, endpoint, rolloutId, compression] = process.argv.slice(2);

function makeExporter() {
  const options = { url: endpoint, compression: compression === 'gzip' ? 'gzip' : 'none' };
  if (protocol === 'grpc') {
    const { OTLPTraceExporter } = require('@opentelemetry/exporter-trace-otlp-grpc');
    return new OTLPTraceExporter(options);
  }
  if (protocol === 'http-json') {
    const { OTLPTraceExporter } = require('@opentelemetry/exporter-trace-otlp-http');
    return new OTLPTraceExporter(options);
  }
  throw new Error(`unknown protocol ${protocol}`);
}

// Wrap the exporter to learn whether every export succeeded.
const inner = makeExporter();
let failures = 0;
const exporter = {
  export(spans, done) {
    inner.export(spans, (result) => {
      if (result.code !== ExportResultCode.SUCCESS) {
        failures += 1;
        console.error('export failed:', result.error && result.error.message);
      }
      done(result);
    });
  },
  shutdown: () => inner.shutdown(),
  forceFlush: () => (inner.forceFlush ? inner.forceFlush() : Promise.resolve()),
};

const provider = new TracerProvider({
  resource: resourceFromAttributes({ 'service.name': 'node-agent' }),
  spanProcessors: [new SimpleSpanProcessor({ exporter })],
});
const tracer = provider.getTracer('node-agent');

const identity = {
  'spanrl.rollout.id': rolloutId,
  'spanrl.task.id': 'node-task',
  'spanrl.attempt': 1,
};

const root = tracer.startSpan('spanrl.rollout', { attributes: identity });
const rootContext = api.trace.setSpan(api.context.active(), root);
for (let i = 0; i < 2; i += 1) {
  const call = tracer.startSpan(
    `node-llm-${i}`,
    {
      attributes: {
        ...identity,
        'openinference.span.kind': 'LLM',
        'spanrl.llm.prompt_token_ids': [100 + i, 2147483647, 0, 7],
        'spanrl.llm.response.0.token_ids': [200 + i, 1],
        'spanrl.llm.response.0.logprobs': [-0.125, -1.5],
        'spanrl.llm.policy_version': 4,
      },
    },
    rootContext,
  );
  call.end();
}
root.setAttribute('spanrl.variable.language', 'javascript');
root.addEvent('spanrl.reward', { 'spanrl.reward.value': 0.75, 'spanrl.reward.name': 'judge' });
root.end();

provider
  .forceFlush()
  .then(() => provider.shutdown())
  .then(() => {
    if (failures > 0) {
      process.exit(1);
    }
    console.log('exported');
    process.exit(0);
  })
  .catch((error) => {
    console.error(error);
    process.exit(2);
  });
