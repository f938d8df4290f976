// The scenario vectors of clients/conformance/scenarios.json: runOnce against a real coordinator
// (one for the suite, on SQLite), with the workspace's fault-proxy between each scenario's
// fresh client and the coordinator. One test per scenario; the steps and expectations mean
// what clients/conformance/README.md ("scenarios.json") says they mean.
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { after, before, describe, test } from 'node:test';

import {
  FingerprintMismatchError,
  IdempotencyClient,
  IdempotencyError,
  InProgressError,
  LeaseLostError,
  ResultNotStoredError,
  UnauthenticatedError,
  UnavailableError,
  fingerprintOf,
  type Lease,
  type RunOnceOptions,
} from '../src';
import { deferred } from './support/harness';
import { FaultProxy } from './support/fault-proxy';
import { CoordinatorServer } from './support/server';

const CONFORMANCE = path.resolve(__dirname, '..', '..', '..', 'conformance');
/** The longest any one thing a step waits for may take (a loaded two-core machine included). */
const WAIT_LIMIT_MS = 20_000;
/** A whole scenario: its steps' waits, and the retry budgets it runs down. */
const SCENARIO_TIMEOUT_MS = 120_000;
const POLL_MS = 20;
/** The suite's own namespace; keys are made unique per run of the suite by RUN_PREFIX. */
const NAMESPACE = 'node-scenarios';
const RUN_PREFIX = randomUUID();

// ---- The vectors, read strictly: a field this runner does not know fails the scenario ---------

type Json = null | boolean | number | string | Json[] | { [name: string]: Json };

interface Work {
  result?: Json;
  fail?: string;
  gate?: boolean;
  until_cancelled?: boolean;
  duration_ms?: number;
  refuse_at_end?: boolean;
}

interface Run {
  as?: string;
  key: string;
  request: Json;
  wait_ms?: number;
  lease_ttl_ms?: number;
  work: Work;
}

type ErrorKind =
  | 'mismatch'
  | 'in_progress'
  | 'lease_lost'
  | 'result_not_stored'
  | 'unavailable'
  | 'unauthenticated'
  | 'work_failed'
  | 'other';

interface Expect {
  result?: Json;
  error?: ErrorKind;
  carried_result?: Json;
  work_ran?: boolean;
  work_cancelled?: boolean;
  attempt?: number;
  min_elapsed_ms?: number;
}

interface Step {
  run?: Run;
  expect?: Expect;
  await_started?: string;
  open_gate?: string;
  join?: string;
  fault?: Record<string, Json>;
  refuse?: boolean;
  restore?: boolean;
  reset?: boolean;
  await_calls?: { method: string; count: number };
  expect_calls?: { method: string; count: number; min_gap_ms?: number };
  expect_key?: { key: string; state: 'absent' | 'in_progress' | 'completed' };
  claim?: { key: string; request: Json; lease_ttl_ms: number };
  pause_ms?: number;
}

interface Scenario {
  name: string;
  what: string;
  client?: { retry_budget_ms?: number };
  steps: Step[];
}

const KNOWN_FIELDS = {
  scenario: ['name', 'what', 'client', 'steps'],
  client: ['retry_budget_ms'],
  step: [
    'run',
    'expect',
    'await_started',
    'open_gate',
    'join',
    'fault',
    'refuse',
    'restore',
    'reset',
    'await_calls',
    'expect_calls',
    'expect_key',
    'claim',
    'pause_ms',
  ],
  run: ['as', 'key', 'request', 'wait_ms', 'lease_ttl_ms', 'work'],
  work: ['result', 'fail', 'gate', 'until_cancelled', 'duration_ms', 'refuse_at_end'],
  expect: ['result', 'error', 'carried_result', 'work_ran', 'work_cancelled', 'attempt', 'min_elapsed_ms'],
  await_calls: ['method', 'count'],
  expect_calls: ['method', 'count', 'min_gap_ms'],
  expect_key: ['key', 'state'],
  claim: ['key', 'request', 'lease_ttl_ms'],
} as const;
const ERROR_KINDS: readonly ErrorKind[] = [
  'mismatch',
  'in_progress',
  'lease_lost',
  'result_not_stored',
  'unavailable',
  'unauthenticated',
  'work_failed',
  'other',
];

