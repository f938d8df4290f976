package dev.idempotency.client.readme;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import dev.idempotency.client.Coordinator;
import dev.idempotency.client.IdempotencyClient;
import dev.idempotency.client.Outcome;
import dev.idempotency.client.SharedCoordinator;
import dev.idempotency.client.readme.ReadmeExamples.Charge;
import dev.idempotency.client.readme.ReadmeExamples.NumberedPayments;
import dev.idempotency.client.readme.ReadmeExamples.Order;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.MockConsumer;
import org.apache.kafka.common.TopicPartition;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;

/**
 * Keeps the documentation's Java true: every snippet of clients/java/README.md and the Java one
 * of docs/clients.md is in {@link ReadmeExamples} verbatim (so it compiles with the client as it
 * is), and each runs against the real coordinator, those that make their own client in a JVM of
 * their own whose environment has no {@code COORDINATOR_TOKEN}, as on a machine with a local
 * coordinator.
 */
class ReadmeExamplesTest {
  private static final Path JAVA_CLIENT = Coordinator.repoRoot().resolve("clients/java");
  private static final Path README = JAVA_CLIENT.resolve("README.md");
  private static final Path CLIENTS_PAGE = Coordinator.repoRoot().resolve("docs/clients.md");
  private static final Path EXAMPLES =
      JAVA_CLIENT.resolve("src/test/java/dev/idempotency/client/readme/ReadmeExamples.java");
  private static final ObjectMapper JSON = new ObjectMapper();

  @RegisterExtension
  static final SharedCoordinator COORDINATOR = new SharedCoordinator();

  @Test
  void everyJavaSnippetIsInReadmeExamplesVerbatim() throws IOException {
    List<String> source = Files.readAllLines(EXAMPLES, StandardCharsets.UTF_8);
    List<List<String>> snippets = new ArrayList<>(Snippets.of(README, "java"));
    assertEquals(3, snippets.size(), "the README's Java snippets (a new one needs its copy and its run here)");
    List<List<String>> page = Snippets.of(CLIENTS_PAGE, "java");
    assertEquals(1, page.size(), "docs/clients.md's Java snippets");
    snippets.addAll(page);
    for (List<String> snippet : snippets) {
      assertTrue(Snippets.indexIn(source, snippet) >= 0,
          "this snippet is not in ReadmeExamples.java verbatim:\n" + String.join("\n", snippet));
    }
  }

  @Test
  void theDependencyBlockNamesThisProject() throws IOException {
    String pom = Files.readString(JAVA_CLIENT.resolve("pom.xml"), StandardCharsets.UTF_8);
    String dependency = "<dependency>\n"
        + "  <groupId>" + first(pom, "groupId") + "</groupId>\n"
        + "  <artifactId>" + first(pom, "artifactId") + "</artifactId>\n"
        + "  <version>" + first(pom, "version") + "</version>\n"
        + "</dependency>";
    List<String> blocks = Snippets.of(README, "xml").stream().map(b -> String.join("\n", b)).toList();
    assertTrue(blocks.contains(dependency), "the README's dependency block is not\n" + dependency);
  }

  /** The project's own coordinate: the first of its elements in the pom (it has no parent). */
  private static String first(String pom, String element) {
    Matcher m = Pattern.compile("<" + element + ">([^<]+)</" + element + ">").matcher(pom);
    assertTrue(m.find(), "the pom has no " + element);
    return m.group(1);
  }

