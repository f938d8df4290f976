// Starts the real coordinator binary for a test, on a store of its own: a fresh PostgreSQL
// database or a SQLite file in a fresh temporary folder, removed again by dispose().
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { once } from 'node:events';
import * as fs from 'node:fs/promises';
import * as os from 'node:os';
import * as path from 'node:path';
import { promisify } from 'node:util';
import * as grpc from '@grpc/grpc-js';
import { service as healthService } from 'grpc-health-check';

const execFileAsync = promisify(execFile);

export type StoreKind = 'postgres' | 'sqlite';
export const STORES: readonly StoreKind[] = ['postgres', 'sqlite'];

const REPO_ROOT = path.resolve(__dirname, '..', '..', '..', '..', '..');
export const BINARY =
  process.env.IDEMPOTENCY_COORDINATOR_BIN ?? path.join(REPO_ROOT, 'target', 'debug', 'idempotency-coordinator');
const POSTGRES_ADMIN_URL = process.env.IDEMPOTENCY_TEST_POSTGRES ?? 'postgres://postgres@127.0.0.1:5432';
const SERVICE_NAME = 'idempotency.v1.IdempotencyService';
const STARTUP_LIMIT_MS = 30_000;
const POLL_MS = 20;

/** The one method of grpc.health.v1 the tests call (the constructor above is untyped). */
interface HealthClient extends grpc.Client {
  Check(
    request: { service: string },
    options: grpc.CallOptions,
    callback: (error: grpc.ServiceError | null, answer?: { status: string }) => void,
  ): grpc.ClientUnaryCall;
}

// A test process that ends early (a hung test cut off by --test-force-exit) must not leave
// coordinators running behind it.
const liveServers = new Set<ChildProcess>();
process.on('exit', () => {
  for (const child of liveServers) child.kill('SIGKILL');
});

export interface ServerOptions {
  tokensFile?: string;
  /** Serve TLS with this certificate and key (PEM files); `rootCert` is what clients trust. */
  tls?: { certFile: string; keyFile: string; rootCert: Buffer };
  /** More flags for `serve`. */
  extraArgs?: string[];
}

export class CoordinatorServer {
  private process: ChildProcess | undefined;
  private log = '';
  address = '';

  private constructor(
    readonly store: StoreKind,
    private readonly workDir: string,
    private readonly databaseName: string | undefined,
    private readonly options: ServerOptions,
  ) {}

  static async start(store: StoreKind, options: ServerOptions = {}): Promise<CoordinatorServer> {
    await fs.access(BINARY, fs.constants.X_OK).catch(() => {
      throw new Error(`no coordinator binary at ${BINARY}: build it, or set IDEMPOTENCY_COORDINATOR_BIN`);
    });
    const workDir = await fs.mkdtemp(path.join(os.tmpdir(), 'idc-node-test-'));
    const databaseName = store === 'postgres' ? `idc_node_${randomUUID().replaceAll('-', '')}` : undefined;
    const server = new CoordinatorServer(store, workDir, databaseName, options);
    try {
      await server.launch('127.0.0.1:0');
    } catch (error) {
      await server.dispose();
      throw error;
    }
    return server;
  }

  /** A token and its tokens-file line, from the binary's own `token new`. */
  static async newToken(name: string, scopes: string): Promise<{ token: string; line: string }> {
    const { stdout } = await execFileAsync(BINARY, ['token', 'new', '--name', name, '--scopes', scopes]);
    const lines = stdout.split('\n').filter((line) => line.trim() !== '' && !line.startsWith('#'));
    const token = lines.find((line) => line.startsWith('idc_'));
    const line = lines.find((line) => line.startsWith(`${name} `));
    if (!token || !line) throw new Error(`unexpected output of token new:\n${stdout}`);
    return { token, line };
  }

  /** Writes a file in the server's temporary folder (removed by dispose). */
  async writeFile(name: string, contents: string): Promise<string> {
    const file = path.join(this.workDir, name);
    await fs.writeFile(file, contents);
    return file;
  }