function checkFields(what: keyof typeof KNOWN_FIELDS, value: object | undefined, where: string): void {
  if (value === undefined) return;
  const known: readonly string[] = KNOWN_FIELDS[what];
  for (const name of Object.keys(value)) {
    assert.ok(known.includes(name), `${where}: this runner does not know the ${what} field ${JSON.stringify(name)}`);
  }
}

function checkScenario(scenario: Scenario): void {
  checkFields('scenario', scenario, scenario.name);
  checkFields('client', scenario.client, scenario.name);
  scenario.steps.forEach((step, index) => {
    const where = `${scenario.name}, step ${index + 1}`;
    checkFields('step', step, where);
    checkFields('run', step.run, where);
    checkFields('work', step.run?.work, where);
    checkFields('expect', step.expect, where);
    checkFields('await_calls', step.await_calls, where);
    checkFields('expect_calls', step.expect_calls, where);
    checkFields('expect_key', step.expect_key, where);
    checkFields('claim', step.claim, where);
    const kinds = Object.keys(step).filter((name) => name !== 'expect');
    assert.equal(kinds.length, 1, `${where}: a step of one kind, not ${JSON.stringify(kinds)}`);
    if (step.expect !== undefined) {
      assert.ok(step.run !== undefined || step.join !== undefined, `${where}: an "expect" belongs to a run or a join`);
    }
    for (const [name, ms] of [
      ['work.duration_ms', step.run?.work.duration_ms],
      ['claim.lease_ttl_ms', step.claim?.lease_ttl_ms],
      ['pause_ms', step.pause_ms],
    ] as const) {
      if (ms !== undefined) assert.ok(isMilliseconds(ms), `${where}: ${name} is not a duration: ${JSON.stringify(ms)}`);
    }
    if (step.expect?.error !== undefined) {
      assert.ok(ERROR_KINDS.includes(step.expect.error), `${where}: unknown error kind ${step.expect.error}`);
    }
  });
}

/** A duration of the vectors: a number of milliseconds, not negative. */
function isMilliseconds(value: unknown): value is number {
  return typeof value === 'number' && Number.isFinite(value) && value >= 0;
}

const { scenarios } = JSON.parse(fs.readFileSync(path.join(CONFORMANCE, 'scenarios.json'), 'utf8')) as {
  scenarios: Scenario[];
};

// ---- Running a scenario --------------------------------------------------------------------

/** The work's own error when a vector says `fail`: the one that must come back unchanged. */
class WorkFailure extends Error {
  override name = 'WorkFailure';
}

type Outcome = { ok: true; value: unknown } | { ok: false; error: unknown };

/** One runOnce of a scenario, and what its work function saw and did. */
class RunningCall {
  /** When the runner was about to call runOnce (`performance.now()`). */
  readonly began = performance.now();
  workRan = false;
  workCancelled = false;
  attempt: number | undefined;
  /** The error the work threw (`fail`), to compare by identity. */
  thrown: WorkFailure | undefined;
  readonly started = deferred();
  readonly gate = deferred();
  readonly outcome: Promise<Outcome>;
  /** How long it may take to end: the usual limit, and on top the wait it asks the service for. */
  readonly limitMs: number;

  constructor(
    readonly name: string,
    private readonly run: Run,
    client: IdempotencyClient,
    proxy: FaultProxy,
    key: string,
    /** Aborted only when the scenario is over (or failed), so that nothing outlives it. */
    teardown: AbortSignal,
  ) {
    this.limitMs = WAIT_LIMIT_MS + (run.wait_ms ?? 0);
    const options: RunOnceOptions<unknown> = { request: run.request, signal: teardown };
    if (run.wait_ms !== undefined) options.waitMs = run.wait_ms;
    if (run.lease_ttl_ms !== undefined) options.leaseTtlMs = run.lease_ttl_ms;
    this.outcome = client.runOnce(NAMESPACE, key, (lease) => this.work(lease, proxy), options).then(
      (result): Outcome => ({ ok: true, value: result.value }),
      (error: unknown): Outcome => ({ ok: false, error }),
    );
  }

