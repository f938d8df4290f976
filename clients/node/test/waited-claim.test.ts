// A claim that waited (docs/contract.md, "Client defaults"): when the TryStart that claimed a key
// took long, runOnce renews the lease before the work starts and counts the lease from that
// renewal. The service holds the TryStart while a holder that claimed straight from the
// coordinator keeps the key until its lease runs out; the workspace's fault-proxy between the
// client and the coordinator faults the renewal or the heartbeat after it.
import assert from 'node:assert/strict';

import { IdempotencyClient, LeaseLostError, UnavailableError, fingerprintOf, type Lease } from '../src';
import { FaultProxy } from './support/fault-proxy';
import { testOnEveryStore, until } from './support/harness';

const NAMESPACE = 'orders';
const ORDER = { orderId: 7, amount: { currency: 'EUR', cents: 500 } };
/** How long a run waits for the holder. */
const WAIT_MS = 10_000;

/** The next ExtendLease answered UNAVAILABLE without reaching the coordinator. */
const NEXT_EXTEND_UNREACHABLE = { method: 'ExtendLease', action: 'status', code: 'UNAVAILABLE', times: 1 };

/** A holder that claims `key` straight from the coordinator and dies: its lease runs out after `leaseTtlMs`. */
async function claimByACrashedHolder(client: IdempotencyClient, key: string, leaseTtlMs: number): Promise<void> {
  const outcome = await client.tryStart({
    namespace: NAMESPACE,
    key,
    fingerprint: fingerprintOf(ORDER),
    leaseTtlMs,
    attemptId: 'crashed-holder',
  });
  assert.equal(outcome.kind, 'started');
}

/** `body` with a fault-proxy in front of the test's coordinator and a client whose target is the proxy. */
async function throughAProxy(
  upstream: string,
  body: (proxy: FaultProxy, waiter: IdempotencyClient) => Promise<void>,
): Promise<void> {
  const proxy = await FaultProxy.start(upstream);
  const waiter = new IdempotencyClient(proxy.address);
  try {
    await body(proxy, waiter);
  } finally {
    waiter.close();
    await proxy.close();
  }
}

async function extendLeaseCalls(proxy: FaultProxy): Promise<number> {
  return (await proxy.calls()).ExtendLease?.length ?? 0;
}

testOnEveryStore('a heartbeat that fails right after a long wait does not cancel the work', async ({ server, client }) => {
  // The wait (2 s) is longer than the lease (1.5 s): counted from the TryStart's sending, the
  // lease has run out before the work starts, and the first failed heartbeat (0.5 s in) would
  // cancel the work. Counted from the renewal's sending, 1 s of it is left then.
  await claimByACrashedHolder(client, 'order-waited-heartbeat', 2_000);
  await throughAProxy(server.address, async (proxy, waiter) => {
    const seen: { extendsBeforeTheWork?: number; cancelled?: boolean } = {};
    const work = async (lease: Lease) => {
      seen.extendsBeforeTheWork = await extendLeaseCalls(proxy);
      await proxy.fault(NEXT_EXTEND_UNREACHABLE);
      // A heartbeat that failed without losing the lease is sent again at the next beat: the
      // third ExtendLease (after the renewal and the failed beat) says the client went on.
      await until(async () => lease.signal.aborted || (await extendLeaseCalls(proxy)) >= 3);
      seen.cancelled = lease.signal.aborted;
      return 'shipped';
    };

    const result = await waiter.runOnce(NAMESPACE, 'order-waited-heartbeat', work, {
      request: ORDER,
      leaseTtlMs: 1_500,
      waitMs: WAIT_MS,
    });

    assert.deepEqual(result, { value: 'shipped', replayed: false });
    // The renewal came before the work started; the heartbeat after it failed while the work
    // ran, and the work went on uncancelled.
    assert.deepEqual(seen, { extendsBeforeTheWork: 1, cancelled: false });
    const state = await client.lookup(NAMESPACE, 'order-waited-heartbeat');
    assert.ok(state.kind === 'completed' && state.response.toString() === '"shipped"', `the key is ${state.kind}`);
  });
});

for (const refusal of [
  { code: 'ABORTED', reason: 'LEASE_LOST' },
  { code: 'NOT_FOUND', reason: 'KEY_NOT_FOUND' },
]) {
  testOnEveryStore(`a renewal after a long wait refused ${refusal.reason} is a lost lease and the work does not run`, async ({ server, client }) => {
    const key = `order-waited-${refusal.reason}`;
    await claimByACrashedHolder(client, key, 500);
    await throughAProxy(server.address, async (proxy, waiter) => {
      await proxy.fault({ method: 'ExtendLease', action: 'status', times: 1, ...refusal });
      let ran = false;

      const error = await waiter
        .runOnce(NAMESPACE, key, () => (ran = true), { request: ORDER, leaseTtlMs: 2_000, waitMs: WAIT_MS })
        .then(() => assert.fail('expected LeaseLostError'), (caught: unknown) => caught);

      assert.ok(error instanceof LeaseLostError, `got ${String(error)}`);
      assert.equal(ran, false, 'the work ran');
      const calls = await proxy.calls();
      assert.equal(calls.ExtendLease?.length, 1, JSON.stringify(calls));
      // Nothing released: the key is no longer this caller's to give up.
      assert.equal(calls.Release, undefined, JSON.stringify(calls));
      assert.equal(calls.Complete, undefined, JSON.stringify(calls));
    });
  });
}

testOnEveryStore('a renewal that cannot get through is retried within the lease, then the key is released', async ({ server, client }) => {
  // The wait (0.5 s) leaves 1.5 s of the 2 s lease for the renewal's retries, far less than the
  // retry budget (30 s): the lease, counted from the TryStart's sending, bounds them.
  const key = 'order-waited-unreachable';
  await claimByACrashedHolder(client, key, 500);
  await throughAProxy(server.address, async (proxy, waiter) => {
    await proxy.fault({ ...NEXT_EXTEND_UNREACHABLE, times: -1 });
    let ran = false;

    const began = performance.now();
    const error = await waiter
      .runOnce(NAMESPACE, key, () => (ran = true), { request: ORDER, leaseTtlMs: 2_000, waitMs: WAIT_MS })
      .then(() => assert.fail('expected UnavailableError'), (caught: unknown) => caught);
    const elapsedMs = performance.now() - began;

    assert.ok(error instanceof UnavailableError, `got ${String(error)}`);
    assert.equal(ran, false, 'the work ran');
    const calls = await proxy.calls();
    assert.ok((calls.ExtendLease?.length ?? 0) >= 2, `the renewal was not retried: ${JSON.stringify(calls)}`);
    assert.ok(elapsedMs < 10_000, `the renewal was retried past its lease: ${elapsedMs.toFixed(0)} ms`);
    // Released, so that a retry need not wait for the lease to run out.
    assert.equal(calls.Release?.length, 1, JSON.stringify(calls));
    assert.equal((await client.lookup(NAMESPACE, key)).kind, 'absent');
  });
});
