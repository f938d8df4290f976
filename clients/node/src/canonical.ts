// RFC 8785 (JCS) canonical JSON, of a value or of a JSON text: object members sorted by the
// UTF-16 code units of their names, the fewest escapes, numbers as ECMAScript writes doubles.
// Beyond RFC 8785, as I-JSON (RFC 7493) asks, a duplicate member name, a lone surrogate and an
// integer literal beyond ±(2^53−1) are refused: rounding such an integer to a double would let
// two different requests share a fingerprint. The vectors in clients/conformance pin all of it.
//
// JSON.parse cannot be used for a text: it keeps the last of two equal names and rounds big
// integers silently. The parser below is small and strict instead (a dependency such as
// lossless-json would still need the duplicate check for equal values, and a walk over its
// number type), and it writes the canonical form as it reads.
import { IdempotencyError } from './errors';

/** Why a value or a text has no canonical JSON form. */
export type CanonicalJsonErrorReason =
  | 'invalid_json'
  | 'not_json'
  | 'duplicate_key'
  | 'lone_surrogate'
  | 'unsafe_integer'
  | 'number_out_of_range';

/** A request that cannot be written as canonical JSON, so that it has no fingerprint. */
export class CanonicalJsonError extends IdempotencyError {
  override name = 'CanonicalJsonError';
  constructor(
    /** What is wrong (the `error` of the conformance vectors). */
    readonly reason: CanonicalJsonErrorReason,
    message: string,
  ) {
    super(message);
  }
}

/**
 * The RFC 8785 canonical JSON of `value`, with JSON.stringify's view of it (`toJSON` is called;
 * members that are `undefined`, functions or symbols are left out, and become `null` in
 * arrays). Throws CanonicalJsonError for NaN and infinities, a BigInt (send an integer beyond
 * ±(2^53−1) as a string), a string with a lone surrogate, or a top-level value JSON cannot hold.
 */
export function canonicalJson(value: unknown): string {
  const written = writeValue(value, '');
  if (written === undefined) throw new CanonicalJsonError('not_json', `${typeof value} is not a JSON value`);
  return written;
}

/**
 * The RFC 8785 canonical form of a JSON text (e.g. a request body as it arrived): the same as
 * `canonicalJson` of the value the text holds. Throws CanonicalJsonError for a text that is not
 * JSON, a member name twice in one object, an integer literal beyond ±(2^53−1), a number beyond
 * the largest double, or a lone surrogate.
 */
export function canonicalJsonText(text: string): string {
  const parser = new Parser(text);
  parser.space();
  const canonical = parser.value(0);
  parser.space();
  if (parser.pos !== text.length) parser.fail('text after the JSON value');
  return canonical;
}

// ---- Values ------------------------------------------------------------------------------

function writeValue(input: unknown, key: string): string | undefined {
  let value = input;
  if (value !== null && typeof value === 'object' && typeof (value as { toJSON?: unknown }).toJSON === 'function') {
    value = (value as { toJSON(key: string): unknown }).toJSON(key);
  }
  switch (typeof value) {
    case 'string':
      return writeString(value);
    case 'number':
      return writeNumber(value);
    case 'boolean':
      return value ? 'true' : 'false';
    case 'bigint':
      throw new CanonicalJsonError(
        'unsafe_integer',
        `a BigInt (${value}) is refused: send an integer beyond ±(2^53−1) as a string, a smaller one as a number`,
      );
    case 'undefined':
    case 'function':
    case 'symbol':
      return undefined;
  }
  if (value === null) return 'null';
  if (value instanceof Number || value instanceof String || value instanceof Boolean) {
    return writeValue(value.valueOf(), key);
  }
  if (Array.isArray(value)) {
    return `[${value.map((element, index) => writeValue(element, String(index)) ?? 'null').join(',')}]`;
  }
  const members: Array<[string, string]> = [];
  for (const name of Object.keys(value as object)) {
    const written = writeValue((value as Record<string, unknown>)[name], name);
    if (written !== undefined) members.push([name, written]);
  }
  return writeObject(members);
}

function writeNumber(value: number): string {
  if (!Number.isFinite(value)) throw new CanonicalJsonError('number_out_of_range', `${value} is not a JSON number`);
  // ECMAScript's Number-to-String is RFC 8785's number form (and writes -0 as 0).
  return String(value);
}

/** A UTF-16 code unit of a surrogate that is not half of a pair (with `u`, pairs are one code point). */
const LONE_SURROGATE = /\p{Surrogate}/u;

function writeString(value: string): string {
  if (LONE_SURROGATE.test(value)) throw new CanonicalJsonError('lone_surrogate', 'a string holds a lone surrogate');
  // JSON.stringify of a well-formed string makes exactly RFC 8785's escapes.
  return JSON.stringify(value);
}