  private async work(lease: Lease, proxy: FaultProxy): Promise<unknown> {
    const { work } = this.run;
    this.workRan = true;
    this.attempt = lease.attempt;
    let running = true;
    // "Whether the client cancelled the work while it ran": an abort after the work returned
    // (or one the scenario's teardown made) is not one.
    const onAbort = () => {
      if (running && !teardownAborted(lease.signal)) this.workCancelled = true;
    };
    if (lease.signal.aborted) onAbort();
    else lease.signal.addEventListener('abort', onAbort, { once: true });
    try {
      this.started.resolve();
      if (work.gate) await this.gate.promise;
      if (work.until_cancelled) await untilAborted(lease.signal, WAIT_LIMIT_MS);
      if (work.duration_ms !== undefined) {
        // Works that long unless the client cancels it first: then it must not return its result.
        await untilAborted(lease.signal, work.duration_ms);
        if (lease.signal.aborted) throw new Error('the client cancelled the work before it was done');
      }
      if (work.refuse_at_end) await proxy.refuse();
      if (work.fail !== undefined) {
        this.thrown = new WorkFailure(work.fail);
        throw this.thrown;
      }
      return work.result;
    } finally {
      running = false;
      lease.signal.removeEventListener('abort', onAbort);
    }
  }
}

/** The reason the teardown signal aborts with, so that the work can tell it from the client's own. */
const TEARDOWN = new Error('the scenario is over');
const teardownAborted = (signal: AbortSignal) => signal.aborted && signal.reason === TEARDOWN;

/** Resolves once `signal` aborts, or after `limitMs` (the work then ends uncancelled). */
function untilAborted(signal: AbortSignal, limitMs: number): Promise<void> {
  return new Promise((resolve) => {
    if (signal.aborted) {
      resolve();
      return;
    }
    const timer = setTimeout(() => {
      signal.removeEventListener('abort', onAbort);
      resolve();
    }, limitMs);
    const onAbort = () => {
      clearTimeout(timer);
      resolve();
    };
    signal.addEventListener('abort', onAbort, { once: true });
  });
}

