package dev.idempotency.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import dev.idempotency.client.Coordinator.Store;
import dev.idempotency.client.Coordinator.Token;
import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.UUID;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.io.TempDir;

/**
 * The client against a coordinator that wants a bearer token, TLS, or mutual TLS (SQLite: the
 * store plays no part), with certificates made by {@link TestPki}.
 */
class SecurityTest {
  @TempDir
  static Path dir;
  private static TestPki pki;

  @BeforeAll
  static void makeCertificates() {
    pki = TestPki.create(dir);
  }

  /** A client with no retries: a refusal is final, and a failed handshake need not be waited for. */
  private static IdempotencyClient oneTry(IdempotencyClient.Builder builder) {
    return builder.retryBudget(Duration.ZERO).callTimeout(Duration.ofSeconds(5)).build();
  }

  private static String runOnce(IdempotencyClient client, String namespace) {
    return client.runOnce(namespace, "k-" + UUID.randomUUID(), "request", ResultCodec.utf8(), RunOptions.defaults(),
        lease -> "ran with token " + lease.token()).value();
  }

  private static void assertRan(String result) {
    assertTrue(result.startsWith("ran with token "), result);
  }

  @Test
  void aBearerTokenIsNeededAndItsScopesAreKept() throws IOException {
    Token all = Coordinator.newToken("all", "*");
    Token payments = Coordinator.newToken("payments", "payments-*");
    Path tokens = Files.writeString(dir.resolve("tokens"), all.line() + "\n" + payments.line() + "\n");
    try (Coordinator coordinator = Coordinator.start(Store.SQLITE, b -> b.token(all.secret()),
        "--tokens-file", tokens.toString())) {
      try (IdempotencyClient client = coordinator.client()) {
        assertRan(runOnce(client, "jobs"));
      }
      try (IdempotencyClient anonymous = oneTry(IdempotencyClient.builder(coordinator.address()))) {
        UnauthenticatedException e = assertThrows(UnauthenticatedException.class, () -> runOnce(anonymous, "jobs"));
        assertEquals("UNAUTHENTICATED", e.reason().orElseThrow());
      }
      // token(null), what token(System.getenv(...)) gives for an unset variable, sends no token;
      // a null after a token takes it back.
      try (IdempotencyClient unset = oneTry(IdempotencyClient.builder(coordinator.address()).token(all.secret())
          .token(null))) {
        assertThrows(UnauthenticatedException.class, () -> runOnce(unset, "jobs"));
      }
      try (IdempotencyClient guessed = oneTry(IdempotencyClient.builder(coordinator.address())
          .token("idc_" + "0".repeat(64)))) {
        assertThrows(UnauthenticatedException.class, () -> guessed.lookup("jobs", "k"));
      }
      try (IdempotencyClient scoped = oneTry(IdempotencyClient.builder(coordinator.address())
          .token(payments.secret()))) {
        assertRan(runOnce(scoped, "payments-eu"));
        assertThrows(PermissionDeniedException.class, () -> runOnce(scoped, "jobs"));
      }
    }
  }

  @Test
  void tlsWithTheTrustedCa() {
    byte[] ca = TestPki.read(pki.cert("ca"));
    try (Coordinator coordinator = Coordinator.start(Store.SQLITE, b -> b.trustedCertificates(ca),
        "--tls-cert", pki.cert("server").toString(), "--tls-key", pki.key("server").toString())) {
      try (IdempotencyClient client = coordinator.client()) {
        assertRan(runOnce(client, "jobs"));
      }
      // TLS trusting only the system's roots does not get through; nor does plaintext (grpc-java
      // reads the server's TLS alert as an HTTP/2 frame: INTERNAL, without a reason).
      try (IdempotencyClient systemRoots = oneTry(IdempotencyClient.builder(coordinator.address())
          .useTransportSecurity())) {
        assertThrows(UnavailableException.class, () -> systemRoots.lookup("jobs", "k"));
      }
      try (IdempotencyClient plaintext = oneTry(IdempotencyClient.builder(coordinator.address()))) {
        IdempotencyException e = assertThrows(IdempotencyException.class, () -> plaintext.lookup("jobs", "k"));
        assertTrue(e.reason().isEmpty(), e.toString());
      }
    }
  }

  @Test
  void mutualTlsWantsTheClientsCertificate() {
    byte[] ca = TestPki.read(pki.cert("ca"));
    byte[] chain = TestPki.read(pki.cert("client"));
    byte[] key = TestPki.read(pki.key("client"));
    try (Coordinator coordinator = Coordinator.start(Store.SQLITE,
        b -> b.trustedCertificates(ca).clientCertificate(chain, key),
        "--tls-cert", pki.cert("server").toString(), "--tls-key", pki.key("server").toString(),
        "--tls-client-ca", pki.cert("ca").toString())) {
      try (IdempotencyClient client = coordinator.client()) {
        assertRan(runOnce(client, "jobs"));
      }
      try (IdempotencyClient noCertificate = oneTry(IdempotencyClient.builder(coordinator.address())
          .trustedCertificates(ca))) {
        IdempotencyException e = assertThrows(IdempotencyException.class, () -> noCertificate.lookup("jobs", "k"));
        assertInstanceOf(UnavailableException.class, e, e.toString());
      }
    }
  }
}
