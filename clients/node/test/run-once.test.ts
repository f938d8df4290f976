// runOnce against the real coordinator, on both stores: one run per key, replay, release on
// failure, heartbeats, lost leases.
import assert from 'node:assert/strict';

import { InProgressError, LeaseLostError, type IdempotencyClient, type Lease, type RunOnceResult } from '../src';
import { deferred, delay, testOnEveryStore, type StoreContext } from './support/harness';
import { TryStartRecorder } from './support/recorder';

/** A runOnce whose work holds `key` until `finish` is called, and then returns `value`. */
async function holdKey(
  client: IdempotencyClient,
  key: string,
  value: string,
): Promise<{ first: Promise<RunOnceResult<string>>; finish: () => void }> {
  const holding = deferred();
  const finished = deferred();
  const first = client.runOnce('payments', key, async () => {
    holding.resolve();
    await finished.promise;
    return value;
  });
  await holding.promise;
  return { first, finish: () => finished.resolve() };
}

/**
 * A second caller of a held `key`, allowed to wait `waitMs`, that is expected to give up: its
 * error, how long it took, and the TryStarts it sent.
 */
async function waitForHeldKey(
  newClient: StoreContext<unknown>['newClient'],
  key: string,
  waitMs: number,
): Promise<{ error: unknown; waited: number; tryStarts: number }> {
  const recorder = new TryStartRecorder();
  const askedAt = Date.now();
  const error = await newClient({ channelOptions: { interceptors: [recorder.interceptor] } })
    .runOnce('payments', key, () => assert.fail('the work must not run twice'), { waitMs })
    .then(() => assert.fail('expected InProgressError'), (caught: unknown) => caught);
  return { error, waited: Date.now() - askedAt, tryStarts: recorder.calls.length };
}

testOnEveryStore('concurrent runOnce with one key: the work runs once and every caller gets its result', async ({ client, newClient }) => {
  const callers = [client, newClient(), newClient(), newClient()];
  let runs = 0;
  const work = async () => {
    runs += 1;
    // Long enough that the other callers find the key in progress and wait for it.
    await delay(300);
    return { charge: `ch_${runs}`, amount: 4200 };
  };
  const results = await Promise.all(
    callers.map((caller) =>
      caller.runOnce('payments', 'order-1:charge', work, { request: { amount: 4200 }, waitMs: 10_000 }),
    ),
  );
  assert.equal(runs, 1);
  for (const result of results) assert.deepEqual(result.value, { charge: 'ch_1', amount: 4200 });
  assert.equal(results.filter((result) => !result.replayed).length, 1, 'exactly one caller ran the work');
  const state = await client.lookup('payments', 'order-1:charge');
  assert.equal(state.kind, 'completed');
});

testOnEveryStore('a caller that may not wait is told when to retry', async ({ client, newClient }) => {
  const holder = await holdKey(client, 'order-2', 'done');
  const error = await newClient()
    .runOnce('payments', 'order-2', () => assert.fail('the work must not run twice'))
    .then(() => assert.fail('expected InProgressError'), (caught: unknown) => caught);
  assert.ok(error instanceof InProgressError, `got ${String(error)}`);
  assert.equal(error.attempt, 1);
  assert.ok(error.leaseExpiresAt.getTime() > Date.now(), 'the holder lease runs in the future');
  assert.ok(error.retryAfterSeconds >= 1);
  holder.finish();
  assert.deepEqual(await holder.first, { value: 'done', replayed: false });
});

