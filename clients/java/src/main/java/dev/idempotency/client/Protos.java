package dev.idempotency.client;

import com.google.protobuf.ByteString;
import com.google.protobuf.Timestamp;
import dev.idempotency.v1.LookupResponse;
import dev.idempotency.v1.TryStartResponse;
import java.time.Duration;
import java.time.Instant;
import java.util.Optional;

/** Conversions between the generated messages and the Java types of the API. */
final class Protos {
  private Protos() {}

  static com.google.protobuf.Duration duration(Duration d) {
    return com.google.protobuf.Duration.newBuilder().setSeconds(d.getSeconds()).setNanos(d.getNano()).build();
  }

  /** An instant from the coordinator; null when absent. */
  static Instant instant(Timestamp ts, boolean present) {
    return present ? Instant.ofEpochSecond(ts.getSeconds(), ts.getNanos()) : null;
  }

  static Claim claim(TryStartResponse answer, String attemptId) {
    switch (answer.getOutcomeCase()) {
      case STARTED: {
        var s = answer.getStarted();
        Optional<byte[]> checkpoint = s.hasCheckpoint() ? Optional.of(s.getCheckpoint().toByteArray()) : Optional.empty();
        return new Claim.Started(
            s.getLeaseToken(),
            Integer.toUnsignedLong(s.getAttempt()),
            instant(s.getLeaseExpiresAt(), s.hasLeaseExpiresAt()),
            checkpoint,
            attemptId);
      }
      case IN_PROGRESS: {
        var p = answer.getInProgress();
        return new Claim.InProgress(instant(p.getLeaseExpiresAt(), p.hasLeaseExpiresAt()), Integer.toUnsignedLong(p.getAttempt()));
      }
      case COMPLETED: {
        var c = answer.getCompleted();
        return new Claim.Completed(
            c.getResponse().toByteArray(),
            instant(c.getCompletedAt(), c.hasCompletedAt()),
            instant(c.getExpiresAt(), c.hasExpiresAt()));
      }
      case FINGERPRINT_MISMATCH:
        return new Claim.FingerprintMismatch();
      default:
        return null; // An outcome this client does not know; the caller reports it.
    }
  }

  static KeyState keyState(LookupResponse answer) {
    switch (answer.getStateCase()) {
      case IN_PROGRESS: {
        var p = answer.getInProgress();
        return new KeyState.InProgress(
            instant(p.getLeaseExpiresAt(), p.hasLeaseExpiresAt()),
            Integer.toUnsignedLong(p.getAttempt()),
            p.getFingerprint().toByteArray());
      }
      case COMPLETED: {
        var c = answer.getCompleted();
        return new KeyState.Completed(
            c.getResponse().toByteArray(),
            c.getFingerprint().toByteArray(),
            instant(c.getCompletedAt(), c.hasCompletedAt()),
            instant(c.getExpiresAt(), c.hasExpiresAt()));
      }
      default:
        return new KeyState.Absent();
    }
  }

  static ByteString bytes(byte[] b) {
    return b == null ? ByteString.EMPTY : ByteString.copyFrom(b);
  }
}
