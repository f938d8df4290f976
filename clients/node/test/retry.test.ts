// A TryStart whose answer never arrives is retried with the same attempt_id, so the claim it
// made is recovered rather than orphaned: the work runs once, as attempt 1.
import assert from 'node:assert/strict';
import * as grpc from '@grpc/grpc-js';

import { IdempotencyClient } from '../src';
import { testOnEveryStore, until } from './support/harness';
import { AnswerWithholdingProxy } from './support/proxy';
import { TryStartRecorder } from './support/recorder';

testOnEveryStore('coordinator stopped and restarted during runOnce: TryStart is retried with one attempt_id, one claim, one run', async ({ server, newClient }) => {
  const recorder = new TryStartRecorder();
  const client = newClient({ channelOptions: { interceptors: [recorder.interceptor] } });
  await client.lookup('orders', 'order-77'); // connected before the outage

  await server.stop();
  let runs = 0;
  const running = client.runOnce('orders', 'order-77', async (lease) => {
    runs += 1;
    return { attempt: lease.attempt };
  });
  await recorder.until((calls) => calls.some((call) => call.code === grpc.status.UNAVAILABLE));
  await server.restart();
  const result = await running;

  assert.deepEqual(result, { value: { attempt: 1 }, replayed: false });
  assert.equal(runs, 1);
  assert.ok(recorder.calls.length >= 2, `TryStart was retried (${recorder.calls.length} calls)`);
  assert.equal(new Set(recorder.calls.map((call) => call.attemptId)).size, 1, 'every try carried the same attempt_id');
  assert.equal(recorder.calls.at(-1)?.code, grpc.status.OK);

  // The store kept the result across another restart: a new call replays it.
  await server.stop();
  await server.restart();
  const replay = await client.runOnce('orders', 'order-77', () => assert.fail('the work must not run again'));
  assert.deepEqual(replay, { value: { attempt: 1 }, replayed: true });
});

testOnEveryStore('a TryStart whose answer was lost is retried with its attempt_id and gets its own claim back', async ({ server, client: observer }) => {
  const proxy = await AnswerWithholdingProxy.start(server.address);
  const recorder = new TryStartRecorder();
  const client = new IdempotencyClient(proxy.address, {
    callTimeoutMs: 500,
    channelOptions: { interceptors: [recorder.interceptor] },
  });
  try {
    await client.lookup('orders', 'order-88'); // connected through the proxy

    proxy.withholdAnswers();
    let runs = 0;
    const running = client.runOnce(
      'orders',
      'order-88',
      async (lease) => {
        runs += 1;
        return { attempt: lease.attempt };
      },
      // A lease far longer than the test: getting the key back cannot be a takeover.
      { leaseTtlMs: 60_000 },
    );
    // The first TryStart reached the coordinator and claimed the key; its answer is lost.
    await until(async () => (await observer.lookup('orders', 'order-88')).kind === 'inProgress');
    await recorder.until((calls) => calls.some((call) => call.code === grpc.status.DEADLINE_EXCEEDED));
    proxy.cutAndRestore();
    const result = await running;

    assert.deepEqual(result, { value: { attempt: 1 }, replayed: false }, 'the claim came back as attempt 1');
    assert.equal(runs, 1);
    assert.ok(recorder.calls.length >= 2);
    assert.equal(new Set(recorder.calls.map((call) => call.attemptId)).size, 1);
    const state = await observer.lookup('orders', 'order-88');
    assert.equal(state.kind, 'completed');
  } finally {
    client.close();
    await proxy.close();
  }
});

testOnEveryStore('a Complete whose answer was lost is retried and counts: the caller gets its result, the work ran once', async ({ server, client: observer }) => {
  const proxy = await AnswerWithholdingProxy.start(server.address);
  const client = new IdempotencyClient(proxy.address, { callTimeoutMs: 500 });
  try {
    let runs = 0;
    const running = client.runOnce('orders', 'order-99', async () => {
      runs += 1;
      // The claim's answer has arrived; the next answer, Complete's, is lost.
      proxy.withholdAnswers();
      return { shipped: true };
    });
    await until(async () => (await observer.lookup('orders', 'order-99')).kind === 'completed');
    proxy.cutAndRestore();
    assert.deepEqual(await running, { value: { shipped: true }, replayed: false });
    assert.equal(runs, 1);
  } finally {
    client.close();
    await proxy.close();
  }
});
