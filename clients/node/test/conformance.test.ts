// The vectors and defaults in clients/conformance, which every client passes: the canonical
// form and fingerprint of JSON texts, the defaults table, a lease that ran out while the
// coordinator was unreachable, and a result that could not be stored.
import assert from 'node:assert/strict';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { test } from 'node:test';
import * as grpc from '@grpc/grpc-js';

import {
  CanonicalJsonError,
  CoordinatorError,
  DEFAULTS,
  OverloadedError,
  RateLimitedError,
  errorFromStatus,
  isRefusedAtTheDoor,
  isTransient,
  LeaseLostError,
  ResultNotStoredError,
  UnavailableError,
  canonicalJson,
  canonicalJsonText,
  fingerprintOf,
  fingerprintOfJson,
  type KeyState,
} from '../src';
import { Backoff } from '../src/backoff';
import { testOnEveryStore, until } from './support/harness';

const CONFORMANCE = path.resolve(__dirname, '..', '..', '..', 'conformance');
const load = (name: string): unknown => JSON.parse(fs.readFileSync(path.join(CONFORMANCE, name), 'utf8'));

interface Vector {
  name: string;
  input: string;
  canonical?: string;
  sha256?: string;
  error?: string;
}

const { cases } = load('fingerprints.json') as { cases: Vector[] };

for (const vector of cases) {
  test(`fingerprint vector: ${vector.name}`, () => {
    if (vector.error !== undefined) {
      assert.throws(
        () => fingerprintOfJson(vector.input),
        (error) => error instanceof CanonicalJsonError && error.reason === vector.error,
      );
      return;
    }
    assert.equal(canonicalJsonText(vector.input), vector.canonical);
    assert.equal(fingerprintOfJson(vector.input).toString('hex'), vector.sha256);
    // The value JSON.parse reads from an accepted text has the same fingerprint.
    assert.equal(fingerprintOf(JSON.parse(vector.input)).toString('hex'), vector.sha256);
  });
}

test('values JSON cannot carry exactly are refused, and doubles are written as ECMAScript does', () => {
  const refused = (value: unknown, reason: string) =>
    assert.throws(
      () => fingerprintOf(value),
      (error) => error instanceof CanonicalJsonError && error.reason === reason,
      `${String(value)}: ${reason}`,
    );
  refused(1n, 'unsafe_integer');
  refused({ amount: 2n ** 64n }, 'unsafe_integer');
  refused(Number.NaN, 'number_out_of_range');
  refused([Number.POSITIVE_INFINITY], 'number_out_of_range');
  refused('\ud800', 'lone_surrogate');
  refused({ '\udc00': 1 }, 'lone_surrogate');
  refused(() => 1, 'not_json');
  // A JS number is a double already: beyond 2^53 it is accepted as it is.
  assert.equal(canonicalJson(2 ** 53), '9007199254740992');
  assert.equal(canonicalJson([1e21, -0, 1e-7, { b: undefined, a: new Date(0) }]), '[1e+21,0,1e-7,{"a":"1970-01-01T00:00:00.000Z"}]');
  assert.notDeepEqual(fingerprintOf('\u00e9'), fingerprintOf('e\u0301'));
});

test('the defaults are the conformance table', () => {
  assert.deepEqual(load('defaults.json'), {
    call_timeout_ms: DEFAULTS.callTimeoutMs,
    retry: {
      budget_ms: DEFAULTS.retry.budgetMs,
      initial_backoff_ms: DEFAULTS.retry.initialBackoffMs,
      max_backoff_ms: DEFAULTS.retry.maxBackoffMs,
      multiplier: DEFAULTS.retry.multiplier,
      jitter_low_fraction: DEFAULTS.retry.jitterLowFraction,
    },
    lease_ttl_ms: DEFAULTS.leaseTtlMs,
    heartbeat_divisor: DEFAULTS.heartbeatDivisor,
    wait_ms: DEFAULTS.waitMs,
  });
  // The pauses: each between the low fraction of its step and the whole step, the steps
  // growing by the multiplier up to the largest.
  const { initialBackoffMs, maxBackoffMs, multiplier, jitterLowFraction } = DEFAULTS.retry;
  const backoff = new Backoff({ initialMs: initialBackoffMs, maxMs: maxBackoffMs, multiplier });
  let step: number = initialBackoffMs;
  for (let i = 0; i < 10; i += 1) {
    const pause = backoff.nextDelayMs();
    assert.ok(pause >= step * jitterLowFraction && pause <= step, `pause ${pause} for step ${step}`);
    step = Math.min(maxBackoffMs, step * multiplier);
  }
  // A RetryInfo makes a pause longer, never shorter.
  assert.equal(backoff.nextDelayMs(5_000), 5_000);
});

