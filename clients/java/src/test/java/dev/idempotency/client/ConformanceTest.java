package dev.idempotency.client;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assumptions.assumeTrue;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.IOException;
import java.math.BigDecimal;
import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.stream.Stream;
import org.junit.jupiter.api.DynamicTest;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestFactory;

/** The client against the shared vectors of clients/conformance. */
class ConformanceTest {
  private static final Path CONFORMANCE = Coordinator.repoRoot().resolve("clients/conformance");
  private static final ObjectMapper JSON = new ObjectMapper();

  @Test
  void theDefaultsAreTheSharedOnes() throws IOException {
    JsonNode d = JSON.readTree(CONFORMANCE.resolve("defaults.json").toFile());
    assertEquals(Duration.ofMillis(d.get("call_timeout_ms").asLong()), Defaults.CALL_TIMEOUT);
    JsonNode retry = d.get("retry");
    RetryPolicy p = Defaults.RETRY_POLICY;
    assertEquals(Duration.ofMillis(retry.get("budget_ms").asLong()), p.budget());
    assertEquals(Duration.ofMillis(retry.get("initial_backoff_ms").asLong()), p.initialBackoff());
    assertEquals(Duration.ofMillis(retry.get("max_backoff_ms").asLong()), p.maxBackoff());
    assertEquals(retry.get("multiplier").asDouble(), p.multiplier());
    assertEquals(retry.get("jitter_low_fraction").asDouble(), p.jitterLowFraction());
    assertEquals(Duration.ofMillis(d.get("lease_ttl_ms").asLong()), Defaults.LEASE_TTL);
    assertEquals(d.get("heartbeat_divisor").asInt(), Defaults.HEARTBEAT_DIVISOR);
    assertEquals(Duration.ofMillis(d.get("wait_ms").asLong()), Defaults.WAIT);
    // Every field of the file is compared above: a new one must be added here too.
    List<String> fields = new ArrayList<>();
    d.fieldNames().forEachRemaining(fields::add);
    assertEquals(List.of("call_timeout_ms", "retry", "lease_ttl_ms", "heartbeat_divisor", "wait_ms"), fields);
  }

  /** Every vector of fingerprints.json through the fingerprint path of JSON texts. */
  @TestFactory
  Stream<DynamicTest> everyFingerprintVector() throws IOException {
    Path file = CONFORMANCE.resolve("fingerprints.json");
    assumeTrue(Files.exists(file), "no fingerprints.json yet");
    JsonNode cases = JSON.readTree(file.toFile()).get("cases");
    List<DynamicTest> tests = new ArrayList<>();
    for (JsonNode c : cases) {
      String input = c.get("input").asText();
      tests.add(DynamicTest.dynamicTest(c.get("name").asText(), () -> {
        if (c.has("error")) {
          CanonicalJsonException e = assertThrows(CanonicalJsonException.class, () -> Fingerprints.ofJsonText(input));
          assertEquals(c.get("error").asText(), e.kind().code(), e.getMessage());
        } else {
          byte[] canonical = Fingerprints.canonicalJsonText(input);
          assertEquals(c.get("canonical").asText(), new String(canonical, StandardCharsets.UTF_8));
          assertEquals(c.get("sha256").asText(), HexFormat.of().formatHex(Fingerprints.ofJsonText(input)));
          // The value path agrees with the text path wherever Jackson reads the text as it is.
          if (!input.contains("\\u") && !input.equals("null") && !c.get("name").asText().contains("integer beyond")) {
            Object value = JSON.readValue(input, Object.class);
            assertArrayEquals(Fingerprints.of(value), Fingerprints.ofJsonText(input), "value path");
          }
        }
      }));
    }
    return tests.stream();
  }

  @Test
  void valuesAreCanonicalisedAsTheirJsonText() {
    Map<String, Object> order = new LinkedHashMap<>();
    order.put("z", List.of(3, 1.5, "x"));
    order.put("a", Map.of("n", 1e21, "m", -0.0));
    assertEquals("{\"a\":{\"m\":0,\"n\":1e+21},\"z\":[3,1.5,\"x\"]}",
        new String(Fingerprints.canonicalJson(order), StandardCharsets.UTF_8));
    record Charge(String currency, long cents) {}
    assertEquals("{\"cents\":1250,\"currency\":\"EUR\"}",
        new String(Fingerprints.canonicalJson(new Charge("EUR", 1250)), StandardCharsets.UTF_8));
    assertArrayEquals(Fingerprints.ofJsonText("{\"currency\":\"EUR\",\"cents\":1250}"),
        Fingerprints.of(new Charge("EUR", 1250)));
  }

  @Test
  void unsafeIntegersAndNonFiniteNumbersAreRefused() {
    assertEquals(CanonicalJsonException.Kind.UNSAFE_INTEGER,
        assertThrows(CanonicalJsonException.class, () -> Fingerprints.of(Map.of("n", 1L << 53))).kind());
    assertEquals(CanonicalJsonException.Kind.UNSAFE_INTEGER,
        assertThrows(CanonicalJsonException.class, () -> Fingerprints.of(BigInteger.TEN.pow(20))).kind());
    assertEquals(CanonicalJsonException.Kind.UNSAFE_INTEGER,
        assertThrows(CanonicalJsonException.class, () -> Fingerprints.of(new BigDecimal("1E+20"))).kind());
    assertEquals(CanonicalJsonException.Kind.NUMBER_OUT_OF_RANGE,
        assertThrows(CanonicalJsonException.class, () -> Fingerprints.of(List.of(Double.NaN))).kind());
    assertEquals(CanonicalJsonException.Kind.LONE_SURROGATE,
        assertThrows(CanonicalJsonException.class, () -> Fingerprints.of("a\ud800")).kind());
    assertEquals("9007199254740991", new String(Fingerprints.canonicalJson(Fingerprints.MAX_SAFE_INTEGER),
        StandardCharsets.UTF_8));
    assertEquals(32, Fingerprints.of(new byte[] {1, 2}).length);
    assertEquals(0, Fingerprints.of(null).length);
  }

  @Test
  void numbersAreWrittenAsEcmaScriptDoes() {
    String[][] cases = {
      {"5e-324", "5e-324"}, {"1.7976931348623157e308", "1.7976931348623157e+308"}, {"0.1", "0.1"},
      {"123456789012345680000", "123456789012345680000"}, {"1e-7", "1e-7"}, {"0.000001", "0.000001"},
      {"2.82879384806159e17", "282879384806159000"}, {"1.2e-6", "0.0000012"}, {"9.5e20", "950000000000000000000"},
      {"4.35", "4.35"}, {"0.5", "0.5"}, {"100", "100"}, {"123e-20", "1.23e-18"},
    };
    for (String[] c : cases) {
      assertEquals(c[1], Fingerprints.ecmaScriptNumber(Double.parseDouble(c[0])), c[0]);
    }
  }
}
