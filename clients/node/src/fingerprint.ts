// The fingerprint of a request: SHA-256 of its bytes, or of its canonical JSON (RFC 8785,
// JSON Canonicalization Scheme) so that the same request gives the same fingerprint whatever
// the order of its object keys, in any language that implements the RFC.
import { createHash } from 'node:crypto';

import canonicalize from 'canonicalize';

/** A request whose fingerprint runOnce computes: raw bytes, or any JSON-serialisable value. */
export type FingerprintSource = Uint8Array | unknown;

/**
 * SHA-256 (32 bytes) of `request`: of the bytes themselves for a Uint8Array (a Buffer too),
 * otherwise of its RFC 8785 canonical JSON text in UTF-8.
 */
export function fingerprintOf(request: FingerprintSource): Buffer {
  const hash = createHash('sha256');
  if (request instanceof Uint8Array) {
    hash.update(request);
  } else {
    const canonical = canonicalize(request);
    if (canonical === undefined) {
      throw new TypeError('the request to fingerprint is not JSON-serialisable');
    }
    hash.update(canonical, 'utf8');
  }
  return hash.digest();
}