testOnEveryStore('a caller with a wait gets the holder result right after it finishes, from one TryStart held by the service', async ({ client, newClient }) => {
  const holder = await holdKey(client, 'order-wait', 'ch_wait');
  const recorder = new TryStartRecorder();
  let answered = false;
  const second = newClient({ channelOptions: { interceptors: [recorder.interceptor] } })
    .runOnce('payments', 'order-wait', () => assert.fail('the work must not run twice'), { waitMs: 20_000 })
    .finally(() => {
      answered = true;
    });
  await recorder.until((calls) => calls.length >= 1);
  // While the holder holds, the waiting caller is not answered: its TryStart waits on the service.
  await delay(500);
  assert.equal(answered, false, 'the second caller waits while the holder holds');
  holder.finish();
  const finishedAt = Date.now();
  assert.deepEqual(await holder.first, { value: 'ch_wait', replayed: false });
  assert.deepEqual(await second, { value: 'ch_wait', replayed: true });
  assert.ok(Date.now() - finishedAt < 3_000, `answered ${Date.now() - finishedAt} ms after the holder finished`);
  assert.equal(recorder.calls.length, 1, 'one TryStart, held by the service, instead of polls');
});

testOnEveryStore('a wait that runs out is an InProgressError after about the caller limit, from one TryStart', async ({ client, newClient }) => {
  const holder = await holdKey(client, 'order-wait-out', 'done');
  const { error, waited, tryStarts } = await waitForHeldKey(newClient, 'order-wait-out', 1_500);
  assert.ok(error instanceof InProgressError, `got ${String(error)}`);
  assert.equal(error.attempt, 1);
  assert.ok(waited >= 1_200 && waited < 4_000, `gave up after ${waited} ms`);
  assert.equal(tryStarts, 1, 'one TryStart, held by the service for the whole limit');
  holder.finish();
  assert.deepEqual(await holder.first, { value: 'done', replayed: false });
});

testOnEveryStore(
  'a service at its waiter limit is asked again after pauses, not hammered',
  async ({ client, newClient }) => {
    const holder = await holdKey(client, 'order-no-waiters', 'done');
    const { error, waited, tryStarts } = await waitForHeldKey(newClient, 'order-no-waiters', 1_500);
    assert.ok(error instanceof InProgressError, `got ${String(error)}`);
    assert.ok(waited >= 1_400, `gave up after ${waited} ms`);
    // Asked again while the limit lasted, but after pauses (100 ms growing to 1 s): a handful of
    // TryStarts, not one per round trip.
    assert.ok(tryStarts >= 3 && tryStarts <= 20, `${tryStarts} TryStarts in ${waited} ms`);
    holder.finish();
    assert.deepEqual(await holder.first, { value: 'done', replayed: false });
  },
  // With no waiter slots, every TryStart is answered at once, as without `wait`.
  async () => ({ serverOptions: { extraArgs: ['--max-waiters', '0'] }, fixture: undefined }),
);

testOnEveryStore('work that throws releases the key, and the next runOnce runs the work again', async ({ client }) => {
  let runs = 0;
  const failure = new Error('the card network timed out');
  await assert.rejects(
    client.runOnce('payments', 'order-3', async () => {
      runs += 1;
      throw failure;
    }),
    (error) => error === failure,
  );
  assert.deepEqual(await client.lookup('payments', 'order-3'), { kind: 'absent' });
  const second = await client.runOnce('payments', 'order-3', async () => {
    runs += 1;
    return 'charged';
  });
  assert.deepEqual(second, { value: 'charged', replayed: false });
  assert.equal(runs, 2);
});

testOnEveryStore('errorAsResult stores a final failure, which is replayed without running the work', async ({ client }) => {
  class HttpError extends Error {
    constructor(readonly status: number) {
      super(`HTTP ${status}`);
    }
  }
  const asStoredAnswer = (error: unknown) =>
    error instanceof HttpError && error.status < 500 ? { status: error.status } : undefined;
  let runs = 0;
  const work = async (): Promise<{ status: number }> => {
    runs += 1;
    throw new HttpError(402);
  };
  const first = await client.runOnce('payments', 'order-4', work, { errorAsResult: asStoredAnswer });
  const second = await client.runOnce('payments', 'order-4', work, { errorAsResult: asStoredAnswer });
  assert.deepEqual(first, { value: { status: 402 }, replayed: false });
  assert.deepEqual(second, { value: { status: 402 }, replayed: true });
  assert.equal(runs, 1);
});

