// The workspace's fault-proxy binary (testkit/src/bin/fault-proxy.rs) in front of a coordinator,
// for the scenario vectors: started per scenario, controlled over its HTTP control port with
// Node's own fetch, and stopped by closing its stdin.
import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import * as fs from 'node:fs/promises';
import * as path from 'node:path';
import * as readline from 'node:readline';

const REPO_ROOT = path.resolve(__dirname, '..', '..', '..', '..', '..');
export const FAULT_PROXY_BINARY = process.env.FAULT_PROXY_BIN ?? path.join(REPO_ROOT, 'target', 'debug', 'fault-proxy');
const STARTUP_LIMIT_MS = 20_000;
const STOP_LIMIT_MS = 5_000;

// A test process that ends early must not leave proxies running behind it (they also end by
// themselves when their stdin closes, which the process's exit does).
const liveProxies = new Set<ChildProcess>();
process.on('exit', () => {
  for (const child of liveProxies) child.kill('SIGKILL');
});

/** `GET /calls`: for each method, the milliseconds since the proxy started at which each call arrived. */
export type CallLog = Record<string, number[]>;

export class FaultProxy {
  private constructor(
    private readonly child: ChildProcess,
    private readonly output: { stderr: string },
    /** Where clients connect (`host:port`). */
    readonly address: string,
    /** The control port (`host:port`). */
    readonly control: string,
  ) {}

  static async start(upstream: string): Promise<FaultProxy> {
    await fs.access(FAULT_PROXY_BINARY, fs.constants.X_OK).catch(() => {
      throw new Error(`no fault-proxy binary at ${FAULT_PROXY_BINARY}: build it, or set FAULT_PROXY_BIN`);
    });
    const child = spawn(FAULT_PROXY_BINARY, ['--upstream', upstream], { stdio: ['pipe', 'pipe', 'pipe'] });
    liveProxies.add(child);
    // Its stdin only ever closes; a proxy that is gone already must not make that an error.
    child.stdin?.on('error', () => undefined);
    child.once('exit', () => liveProxies.delete(child));
    const output = { stderr: '' };
    child.stderr?.on('data', (chunk: Buffer) => {
      // Keep the tail only: it is for explaining a failure.
      output.stderr = (output.stderr + chunk.toString('utf8')).slice(-20_000);
    });
    const lines = readline.createInterface({ input: child.stdout! });
    try {
      const first = await new Promise<string>((resolve, reject) => {
        const timer = setTimeout(
          () => reject(new Error(`fault-proxy printed no addresses within ${STARTUP_LIMIT_MS} ms:\n${output.stderr}`)),
          STARTUP_LIMIT_MS,
        );
        lines.once('line', (line) => {
          clearTimeout(timer);
          resolve(line);
        });
        child.once('error', (error) => {
          clearTimeout(timer);
          reject(error);
        });
        child.once('exit', (code, signal) => {
          clearTimeout(timer);
          reject(new Error(`fault-proxy exited (${code ?? signal}) before printing its addresses:\n${output.stderr}`));
        });
      });
      const { proxy, control } = JSON.parse(first) as { proxy?: unknown; control?: unknown };
      if (typeof proxy !== 'string' || typeof control !== 'string') {
        throw new Error(`fault-proxy printed an unexpected first line: ${first}`);
      }
      return new FaultProxy(child, output, proxy, control);
    } catch (error) {
      child.kill('SIGKILL');
      throw error;
    } finally {
      lines.close();
    }
  }

  /** `POST /faults` with `fault` as its body. */
  async fault(fault: unknown): Promise<void> {
    await this.post('/faults', JSON.stringify(fault));
  }

  /** `POST /refuse`: every connection dropped, new ones closed at once. */
  async refuse(): Promise<void> {
    await this.post('/refuse');
  }

  /** `POST /restore`: connections let through again. */
  async restore(): Promise<void> {
    await this.post('/restore');
  }

  /** `POST /reset`: no faults, connections let through, the call log emptied. */
  async reset(): Promise<void> {
    await this.post('/reset');
  }

  /** `GET /calls`. */
  async calls(): Promise<CallLog> {
    const response = await fetch(`http://${this.control}/calls`);
    const text = await response.text();
    if (!response.ok) throw new Error(`GET /calls answered ${response.status}: ${text}`);
    return JSON.parse(text) as CallLog;
  }

  /** Closes its stdin, which ends it, and waits for it to exit (killing it if it does not). */
  async close(): Promise<void> {
    const child = this.child;
    if (child.exitCode !== null || child.signalCode !== null) return;
    const exited = once(child, 'exit');
    child.stdin?.end();
    const timer = setTimeout(() => child.kill('SIGKILL'), STOP_LIMIT_MS);
    try {
      await exited;
    } finally {
      clearTimeout(timer);
    }
  }

  /** What the proxy wrote on stderr (the tail), for explaining a failure. */
  get stderr(): string {
    return this.output.stderr;
  }

  private async post(route: string, body?: string): Promise<void> {
    const response = await fetch(`http://${this.control}${route}`, {
      method: 'POST',
      ...(body === undefined ? {} : { body, headers: { 'content-type': 'application/json' } }),
    });
    const text = await response.text();
    if (!response.ok) throw new Error(`POST ${route} answered ${response.status}: ${text.trim()}`);
  }
}