test('refusals at the door are retried, and RESOURCE_EXHAUSTED without a reason is not', () => {
  const details = { reason: undefined, fieldViolations: [], retryDelayMs: 300 };
  for (const refused of [
    new RateLimitedError('refused', grpc.status.RESOURCE_EXHAUSTED, { ...details, reason: 'RATE_LIMITED' }),
    new OverloadedError('refused', grpc.status.RESOURCE_EXHAUSTED, { ...details, reason: 'OVERLOADED' }),
  ]) {
    assert.ok(isTransient(refused) && isRefusedAtTheDoor(refused), refused.name);
  }
  const bare = errorFromStatus(
    Object.assign(new Error('message too large'), {
      code: grpc.status.RESOURCE_EXHAUSTED,
      details: 'message too large',
      metadata: new grpc.Metadata(),
    }),
  );
  assert.equal(bare.constructor, CoordinatorError);
  assert.ok(!isTransient(bare) && !isRefusedAtTheDoor(bare));
  const unreachable = errorFromStatus(
    Object.assign(new Error('down'), { code: grpc.status.UNAVAILABLE, details: 'down', metadata: new grpc.Metadata() }),
  );
  assert.ok(isTransient(unreachable) && !isRefusedAtTheDoor(unreachable));
});

testOnEveryStore(
  'a lease that may have run out while the coordinator was unreachable cancels the work: LeaseLostError',
  async ({ server, newClient }) => {
    const client = newClient({ retry: { totalMs: 500 } });
    let aborted: unknown;
    const running = client.runOnce(
      'orders',
      'order-lapsed',
      async (lease) => {
        await server.stop();
        await new Promise((resolve) => lease.signal.addEventListener('abort', resolve, { once: true }));
        aborted = lease.signal.reason;
        return 'too late';
      },
      { leaseTtlMs: 1_500, heartbeatIntervalMs: 300 },
    );
    const error: unknown = await running.catch((thrown: unknown) => thrown);

    assert.ok(error instanceof LeaseLostError, `got ${String(error)}`);
    assert.ok(error.cause instanceof UnavailableError, `caused by ${String(error.cause)}`);
    assert.equal(aborted, error);
  },
);

testOnEveryStore(
  'a result the coordinator could not store is thrown with the result: ResultNotStoredError',
  async ({ server, newClient }) => {
    const client = newClient({ retry: { totalMs: 1_000 } });
    const running = client.runOnce(
      'orders',
      'order-unstored',
      async () => {
        await server.stop();
        return { charge: 'ch_1' };
      },
      { heartbeatIntervalMs: 0 },
    );
    const error: unknown = await running.catch((thrown: unknown) => thrown);

    assert.ok(error instanceof ResultNotStoredError, `got ${String(error)}`);
    assert.deepEqual(error.result, { charge: 'ch_1' });
    assert.ok(error.cause instanceof UnavailableError);
    // Only the result was lost: the claim is still held, and nothing is stored.
    await server.restart();
    let state: KeyState | undefined;
    // (grpc-js shares the connection, which is backing off from the outage: ask until it is up.)
    await until(async () => {
      state = await client.lookup('orders', 'order-unstored').catch(() => undefined);
      return state !== undefined;
    });
    assert.equal(state?.kind, 'inProgress');
  },
);