/** Members sorted by their names' UTF-16 code units (JavaScript's own string order). */
function writeObject(members: Array<[string, string]>): string {
  members.sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  return `{${members.map(([name, written]) => `${writeString(name)}:${written}`).join(',')}}`;
}

// ---- Texts -------------------------------------------------------------------------------

const MAX_SAFE_INTEGER_DIGITS = String(Number.MAX_SAFE_INTEGER);
const NUMBER = /-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/y;
const ESCAPES: Record<string, string> = { '"': '"', '\\': '\\', '/': '/', b: '\b', f: '\f', n: '\n', r: '\r', t: '\t' };

class Parser {
  pos = 0;

  constructor(private readonly text: string) {}

  fail(what: string): never {
    throw new CanonicalJsonError('invalid_json', `not a JSON text: ${what} at offset ${this.pos}`);
  }

  space(): void {
    while (this.pos < this.text.length && ' \t\n\r'.includes(this.text[this.pos]!)) this.pos += 1;
  }

  value(depth: number): string {
    const c = this.text[this.pos];
    if (c === '{') return this.object(depth + 1);
    if (c === '[') return this.array(depth + 1);
    if (c === '"') return writeString(this.string());
    for (const literal of ['true', 'false', 'null']) {
      if (this.text.startsWith(literal, this.pos)) {
        this.pos += literal.length;
        return literal;
      }
    }
    return this.number();
  }

  private object(depth: number): string {
    const members: Array<[string, string]> = [];
    const names = new Set<string>();
    this.items('}', () => {
      if (this.text[this.pos] !== '"') this.fail('expected a member name');
      const name = this.string();
      if (names.has(name)) {
        throw new CanonicalJsonError('duplicate_key', `the member name ${JSON.stringify(name)} occurs twice in an object`);
      }
      names.add(name);
      this.space();
      if (this.text[this.pos] !== ':') this.fail("expected ':'");
      this.pos += 1;
      this.space();
      members.push([name, this.value(depth)]);
    });
    return writeObject(members);
  }

  private array(depth: number): string {
    const elements: string[] = [];
    this.items(']', () => {
      elements.push(this.value(depth));
    });
    return `[${elements.join(',')}]`;
  }

  /**
   * The members of an object or the elements of an array, from its opening bracket to `close`:
   * `item` reads each, from its first character.
   */
  private items(close: '}' | ']', item: () => void): void {
    this.pos += 1;
    this.space();
    if (this.text[this.pos] === close) {
      this.pos += 1;
      return;
    }
    for (;;) {
      this.space();
      item();
      this.space();
      const next = this.text[this.pos];
      this.pos += 1;
      if (next === close) return;
      if (next !== ',') this.fail(`expected ',' or '${close}'`);
    }
  }

  /** A string token's value; escapes decoded, lone surrogates kept for writeString to refuse. */
  private string(): string {
    this.pos += 1;
    let value = '';
    for (;;) {
      const c = this.text[this.pos];
      if (c === undefined) this.fail('unterminated string');
      this.pos += 1;
      if (c === '"') return value;
      if (c < ' ') this.fail('a control character in a string');
      if (c !== '\\') {
        value += c;
        continue;
      }
      const escape = this.text[this.pos];
      this.pos += 1;
      if (escape === 'u') {
        const hex = this.text.slice(this.pos, this.pos + 4);
        if (!/^[0-9a-fA-F]{4}$/.test(hex)) this.fail('a bad \\u escape');
        value += String.fromCharCode(parseInt(hex, 16));
        this.pos += 4;
      } else if (escape !== undefined && escape in ESCAPES) {
        value += ESCAPES[escape];
      } else {
        this.fail('a bad escape');
      }
    }
  }

  private number(): string {
    NUMBER.lastIndex = this.pos;
    const match = NUMBER.exec(this.text);
    if (!match) this.fail('expected a JSON value');
    const literal = match[0];
    this.pos += literal.length;
    if (match[1] === undefined && match[2] === undefined) {
      const digits = literal.replace('-', '');
      const unsafe =
        digits.length > MAX_SAFE_INTEGER_DIGITS.length ||
        (digits.length === MAX_SAFE_INTEGER_DIGITS.length && digits > MAX_SAFE_INTEGER_DIGITS);
      if (unsafe) {
        throw new CanonicalJsonError(
          'unsafe_integer',
          `the integer ${literal} is beyond ±(2^53−1) and would be rounded: send it as a string`,
        );
      }
    }
    const value = Number(literal);
    if (!Number.isFinite(value)) {
      throw new CanonicalJsonError('number_out_of_range', `the number ${literal} is beyond the largest double`);
    }
    return String(value);
  }
}