testOnEveryStore('work three times longer than its lease stays the only holder and completes', async ({ client, newClient }) => {
  const leaseTtlMs = 600;
  const rival = newClient();
  const rivalAnswers: string[] = [];
  const result = await client.runOnce(
    'reports',
    'monthly-2026-11',
    async (lease) => {
      // Every probe comes after the first lease would have run out without a heartbeat, when a
      // rival's TryStart would take the key over.
      for (let probe = 0; probe < 3; probe += 1) {
        await delay(leaseTtlMs);
        const answer = await rival.tryStart({ namespace: 'reports', key: 'monthly-2026-11', leaseTtlMs, attemptId: 'rival' });
        rivalAnswers.push(answer.kind);
        assert.equal(lease.signal.aborted, false);
      }
      return `report by attempt ${lease.attempt}`;
    },
    { leaseTtlMs },
  );
  assert.deepEqual(rivalAnswers, ['inProgress', 'inProgress', 'inProgress']);
  assert.deepEqual(result, { value: 'report by attempt 1', replayed: false });
});

testOnEveryStore('a lease taken over mid-work aborts the work, runOnce throws lease lost, the new holder result stands', async ({ client, newClient }) => {
  const leaseTtlMs = 300;
  const workSawAbort = deferred<unknown>();
  const firstHolds = deferred();
  let firstLease: Lease | undefined;
  // The heartbeat comes only after the lease has run out, so that a rival can take over first.
  const first = client.runOnce(
    'shipments',
    'parcel-9',
    async (lease) => {
      firstLease = lease;
      firstHolds.resolve();
      await new Promise((_, reject) => {
        lease.signal.addEventListener('abort', () => {
          workSawAbort.resolve(lease.signal.reason);
          reject(lease.signal.reason);
        });
      });
      return 'first holder';
    },
    { leaseTtlMs, heartbeatIntervalMs: 3_000 },
  );
  const firstOutcome = first.then(
    () => assert.fail('the first holder must not complete'),
    (error: unknown) => error,
  );
  await firstHolds.promise;
  const second = await newClient().runOnce(
    'shipments',
    'parcel-9',
    async (lease) => `second holder, attempt ${lease.attempt}`,
    { leaseTtlMs: 30_000, waitMs: 10_000 },
  );
  assert.deepEqual(second, { value: 'second holder, attempt 2', replayed: false });

  const error = await firstOutcome;
  assert.ok(error instanceof LeaseLostError, `got ${String(error)}`);
  assert.equal(error.reason, 'LEASE_LOST');
  assert.equal(await workSawAbort.promise, error, 'the work signal aborted with the lease-lost error');
  assert.equal(firstLease?.attempt, 1);

  const state = await client.lookup('shipments', 'parcel-9');
  assert.equal(state.kind, 'completed');
  assert.equal(state.kind === 'completed' && state.response.toString('utf8'), JSON.stringify('second holder, attempt 2'));
});

testOnEveryStore('a checkpoint saved by a holder is handed to the one that takes over', async ({ client, newClient }) => {
  const saved = deferred();
  const abandoned = client.runOnce(
    'imports',
    'batch-7',
    async (lease) => {
      await lease.saveCheckpoint(Buffer.from('row-500'));
      saved.resolve();
      await new Promise((_, reject) => lease.signal.addEventListener('abort', () => reject(lease.signal.reason)));
    },
    // The lease is short and never extended, as if this holder had stalled.
    { leaseTtlMs: 300, heartbeatIntervalMs: 0 },
  );
  abandoned.catch(() => undefined);
  await saved.promise;
  const resumed = await newClient().runOnce(
    'imports',
    'batch-7',
    async (lease) => ({ attempt: lease.attempt, resumedFrom: lease.checkpoint?.toString('utf8') }),
    { waitMs: 10_000 },
  );
  assert.deepEqual(resumed.value, { attempt: 2, resumedFrom: 'row-500' });
});