/** `promise`, or a failure naming `what` after `limitMs`. */
async function within<T>(promise: Promise<T>, what: string, limitMs = WAIT_LIMIT_MS): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: not within ${limitMs} ms`)), limitMs);
  });
  try {
    return await Promise.race([promise, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

function describeOutcome(outcome: Outcome): string {
  if (outcome.ok) return `returned ${JSON.stringify(outcome.value)}`;
  const error = outcome.error;
  return error instanceof Error ? `failed with ${error.name}: ${error.message}` : `failed with ${String(error)}`;
}

/** The client's error class of each error kind that is one class. */
const ERROR_CLASSES = {
  mismatch: FingerprintMismatchError,
  in_progress: InProgressError,
  lease_lost: LeaseLostError,
  result_not_stored: ResultNotStoredError,
  unavailable: UnavailableError,
  unauthenticated: UnauthenticatedError,
} satisfies Record<Exclude<ErrorKind, 'work_failed' | 'other'>, abstract new (...args: never[]) => IdempotencyError>;

/** Whether `error` is of the client's error `kind` (README, `expect.error`). */
function isOfKind(kind: ErrorKind, error: unknown, call: RunningCall): boolean {
  switch (kind) {
    case 'work_failed':
      // The work's own error, passed through unchanged: the very object it threw.
      return call.thrown !== undefined && error === call.thrown;
    case 'other': {
      // Any other error of the client's own.
      const named = ERROR_KINDS.filter((other) => other !== 'other');
      return error instanceof IdempotencyError && !named.some((other) => isOfKind(other, error, call));
    }
    default:
      return error instanceof ERROR_CLASSES[kind];
  }
}

function checkOutcome(call: RunningCall, outcome: Outcome, expect: Expect, where: string): void {
  const got = describeOutcome(outcome);
  if (expect.result !== undefined) {
    assert.ok(outcome.ok, `${where}: expected the result ${JSON.stringify(expect.result)}, but run_once ${got}`);
    assert.deepStrictEqual(outcome.value, expect.result, `${where}: the result`);
  }
  if (expect.error !== undefined) {
    assert.ok(!outcome.ok, `${where}: expected a ${expect.error} error, but run_once ${got}`);
    assert.ok(isOfKind(expect.error, outcome.error, call), `${where}: expected a ${expect.error} error, but run_once ${got}`);
  }
  if (expect.carried_result !== undefined) {
    assert.ok(
      !outcome.ok && outcome.error instanceof ResultNotStoredError,
      `${where}: expected a result-not-stored error carrying a result, but run_once ${got}`,
    );
    assert.deepStrictEqual(outcome.error.result, expect.carried_result, `${where}: the carried result`);
  }
  if (expect.work_ran !== undefined) {
    assert.equal(call.workRan, expect.work_ran, `${where}: whether the work ran (run_once ${got})`);
  }
  if (expect.work_cancelled !== undefined) {
    assert.equal(call.workCancelled, expect.work_cancelled, `${where}: whether the work was cancelled (run_once ${got})`);
  }
  if (expect.attempt !== undefined) {
    assert.equal(call.attempt, expect.attempt, `${where}: the attempt the work saw (run_once ${got})`);
  }
  if (expect.min_elapsed_ms !== undefined) {
    const elapsedMs = performance.now() - call.began;
    assert.ok(
      elapsedMs >= expect.min_elapsed_ms,
      `${where}: run_once took ${elapsedMs.toFixed(0)} ms, under ${expect.min_elapsed_ms} ms (run_once ${got})`,
    );
  }
}

async function runScenario(scenario: Scenario, index: number, server: CoordinatorServer): Promise<void> {
  checkScenario(scenario);
  // Unique per run of the suite, and per scenario (they all use the key "k").
  const keyOf = (key: string) => `${RUN_PREFIX}/${index}/${key}`;
  const proxy = await FaultProxy.start(server.address);
  const retry = scenario.client?.retry_budget_ms !== undefined ? { totalMs: scenario.client.retry_budget_ms } : undefined;
  const client = new IdempotencyClient(proxy.address, retry ? { retry } : {});
  // Straight to the coordinator, not through the proxy (expect_key).
  const direct = new IdempotencyClient(server.address);
  const teardown = new AbortController();
  /** The runs started in the background, by name, and which of them a step joined. */
  const calls = new Map<string, RunningCall>();
  const joined = new Set<string>();
  const every: RunningCall[] = [];
  const start = (run: Run, name: string) => {
    const call = new RunningCall(name, run, client, proxy, keyOf(run.key), teardown.signal);
    every.push(call);
    return call;
  };
  const named = (name: string, where: string): RunningCall => {
    const call = calls.get(name);
    assert.ok(call, `${where}: no run named ${JSON.stringify(name)}`);
    return call;
  };

  try {
    for (const [stepIndex, step] of scenario.steps.entries()) {
      const where = `step ${stepIndex + 1}`;
      if (step.run !== undefined) {
        const run = step.run;
        if (run.as !== undefined) {
          assert.equal(step.expect, undefined, `${where}: a run with "as" is checked by its join`);
          assert.ok(!calls.has(run.as), `${where}: a second run named ${run.as}`);
          calls.set(run.as, start(run, run.as));
        } else {
          assert.ok(step.expect, `${where}: a run without "as" needs an "expect"`);
          assert.ok(!run.work.gate, `${where}: a gated run must be named to open its gate`);
          const call = start(run, where);
          checkOutcome(call, await within(call.outcome, `${where}: run_once`, call.limitMs), step.expect, where);
        }
      } else if (step.await_started !== undefined) {
        const call = named(step.await_started, where);
        // A run that ends before its work starts never will start: say so rather than time out.
        const ended = call.outcome.then((outcome) => {
          throw new Error(`${where}: ${call.name} ended before its work started: run_once ${describeOutcome(outcome)}`);
        });
        ended.catch(() => undefined);
        await within(Promise.race([call.started.promise, ended]), `${where}: the work of ${call.name} starting`);
      } else if (step.open_gate !== undefined) {
        named(step.open_gate, where).gate.resolve();
      } else if (step.join !== undefined) {
        const call = named(step.join, where);
        assert.ok(step.expect, `${where}: a join needs an "expect"`);
        joined.add(step.join);
        checkOutcome(call, await within(call.outcome, `${where}: ${call.name} ending`, call.limitMs), step.expect, `${where} (${call.name})`);
      } else if (step.claim !== undefined) {
        // A holder whose process died: one TryStart through the proxy, then nothing (no
        // heartbeat, no Release), so that its lease runs out.
        const { key, request, lease_ttl_ms: leaseTtlMs } = step.claim;
        const outcome = await client.tryStart({
          namespace: NAMESPACE,
          key: keyOf(key),
          fingerprint: fingerprintOf(request),
          leaseTtlMs,
          attemptId: randomUUID(),
        });
        assert.equal(outcome.kind, 'started', `${where}: the claim's TryStart answered ${outcome.kind}`);
      } else if (step.pause_ms !== undefined) {
        // The scenario's own timing (a holder that keeps the key this long), not a wait for
        // something the runner could watch.
        await new Promise((resolve) => setTimeout(resolve, step.pause_ms));
      } else if (step.fault !== undefined) {
        await proxy.fault(step.fault);
      } else if (step.refuse !== undefined) {
        assert.equal(step.refuse, true, `${where}: refuse`);
        await proxy.refuse();
      } else if (step.restore !== undefined) {
        assert.equal(step.restore, true, `${where}: restore`);
        await proxy.restore();
      } else if (step.reset !== undefined) {
        assert.equal(step.reset, true, `${where}: reset`);
        await proxy.reset();
      } else if (step.await_calls !== undefined) {
        const { method, count } = step.await_calls;
        const deadline = Date.now() + WAIT_LIMIT_MS;
        for (;;) {
          const seen = (await proxy.calls())[method]?.length ?? 0;
          if (seen >= count) break;
          assert.ok(Date.now() < deadline, `${where}: ${method} was called ${seen} times, not ${count}, within ${WAIT_LIMIT_MS} ms`);
          await new Promise((resolve) => setTimeout(resolve, POLL_MS));
        }
      } else if (step.expect_calls !== undefined) {
        const { method, count, min_gap_ms: minGapMs } = step.expect_calls;
        const log = await proxy.calls();
        const arrivals = log[method] ?? [];
        assert.equal(arrivals.length, count, `${where}: the calls of ${method} (the proxy saw ${JSON.stringify(log)})`);
        if (minGapMs !== undefined) {
          const [first, second] = arrivals;
          assert.ok(first !== undefined && second !== undefined, `${where}: min_gap_ms needs two calls of ${method}`);
          assert.ok(
            second - first >= minGapMs,
            `${where}: the second ${method} came ${(second - first).toFixed(1)} ms after the first, not at least ${minGapMs} ms`,
          );
        }
      } else if (step.expect_key !== undefined) {
        const { key, state: expected } = step.expect_key;
        const state = await direct.lookup(NAMESPACE, keyOf(key), { timeoutMs: WAIT_LIMIT_MS });
        const kind = { absent: 'absent', inProgress: 'in_progress', completed: 'completed' }[state.kind];
        assert.equal(kind, expected, `${where}: the key's state`);
      } else {
        assert.fail(`${where}: a step this runner does not know: ${JSON.stringify(step)}`);
      }
    }
    const unjoined = [...calls.keys()].filter((name) => !joined.has(name));
    assert.deepEqual(unjoined, [], 'every run started in the background is joined by the scenario');
  } catch (error) {
    if (error instanceof Error) {
      const stderr = proxy.stderr.trim();
      if (stderr) error.message += `\nfault-proxy stderr:\n${stderr}`;
    }
    throw error;
  } finally {
    // Nothing of a scenario outlives it: gates open, runs cancelled and ended, connections closed.
    for (const call of every) call.gate.resolve();
    teardown.abort(TEARDOWN);
    await within(
      Promise.all(every.map((call) => call.outcome)),
      'the scenario runs ending after it',
    ).catch(() => undefined);
    client.close();
    direct.close();
    await proxy.close();
  }
}

describe('scenario vectors (clients/conformance/scenarios.json)', () => {
  let server: CoordinatorServer | undefined;

  before(async () => {
    server = await CoordinatorServer.start('sqlite');
  });

  after(async () => {
    await server?.dispose();
  });

  test('the vectors are there, with unique names', () => {
    assert.ok(scenarios.length > 0, 'scenarios.json has scenarios');
    const names = scenarios.map((scenario) => scenario.name);
    assert.equal(new Set(names).size, names.length, 'scenario names are unique');
  });

  scenarios.forEach((scenario, index) => {
    test(`scenario: ${scenario.name}`, { timeout: SCENARIO_TIMEOUT_MS }, async () => {
      assert.ok(server, 'the coordinator started');
      await runScenario(scenario, index, server);
    });
  });
});