  static async tempFile(name: string, contents: string): Promise<{ file: string; remove: () => Promise<void> }> {
    const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'idc-node-file-'));
    const file = path.join(dir, name);
    await fs.writeFile(file, contents);
    return { file, remove: () => fs.rm(dir, { recursive: true, force: true }) };
  }

  /** SIGTERM, then the exit, which must be clean. */
  async stop(): Promise<void> {
    const child = this.process;
    if (!child || child.exitCode !== null || child.signalCode !== null) return;
    const exited = once(child, 'exit');
    child.kill('SIGTERM');
    const [code] = (await exited) as [number | null];
    this.process = undefined;
    if (code !== 0) throw new Error(`the coordinator exited with ${code} on SIGTERM:\n${this.log}`);
  }

  /** Starts the binary again on the same address and store (after stop). */
  async restart(): Promise<void> {
    await this.launch(this.address);
  }

  async dispose(): Promise<void> {
    try {
      await this.stop();
    } finally {
      if (this.databaseName) {
        await execFileAsync('psql', [
          `${POSTGRES_ADMIN_URL}/postgres`,
          '-v',
          'ON_ERROR_STOP=1',
          '-c',
          `DROP DATABASE IF EXISTS "${this.databaseName}" WITH (FORCE)`,
        ]);
      }
      await fs.rm(this.workDir, { recursive: true, force: true });
    }
  }

  private async launch(listen: string): Promise<void> {
    const addressFile = path.join(this.workDir, `address-${randomUUID()}`);
    const storeArgs =
      this.store === 'postgres'
        ? ['--database-url', `${POSTGRES_ADMIN_URL}/${this.databaseName}`]
        : ['--sqlite-path', path.join(this.workDir, 'coordinator.db')];
    const args = [
      'serve',
      '--listen',
      listen,
      '--address-file',
      addressFile,
      ...storeArgs,
      // Short enough that a test's restart is quick, long enough for its calls to finish.
      '--shutdown-grace',
      '5s',
      '--health-check-interval',
      '200ms',
      ...(this.options.tokensFile ? ['--tokens-file', this.options.tokensFile] : []),
      ...(this.options.tls ? ['--tls-cert', this.options.tls.certFile, '--tls-key', this.options.tls.keyFile] : []),
      ...(this.options.extraArgs ?? []),
    ];
    const child = spawn(BINARY, args, { stdio: ['ignore', 'ignore', 'pipe'] });
    this.process = child;
    liveServers.add(child);
    child.once('exit', () => liveServers.delete(child));
    child.stderr?.on('data', (chunk: Buffer) => {
      // Keep the tail only: it is for explaining a failure.
      this.log = (this.log + chunk.toString('utf8')).slice(-20_000);
    });
    const spawnError = new Promise<never>((_, reject) => child.once('error', reject));
    spawnError.catch(() => undefined);
    const deadline = Date.now() + STARTUP_LIMIT_MS;
    this.address = await Promise.race([this.readAddress(addressFile, child, deadline), spawnError]);
    await this.waitUntilServing(deadline);
  }

  private async readAddress(addressFile: string, child: ChildProcess, deadline: number): Promise<string> {
    for (;;) {
      try {
        const address = (await fs.readFile(addressFile, 'utf8')).trim();
        if (address) return address;
      } catch (error) {
        if ((error as NodeJS.ErrnoException).code !== 'ENOENT') throw error;
      }
      if (child.exitCode !== null) throw new Error(`the coordinator exited with ${child.exitCode}:\n${this.log}`);
      if (Date.now() > deadline) throw new Error(`the coordinator wrote no address:\n${this.log}`);
      await new Promise((resolve) => setTimeout(resolve, POLL_MS));
    }
  }

  private async waitUntilServing(deadline: number): Promise<void> {
    const Health = grpc.makeGenericClientConstructor(healthService, 'Health');
    const credentials = this.options.tls
      ? grpc.credentials.createSsl(this.options.tls.rootCert)
      : grpc.credentials.createInsecure();
    const health = new Health(this.address, credentials) as unknown as HealthClient;
    try {
      for (;;) {
        const status = await new Promise<string | undefined>((resolve) => {
          health.Check({ service: SERVICE_NAME }, { deadline: Date.now() + 1_000 }, (error, answer) =>
            resolve(error ? undefined : answer?.status),
          );
        });
        if (status === 'SERVING') return;
        if (Date.now() > deadline) throw new Error(`the coordinator never became SERVING:\n${this.log}`);
        await new Promise((resolve) => setTimeout(resolve, POLL_MS * 5));
      }
    } finally {
      health.close();
    }
  }
}
