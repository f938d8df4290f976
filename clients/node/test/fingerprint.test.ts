// The fingerprint is SHA-256 of RFC 8785 canonical JSON (or of the bytes), so that any client
// that follows the RFC computes the same one for the same request.
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { test } from 'node:test';

import { CanonicalJsonError, fingerprintOf } from '../src';

const sha256 = (text: string | Buffer) => createHash('sha256').update(text).digest();

test('objects are fingerprinted by their canonical JSON: sorted keys, no spaces, shortest numbers', () => {
  assert.deepEqual(
    fingerprintOf({ currency: 'EUR', amount: 42.0, items: [{ sku: 'a', qty: 1e2 }] }),
    sha256('{"amount":42,"currency":"EUR","items":[{"qty":100,"sku":"a"}]}'),
  );
  assert.notDeepEqual(fingerprintOf({ amount: 42 }), fingerprintOf({ amount: 43 }));
});

test('bytes are fingerprinted as they are', () => {
  const body = Buffer.from('{"b":1, "a":2}');
  assert.deepEqual(fingerprintOf(body), sha256(body));
  assert.equal(fingerprintOf(body).length, 32);
});

test('a request that is not JSON is refused', () => {
  assert.throws(() => fingerprintOf(() => 1), CanonicalJsonError);
});
