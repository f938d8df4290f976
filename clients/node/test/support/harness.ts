// Writes each behaviour test once and runs it on both stores, each run against a server and
// store of its own.
import { describe, test } from 'node:test';

import { IdempotencyClient, type ClientOptions } from '../../src';
import { CoordinatorServer, STORES, type ServerOptions } from './server';

export interface StoreContext {
  server: CoordinatorServer;
  /** A client of the test's server (closed after the test). */
  client: IdempotencyClient;
  /** Another client, e.g. a second service racing the first (closed after the test). */
  newClient(options?: ClientOptions): IdempotencyClient;
}

export function testOnEveryStore(
  name: string,
  body: (context: StoreContext) => Promise<void>,
  serverOptions: () => Promise<ServerOptions & { cleanup?: () => Promise<void> }> = async () => ({}),
): void {
  for (const store of STORES) {
    describe(store, () => {
      test(name, async () => {
        const options = await serverOptions();
        const server = await CoordinatorServer.start(store, options);
        const clients: IdempotencyClient[] = [];
        const newClient = (clientOptions?: ClientOptions) => {
          const client = new IdempotencyClient(server.address, clientOptions);
          clients.push(client);
          return client;
        };
        try {
          await body({ server, client: newClient(), newClient });
        } finally {
          for (const client of clients) client.close();
          await server.dispose();
          await options.cleanup?.();
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
