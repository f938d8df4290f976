// Writes each behaviour test once and runs it on both stores, each run against a server and
// store of its own.
import { describe, test } from 'node:test';

import { IdempotencyClient, type ClientOptions } from '../../src';
import { CoordinatorServer, STORES, type ServerOptions } from './server';

// A test that hangs fails on its own instead of holding the whole run.
const TEST_TIMEOUT_MS = 60_000;

export interface StoreContext<F> {
  server: CoordinatorServer;
  /** A client of the test's server (closed after the test). */
  client: IdempotencyClient;
  /** Another client, e.g. a second service racing the first (closed after the test). */
  newClient(options?: ClientOptions): IdempotencyClient;
  /** What the test's setup made before the server started. */
  fixture: F;
}

/** Made before the server starts (e.g. a tokens file), and cleaned up after the test. */
export interface Setup<F> {
  serverOptions?: ServerOptions;
  fixture: F;
  cleanup?: () => Promise<void>;
}

export function testOnEveryStore<F = undefined>(
  name: string,
  body: (context: StoreContext<F>) => Promise<void>,
  setup: () => Promise<Setup<F>> = async () => ({ fixture: undefined as F }),
): void {
  for (const store of STORES) {
    describe(store, () => {
      test(name, { timeout: TEST_TIMEOUT_MS }, async () => {
        const prepared = await setup();
        const clients: IdempotencyClient[] = [];
        try {
          const server = await CoordinatorServer.start(store, prepared.serverOptions);
          const newClient = (clientOptions?: ClientOptions) => {
            const client = new IdempotencyClient(server.address, clientOptions);
            clients.push(client);
            return client;
          };
          try {
            await body({ server, client: newClient(), newClient, fixture: prepared.fixture });
          } finally {
            for (const client of clients) client.close();
            await server.dispose();
          }
        } finally {
          await prepared.cleanup?.();
        }
      });
    });
  }
}

/** A promise and the functions that settle it, for handing control between concurrent parts. */
export function deferred<T = void>(): { promise: Promise<T>; resolve: (value: T) => void; reject: (error: unknown) => void } {
  let resolve!: (value: T) => void;
  let reject!: (error: unknown) => void;
  const promise = new Promise<T>((res, rej) => {
    resolve = res;
    reject = rej;
  });
  return { promise, resolve, reject };
}

export const delay = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/** Resolves once `condition` holds, checking every 20 ms; fails after `limitMs`. */
export async function until(condition: () => Promise<boolean>, limitMs = 10_000): Promise<void> {
  const deadline = Date.now() + limitMs;
  while (!(await condition())) {
    if (Date.now() > deadline) throw new Error(`the condition did not hold within ${limitMs} ms`);
    await delay(20);
  }
}
