// The client's transport options and cancellation: TLS, and an AbortSignal that stops a wait
// and the work.
import assert from 'node:assert/strict';
import * as fs from 'node:fs/promises';
import * as os from 'node:os';
import * as path from 'node:path';

import { generate } from 'selfsigned';

import { IdempotencyClient, InvalidArgumentError, UnavailableError } from '../src';
import { deferred, testOnEveryStore, until } from './support/harness';
import { AnswerWithholdingProxy } from './support/proxy';

testOnEveryStore(
  'over TLS: a client trusting the server certificate works, a plaintext client does not get through',
  async ({ server, newClient, fixture: { rootCert } }) => {
    const secure = newClient({ tls: { rootCerts: rootCert } });
    const result = await secure.runOnce('payments', 'order-tls', async () => 'over tls');
    assert.deepEqual(result, { value: 'over tls', replayed: false });

    const plaintext = newClient({ callTimeoutMs: 2_000, retry: { totalMs: 0 } });
    await assert.rejects(plaintext.lookup('payments', 'order-tls'), UnavailableError);
    assert.ok(server.address.startsWith('127.0.0.1:'));
  },
  async () => {
    const pems = await generate([{ name: 'commonName', value: '127.0.0.1' }], {
      algorithm: 'sha256',
      keyType: 'ec',
      extensions: [
        { name: 'basicConstraints', cA: false },
        { name: 'subjectAltName', altNames: [{ type: 7, ip: '127.0.0.1' }, { type: 2, value: 'localhost' }] },
      ],
    });
    const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'idc-node-tls-'));
    const certFile = path.join(dir, 'server.pem');
    const keyFile = path.join(dir, 'server.key');
    await fs.writeFile(certFile, pems.cert);
    await fs.writeFile(keyFile, pems.private);
    const rootCert = Buffer.from(pems.cert);
    return {
      serverOptions: { tls: { certFile, keyFile, rootCert } },
      fixture: { rootCert },
      cleanup: () => fs.rm(dir, { recursive: true, force: true }),
    };
  },
);

testOnEveryStore('aborting the caller signal stops a wait for the holder, and aborts and releases running work', async ({ client, newClient }) => {
  const holds = deferred();
  const callerGivesUp = new AbortController();
  const running = client.runOnce(
    'payments',
    'order-abort',
    async (lease) => {
      holds.resolve();
      await new Promise((_, reject) => lease.signal.addEventListener('abort', () => reject(lease.signal.reason)));
    },
    { signal: callerGivesUp.signal },
  );
  await holds.promise;

  const waiterGivesUp = new AbortController();
  const waiting = newClient().runOnce('payments', 'order-abort', () => assert.fail('the work must not run twice'), {
    waitMs: 30_000,
    signal: waiterGivesUp.signal,
  });
  const stopWaiting = new Error('the HTTP client went away');
  waiterGivesUp.abort(stopWaiting);
  await assert.rejects(waiting, (error) => error === stopWaiting);

  const shuttingDown = new Error('SIGTERM');
  callerGivesUp.abort(shuttingDown);
  await assert.rejects(running, (error) => error === shuttingDown);
  assert.deepEqual(await client.lookup('payments', 'order-abort'), { kind: 'absent' }, 'released for a fresh retry');

  // Bad options are refused before anything is sent.
  await assert.rejects(
    client.runOnce('payments', 'order-abort', async () => 1, { leaseTtlMs: Number.NaN }),
    RangeError,
  );
  await assert.rejects(client.runOnce('payments', 'order-abort', async () => 1, { leaseTtlMs: 50 }), InvalidArgumentError);
});

testOnEveryStore('aborting while TryStart is on the wire: the claim it made is released, the work never runs', async ({ server, client: observer }) => {
  const proxy = await AnswerWithholdingProxy.start(server.address);
  const client = new IdempotencyClient(proxy.address);
  try {
    await client.lookup('payments', 'order-slow'); // connected through the proxy
    proxy.holdAnswers();
    const callerGivesUp = new AbortController();
    const running = client.runOnce('payments', 'order-slow', () => assert.fail('the work must not run'), {
      signal: callerGivesUp.signal,
    });
    await until(async () => (await observer.lookup('payments', 'order-slow')).kind === 'inProgress');
    const gone = new Error('the HTTP client went away');
    callerGivesUp.abort(gone);
    proxy.deliverHeldAnswers();
    await assert.rejects(running, (error) => error === gone);
    assert.deepEqual(await observer.lookup('payments', 'order-slow'), { kind: 'absent' });
  } finally {
    client.close();
    await proxy.close();
  }
});