  /**
   * The README's handler and filter, in a JVM of their own whose environment gives the
   * coordinator's address and no token: the handler's repeated key is replayed and another order
   * under it refused 422; the filter's repeated request is replayed.
   */
  @Test
  void theExamplesThatMakeTheirOwnClientRunWithoutAToken() throws Exception {
    Path java = Path.of(System.getProperty("java.home"), "bin", "java");
    Path output = Files.createTempFile("readme-examples-", ".out");
    Path errors = Files.createTempFile("readme-examples-", ".log");
    Process process = null;
    try {
      ProcessBuilder example = new ProcessBuilder(java.toString(), "-cp", System.getProperty("java.class.path"),
          ReadmeExamples.class.getName()).redirectOutput(output.toFile()).redirectError(errors.toFile());
      example.environment().remove("COORDINATOR_TOKEN");
      example.environment().put("COORDINATOR_ADDRESS", COORDINATOR.get().address());
      process = example.start();
      process.getOutputStream().close();
      assertTrue(process.waitFor(60, TimeUnit.SECONDS), "the examples had not ended after 60 s");
      String out = Files.readString(output, StandardCharsets.UTF_8);
      String log = Files.readString(errors, StandardCharsets.UTF_8);
      assertEquals(0, process.exitValue(), "the examples failed:\n" + out + log);
      String[] lines = out.strip().split("\n");
      JsonNode report = JSON.readTree(lines[lines.length - 1]);

      assertEquals(200, report.get("first").get("status").asInt(), report.toString());
      assertEquals(JSON.writeValueAsString(new Charge("ch_1", 1250)), report.get("first").get("body").toString());
      assertEquals(report.get("first"), report.get("again"), "the repeated key replays the first answer");
      assertEquals(422, report.get("another_order").get("status").asInt(), report.toString());
      assertEquals(1, report.get("charges_made").asInt(), "charged once");

      assertEquals(201, report.get("filter_first").get("status").asInt(), report.toString());
      assertEquals("", report.get("filter_first").get("replayed").asText());
      assertEquals(201, report.get("filter_again").get("status").asInt());
      assertEquals(report.get("filter_first").get("body"), report.get("filter_again").get("body"));
      assertEquals("true", report.get("filter_again").get("replayed").asText());
      assertEquals(1, report.get("orders_created").asInt(), "the servlet ran once");
    } finally {
      if (process != null) {
        process.destroyForcibly();
      }
      Files.deleteIfExists(output);
      Files.deleteIfExists(errors);
    }
  }

  /**
   * The README's consumer, against Kafka's MockConsumer: a process that applied two records and
   * died before it committed them, and the consumer that gets them again with a third.
   */
  @Test
  void theConsumerExampleAppliesARedeliveredRecordOnce() {
    String topic = "shipments-" + UUID.randomUUID();
    List<String> shipped = new ArrayList<>();
    try (IdempotencyClient client = COORDINATOR.get().client()) {
      MockConsumer<String, String> died = consumer(topic, "box 1", "box 2");
      ReadmeExamples.consume(client, died, shipped::add);
      MockConsumer<String, String> next = consumer(topic, "box 1", "box 2", "box 3");
      ReadmeExamples.consume(client, next, shipped::add);
      assertEquals(List.of("box 1", "box 2", "box 3"), shipped, "each record's effect once");
      TopicPartition partition = new TopicPartition(topic, 0);
      assertEquals(3, next.committed(Set.of(partition)).get(partition).offset(), "the consumer committed");
    }
  }

  private static MockConsumer<String, String> consumer(String topic, String... values) {
    MockConsumer<String, String> consumer = new MockConsumer<>("earliest");
    TopicPartition partition = new TopicPartition(topic, 0);
    consumer.assign(List.of(partition));
    consumer.updateBeginningOffsets(Map.of(partition, 0L));
    for (int offset = 0; offset < values.length; offset++) {
      consumer.addRecord(new ConsumerRecord<>(topic, 0, offset, "key", values[offset]));
    }
    return consumer;
  }

  @Test
  void theClientsPageExampleReplays() throws IOException {
    try (IdempotencyClient client = COORDINATOR.get().client()) {
      NumberedPayments payments = new NumberedPayments();
      String key = "order-" + UUID.randomUUID();
      Order order = new Order("book", 1250);
      Outcome<Charge> first = ReadmeExamples.chargeAsInTheClientsPage(client, payments, key, order);
      Outcome<Charge> again = ReadmeExamples.chargeAsInTheClientsPage(client, payments, key, order);
      assertFalse(first.replayed());
      assertTrue(again.replayed());
      assertEquals(first.value(), again.value());
      assertEquals(1, payments.made.get());
    }
  }
}
