// Reads the rich error model (google.rpc.Status in the `grpc-status-details-bin` trailer) that
// the coordinator attaches to every error: the ErrorInfo reason, BadRequest field violations and
// RetryInfo.
import type * as grpc from '@grpc/grpc-js';

import { proto } from './protocol';
import type { Duration__Output } from './generated/google/protobuf/Duration';

const STATUS_DETAILS_KEY = 'grpc-status-details-bin';
const TYPE_URL_PREFIX = 'type.googleapis.com/';

export interface FieldViolation {
  /** The request field at fault, e.g. `namespace` or `event_ids[3]`. */
  field: string;
  description: string;
}

export interface StatusDetails {
  /** ErrorInfo.reason, e.g. `LEASE_LOST`; undefined when the status carried no ErrorInfo. */
  reason?: string;
  /** ErrorInfo.domain (`idempotency.v1` for the coordinator's own errors). */
  domain?: string;
  fieldViolations: FieldViolation[];
  /** RetryInfo.retry_delay in milliseconds, when the server said when to retry. */
  retryDelayMs?: number;
}

export function durationToMs(duration: Duration__Output | null | undefined): number {
  if (!duration) return 0;
  return Number(duration.seconds ?? 0) * 1000 + Math.round((duration.nanos ?? 0) / 1e6);
}

/**
 * Decodes the details of a failed call. Details that cannot be decoded (a proxy's own error,
 * a corrupt trailer) leave the result empty rather than hiding the status itself.
 */
export function readStatusDetails(metadata: grpc.Metadata | undefined): StatusDetails {
  const details: StatusDetails = { fieldViolations: [] };
  const raw = metadata?.get(STATUS_DETAILS_KEY)[0];
  if (!(raw instanceof Buffer)) return details;
  let status;
  try {
    status = proto.google.rpc.Status.deserialize(raw);
  } catch {
    return details;
  }
  for (const any of status.details) {
    const typeUrl = any.type_url ?? '';
    const value = any.value ?? Buffer.alloc(0);
    const typeName = typeUrl.startsWith(TYPE_URL_PREFIX)
      ? typeUrl.slice(TYPE_URL_PREFIX.length)
      : typeUrl;
    try {
      switch (typeName) {
        case 'google.rpc.ErrorInfo': {
          const info = proto.google.rpc.ErrorInfo.deserialize(value);
          details.reason = info.reason;
          details.domain = info.domain;
          break;
        }
        case 'google.rpc.BadRequest': {
          const badRequest = proto.google.rpc.BadRequest.deserialize(value);
          for (const violation of badRequest.fieldViolations) {
            details.fieldViolations.push({
              field: violation.field ?? '',
              description: violation.description ?? '',
            });
          }
          break;
        }
        case 'google.rpc.RetryInfo': {
          const retryInfo = proto.google.rpc.RetryInfo.deserialize(value);
          details.retryDelayMs = durationToMs(retryInfo.retryDelay);
          break;
        }
        default:
          // Other detail types are allowed by the rich error model; nothing here needs them.
          break;
      }
    } catch {
      // One undecodable detail must not cost the others.
    }
  }
  return details;
}
