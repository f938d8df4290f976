// The fingerprint of a request: SHA-256 of its bytes, or of its canonical JSON (RFC 8785,
// JSON Canonicalization Scheme) so that the same request gives the same fingerprint whatever
// the order of its object keys, in any language whose client follows clients/conformance.
import { createHash } from 'node:crypto';

import { canonicalJson, canonicalJsonText } from './canonical';

/** A request whose fingerprint runOnce computes: raw bytes, or any JSON-serialisable value. */
export type FingerprintSource = Uint8Array | unknown;

/**
 * SHA-256 (32 bytes) of `request`: of the bytes themselves for a Uint8Array (a Buffer too),
 * otherwise of its RFC 8785 canonical JSON text in UTF-8 (`canonicalJson`, which throws a
 * CanonicalJsonError for what JSON cannot carry exactly, e.g. a BigInt or NaN).
 */
export function fingerprintOf(request: FingerprintSource): Buffer {
  const hash = createHash('sha256');
  if (request instanceof Uint8Array) hash.update(request);
  else hash.update(canonicalJson(request), 'utf8');
  return hash.digest();
}

/**
 * SHA-256 (32 bytes) of the canonical form of a JSON text (`canonicalJsonText`), e.g. a request
 * body as it arrived: the fingerprint `fingerprintOf` gives the value it holds, without the
 * rounding and the lost duplicate members of JSON.parse.
 */
export function fingerprintOfJson(text: string): Buffer {
  return createHash('sha256').update(canonicalJsonText(text), 'utf8').digest();
}
