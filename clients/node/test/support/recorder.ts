// Records the TryStart calls a client makes (their attempt_id and final status), through a
// grpc-js interceptor: the client itself stays as a user would have it.
import * as grpc from '@grpc/grpc-js';

export interface RecordedTryStart {
  attemptId: string;
  code: grpc.status | undefined;
}

export class TryStartRecorder {
  readonly calls: RecordedTryStart[] = [];
  private readonly waiters: Array<{ condition: () => boolean; resolve: () => void }> = [];

  readonly interceptor: grpc.Interceptor = (options, nextCall) => {
    if (!options.method_definition.path.endsWith('/TryStart')) return new grpc.InterceptingCall(nextCall(options));
    const record: RecordedTryStart = { attemptId: '', code: undefined };
    this.calls.push(record);
    return new grpc.InterceptingCall(nextCall(options), {
      sendMessage: (message: { attemptId?: string }, next) => {
        record.attemptId = message.attemptId ?? '';
        next(message);
      },
      start: (metadata, listener, next) => {
        next(metadata, {
          onReceiveStatus: (status, nextStatus) => {
            record.code = status.code;
            nextStatus(status);
            this.wake();
          },
        });
      },
    });
  };

  /** Resolves once `condition` holds over the calls recorded so far. */
  until(condition: (calls: readonly RecordedTryStart[]) => boolean): Promise<void> {
    if (condition(this.calls)) return Promise.resolve();
    return new Promise((resolve) => this.waiters.push({ condition: () => condition(this.calls), resolve }));
  }

  private wake(): void {
    for (const waiter of [...this.waiters]) {
      if (waiter.condition()) {
        this.waiters.splice(this.waiters.indexOf(waiter), 1);
        waiter.resolve();
      }
    }
  }
}
