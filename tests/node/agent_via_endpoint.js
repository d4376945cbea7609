// A Node.js agent that trains through the policy endpoint's own spans: the `openai` npm package
// and a plain node:http call, traced only by the OTel Node SDK's generic HTTP instrumentations
// (undici for fetch, which the openai package uses; http for node:http). No spanrl code: the
// rollout is a `spanrl.rollout` span whose identity travels as W3C baggage with the traceparent.
// Usage: node agent_via_endpoint.js <otlp-grpc-endpoint> <openai-base-url> <model> <rollout-id>
// Prints the replies' texts as one JSON list and exits 0 when every export succeeded.
'use strict';

const api = require('@opentelemetry/api');
const { TracerProvider, SimpleSpanProcessor } = require('@opentelemetry/sdk-trace');
const { resourceFromAttributes } = require('@opentelemetry/resources');
const { CompositePropagator, W3CBaggagePropagator, W3CTraceContextPropagator, ExportResultCode } =
  require('@opentelemetry/core');
const { AsyncLocalStorageContextManager } = require('@opentelemetry/context-async-hooks');
const { registerInstrumentations } = require('@opentelemetry/instrumentation');
const { HttpInstrumentation } = require('@opentelemetry/instrumentation-http');
const { UndiciInstrumentation } = require('@opentelemetry/instrumentation-undici');
const { OTLPTraceExporter } = require('@opentelemetry/exporter-trace-otlp-grpc');

const [otlpEndpoint, baseUrl, model, rolloutId] = process.argv.slice(2);

const inner = new OTLPTraceExporter({ url: otlpEndpoint });
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
  resource: resourceFromAttributes({ 'service.name': 'node-endpoint-agent' }),
  spanProcessors: [new SimpleSpanProcessor({ exporter })],
});
api.trace.setGlobalTracerProvider(provider);
api.context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
api.propagation.setGlobalPropagator(new CompositePropagator({
  propagators: [new W3CTraceContextPropagator(), new W3CBaggagePropagator()],
}));
registerInstrumentations({ instrumentations: [new HttpInstrumentation(), new UndiciInstrumentation()] });

const http = require('node:http'); // after the instrumentations: the http one patches it on load
const { OpenAI } = require('openai');

function postJson(url, body) {
  return new Promise((resolve, reject) => {
    const request = http.request(url, { method: 'POST', headers: { 'content-type': 'application/json' } },
      (response) => {
        let text = '';
        response.on('data', (piece) => { text += piece; });
        response.on('end', () => (response.statusCode === 200 ? resolve(JSON.parse(text))
          : reject(new Error(`HTTP ${response.statusCode}: ${text}`))));
      });
    request.on('error', reject);
    request.end(JSON.stringify(body));
  });
}

async function agent() {
  const client = new OpenAI({ baseURL: baseUrl, apiKey: 'unused', maxRetries: 0 });
  const replies = [];
  const reply = await client.chat.completions.create({
    model, max_tokens: 6, messages: [{ role: 'user', content: 'What is 2 + 3?' }],
  });
  replies.push(reply.choices[0].message.content);
  const stream = await client.chat.completions.create({
    model, max_tokens: 6, stream: true, messages: [{ role: 'user', content: 'What is 4 + 4?' }],
  });
  let text = '';
  for await (const chunk of stream) {
    if (chunk.choices.length) text += chunk.choices[0].delta.content || '';
  }
  replies.push(text);
  const completion = await postJson(`${baseUrl}/completions`, { model, prompt: 'CALC 1+1', max_tokens: 6 });
  replies.push(completion.choices[0].text);
  return replies;
}

async function main() {
  const tracer = provider.getTracer('node-endpoint-agent');
  const identity = { 'spanrl.rollout.id': rolloutId, 'spanrl.task.id': 'node-task', 'spanrl.attempt': 0 };
  const root = tracer.startSpan('spanrl.rollout', { attributes: identity });
  let bag = api.propagation.createBaggage();
  for (const [key, value] of Object.entries(identity)) bag = bag.setEntry(key, { value: String(value) });
  const rolloutContext = api.propagation.setBaggage(api.trace.setSpan(api.context.active(), root), bag);
  const replies = await api.context.with(rolloutContext, agent);
  root.end();
  await provider.forceFlush();
  await provider.shutdown();
  console.log(JSON.stringify(replies));
  process.exit(failures > 0 ? 1 : 0);
}

main().catch((error) => {
  console.error(error);
  process.exit(2);
});
