// How runOnce stores a result as the key's response bytes and reads it back on replay.

export interface Codec<T> {
  encode(value: T): Uint8Array;
  decode(bytes: Buffer): T;
}

/**
 * The default: JSON in UTF-8. `undefined` (work that returns nothing) is stored as no bytes
 * and read back as `undefined`.
 */
export function jsonCodec<T>(): Codec<T> {
  return {
    encode(value: T): Uint8Array {
      return value === undefined ? new Uint8Array(0) : Buffer.from(JSON.stringify(value), 'utf8');
    },
    decode(bytes: Buffer): T {
      return (bytes.length === 0 ? undefined : JSON.parse(bytes.toString('utf8'))) as T;
    },
  };
}

/** Stores the work's bytes as they are. */
export const bytesCodec: Codec<Uint8Array> = {
  encode: (value) => value,
  decode: (bytes) => bytes,
};
