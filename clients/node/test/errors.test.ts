// Every refusal reaches the caller as the typed error of its reason, and changes nothing.
import assert from 'node:assert/strict';

import {
  AlreadyCompletedError,
  FingerprintMismatchError,
  InvalidArgumentError,
  KeyNotFoundError,
  LeaseLostError,
  PermissionDeniedError,
  RateLimitedError,
  UnauthenticatedError,
} from '../src';
import { testOnEveryStore } from './support/harness';
import { CoordinatorServer } from './support/server';

const mustNotRun = () => assert.fail('the work must not run');

testOnEveryStore('a key reused for a different request is a FingerprintMismatchError; the same request in another key order replays', async ({ client }) => {
  const first = await client.runOnce('payments', 'order-5', async () => 'charged 42', {
    request: { amount: 42, currency: 'EUR', items: [{ sku: 'a', qty: 1 }] },
  });
  assert.deepEqual(first, { value: 'charged 42', replayed: false });

  await assert.rejects(
    client.runOnce('payments', 'order-5', mustNotRun, { request: { amount: 43, currency: 'EUR', items: [{ sku: 'a', qty: 1 }] } }),
    FingerprintMismatchError,
  );
  const replay = await client.runOnce('payments', 'order-5', mustNotRun, {
    request: { items: [{ qty: 1, sku: 'a' }], currency: 'EUR', amount: 42 },
  });
  assert.deepEqual(replay, { value: 'charged 42', replayed: true });
});

testOnEveryStore('bad input is an InvalidArgumentError naming every bad field, and nothing is claimed', async ({ client }) => {
  const error = await client
    .runOnce('pay ments', 'order-6', mustNotRun, { leaseTtlMs: 10 })
    .then(() => assert.fail('expected InvalidArgumentError'), (caught: unknown) => caught);
  assert.ok(error instanceof InvalidArgumentError, `got ${String(error)}`);
  assert.equal(error.reason, 'INVALID_ARGUMENT');
  assert.deepEqual(error.fields.sort(), ['lease_ttl', 'namespace']);
  assert.ok(error.fieldViolations.every((violation) => violation.description.length > 0));

  const badEvent = await client
    .markProcessed('billing', ['evt-1', 'evt\u0007bell'])
    .then(() => assert.fail('expected InvalidArgumentError'), (caught: unknown) => caught);
  assert.ok(badEvent instanceof InvalidArgumentError);
  assert.deepEqual(badEvent.fields, ['event_ids[1]']);
  // The batch is atomic: the good id was not recorded either.
  assert.deepEqual((await client.markProcessed('billing', ['evt-1'])).newEventIds, ['evt-1']);
});

testOnEveryStore('Complete, Release and ExtendLease refusals are KeyNotFound, LeaseLost and AlreadyCompleted', async ({ client }) => {
  await assert.rejects(client.complete('payments', 'never-claimed', 1n, Buffer.from('x')), KeyNotFoundError);

  const first = await client.tryStart({ namespace: 'payments', key: 'order-8', leaseTtlMs: 100 });
  assert.equal(first.kind, 'started');
  const firstToken = first.kind === 'started' ? first.leaseToken : 0n;
  // Once the short lease has run out, another caller takes the key over.
  let second = await client.tryStart({ namespace: 'payments', key: 'order-8' });
  while (second.kind === 'inProgress') {
    await new Promise((resolve) => setTimeout(resolve, 50));
    second = await client.tryStart({ namespace: 'payments', key: 'order-8' });
  }
  assert.equal(second.kind, 'started');
  const secondToken = second.kind === 'started' ? second.leaseToken : 0n;
  assert.ok(secondToken > firstToken, 'fencing tokens increase');

  const lost = await client
    .complete('payments', 'order-8', firstToken, Buffer.from('late'))
    .then(() => assert.fail('expected LeaseLostError'), (caught: unknown) => caught);
  assert.ok(lost instanceof LeaseLostError);
  assert.equal(lost.reason, 'LEASE_LOST');

  await client.complete('payments', 'order-8', secondToken, Buffer.from('done'));
  await assert.rejects(client.release('payments', 'order-8', secondToken), AlreadyCompletedError);
  await assert.rejects(client.extendLease('payments', 'order-8', secondToken), AlreadyCompletedError);
  const state = await client.lookup('payments', 'order-8');
  assert.equal(state.kind === 'completed' && state.response.toString(), 'done');
});

testOnEveryStore(
  'with a tokens file: the right token works, another scope is PermissionDenied, no token is Unauthenticated',
  async ({ newClient, fixture: { token } }) => {
    const orders = newClient({ token });
    const result = await orders.runOnce('orders-eu', 'order-9', async () => 'shipped');
    assert.deepEqual(result, { value: 'shipped', replayed: false });

    const denied = await orders
      .runOnce('payments', 'order-9', mustNotRun)
      .then(() => assert.fail('expected PermissionDeniedError'), (caught: unknown) => caught);
    assert.ok(denied instanceof PermissionDeniedError, `got ${String(denied)}`);
    assert.equal(denied.reason, 'PERMISSION_DENIED');

    await assert.rejects(newClient().runOnce('orders-eu', 'order-10', mustNotRun), UnauthenticatedError);
    await assert.rejects(newClient({ token: 'idc_not-a-token' }).lookup('orders-eu', 'order-9'), UnauthenticatedError);
    // The refused calls wrote nothing.
    assert.deepEqual(await orders.lookup('orders-eu', 'order-10'), { kind: 'absent' });
  },
  async () => {
    const issued = await CoordinatorServer.newToken('orders', 'orders-*');
    const tokensFile = await CoordinatorServer.tempFile('tokens', `${issued.line}\n`);
    return { serverOptions: { tokensFile: tokensFile.file }, fixture: { token: issued.token }, cleanup: tokensFile.remove };
  },
);

testOnEveryStore(
  'over the rate limit: a call is a RateLimitedError with the server retry delay, and runOnce waits it out',
  async ({ newClient, fixture: { token } }) => {
    const client = newClient({ token });
    // Two requests a second: the claim and the completion use them up.
    assert.deepEqual(await client.runOnce('orders-1', 'order-rl', async () => 'first'), { value: 'first', replayed: false });
    // A burst of five more within a moment: the bucket cannot hold them all.
    const burst = await Promise.allSettled(Array.from({ length: 5 }, () => client.lookup('orders-1', 'order-rl')));
    const limited = burst.find((outcome) => outcome.status === 'rejected')?.reason as unknown;
    assert.ok(limited instanceof RateLimitedError, `got ${String(limited)}`);
    assert.equal(limited.reason, 'RATE_LIMITED');
    assert.ok((limited.retryDelayMs ?? 0) > 0, 'RetryInfo says when to retry');

    let runs = 0;
    const second = await client.runOnce('orders-1', 'order-rl-2', async () => {
      runs += 1;
      return 'second';
    });
    assert.deepEqual(second, { value: 'second', replayed: false });
    assert.equal(runs, 1);
  },
  async () => {
    const issued = await CoordinatorServer.newToken('orders', 'orders-*');
    const tokensFile = await CoordinatorServer.tempFile('tokens', `${issued.line}\n`);
    return {
      serverOptions: { tokensFile: tokensFile.file, extraArgs: ['--rate-limit', '2'] },
      fixture: { token: issued.token },
      cleanup: tokensFile.remove,
    };
  },
);
