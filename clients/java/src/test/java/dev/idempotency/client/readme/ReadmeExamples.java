package dev.idempotency.client.readme;

import static java.nio.charset.StandardCharsets.UTF_8;

import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import dev.idempotency.client.FingerprintMismatchException;
import dev.idempotency.client.IdempotencyClient;
import dev.idempotency.client.InProgressException;
import dev.idempotency.client.LoopbackJetty;
import dev.idempotency.client.Outcome;
import dev.idempotency.client.ResultCodec;
import dev.idempotency.client.ResultNotStoredException;
import dev.idempotency.client.RunOptions;
import dev.idempotency.client.servlet.IdempotencyFilter;
import jakarta.servlet.DispatcherType;
import jakarta.servlet.http.HttpServlet;
import jakarta.servlet.http.HttpServletRequest;
import jakarta.servlet.http.HttpServletResponse;
import java.io.IOException;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.EnumSet;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.UUID;
import java.util.concurrent.atomic.AtomicInteger;
import org.apache.kafka.clients.consumer.Consumer;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.eclipse.jetty.ee10.servlet.FilterHolder;
import org.eclipse.jetty.ee10.servlet.ServletContextHandler;
import org.eclipse.jetty.ee10.servlet.ServletHolder;
import org.eclipse.jetty.server.Server;

/**
 * Every Java snippet of clients/java/README.md, and the Java one of docs/clients.md, verbatim,
 * each in a method whose parameters, with the stand-ins below, give it the names it assumes (the
 * reader's handler, payment service, web framework). {@link ReadmeExamplesTest} fails when a
 * snippet differs from its copy here, and runs them: {@link #main} runs those that make their own
 * client from the environment, in a JVM of its own, as a reader's program would.
 */
public final class ReadmeExamples {
  private ReadmeExamples() {}

  // ---------------------------------------------------------------------------------------
  // The reader's own code, reduced to what the snippets use.

  /** What is charged. */
  public record Order(String item, long cents) {}

  /** A charge made. */
  public record Charge(String id, long cents) {}

  /** The reader's payment service. */
  public interface Payments {
    /**
     * Charges an order, with the claim's fencing token (README).
     *
     * @param order the order
     * @param leaseToken the fencing token
     * @return the charge
     * @throws IOException when the payment provider cannot be reached
     */
    Charge charge(Order order, long leaseToken) throws IOException;

    /**
     * Charges an order (docs/clients.md).
     *
     * @param order the order
     * @return the charge
     * @throws IOException when the payment provider cannot be reached
     */
    Charge charge(Order order) throws IOException;
  }

  /** The reader's shipping service. */
  public interface Shipping {
    /**
     * Ships what a record says.
     *
     * @param what the record's value
     */
    void ship(String what);
  }

  /** The reader's web framework's answer: a status, a body, headers. */
  public record Response(int status, Object body, Map<String, Object> headers) {
    Response header(String name, Object value) {
      Map<String, Object> more = new LinkedHashMap<>(headers);
      more.put(name, value);
      return new Response(status, body, more);
    }
  }

  static Response ok(Object body) {
    return new Response(200, body, Map.of());
  }

  static Response status(int status) {
    return new Response(status, null, Map.of());
  }

  // ---------------------------------------------------------------------------------------
  // The snippets.

  /** README, "Example": a handler. */
  static Response charge(Payments payments, String idempotencyKey, Order order) throws IOException {
    // COORDINATOR_TOKEN unset (a coordinator without --tokens-file, on loopback): no token is sent
    try (IdempotencyClient coordinator = IdempotencyClient.builder(
            System.getenv().getOrDefault("COORDINATOR_ADDRESS", "127.0.0.1:50051"))
            .token(System.getenv("COORDINATOR_TOKEN")).build()) {
        RunOptions wait5s = RunOptions.builder().maxWait(Duration.ofSeconds(5)).build();
        try {
            Outcome<Charge> charge = coordinator.runOnce("payments", idempotencyKey, order,
                ResultCodec.json(Charge.class), wait5s,
                lease -> payments.charge(order, lease.token()));   // at most once; interrupted if the lease is lost
            return ok(charge.value());                               // charge.replayed(): true for a replay
        } catch (InProgressException busy) {                         // still running elsewhere after 5 s
            return status(409).header("Retry-After", Math.max(1, busy.retryAfter().toSeconds()));
        } catch (FingerprintMismatchException reused) {              // the key was used for another order
            return status(422);
        } catch (ResultNotStoredException lost) {                    // it ran; only the record is missing
            return ok(lost.result(Charge.class));
        }
    }
  }

  /** README, "runOnce": a consumer that applies each record's effect once. */
  static void consume(IdempotencyClient coordinator, Consumer<String, String> consumer, Shipping shipping) {
    for (ConsumerRecord<String, String> record : consumer.poll(Duration.ofSeconds(1))) {
        String eventId = record.topic() + "/" + record.partition() + "/" + record.offset();
        coordinator.processOnce("shipping-consumer", eventId, record.value().getBytes(UTF_8),
            ResultCodec.json(Boolean.class), RunOptions.defaults(),
            lease -> { shipping.ship(record.value()); return true; });   // a redelivery replays `true`
    }
    consumer.commitSync();
  }

  /** README, "The filter": registered in Jetty; answers the client, which the application closes. */
  static IdempotencyClient registerFilter(ServletContextHandler context) {
    IdempotencyClient coordinator = IdempotencyClient.builder(
            System.getenv().getOrDefault("COORDINATOR_ADDRESS", "127.0.0.1:50051"))
        .token(System.getenv("COORDINATOR_TOKEN"))
        .retryBudget(Duration.ofSeconds(2)).build();                 // the gateway's --coordinator-retry
    IdempotencyFilter filter = IdempotencyFilter.builder(coordinator, "orders")
        .maxWait(Duration.ofSeconds(5)).build();
    context.addFilter(new FilterHolder(filter), "/orders/*", EnumSet.of(DispatcherType.REQUEST));  // Jetty
    // Spring Boot: new FilterRegistrationBean<>(filter); web.xml: ConfiguredIdempotencyFilter (below)
    return coordinator;
  }

  /** docs/clients.md, "Java". */
  static Outcome<Charge> chargeAsInTheClientsPage(
      IdempotencyClient coordinator, Payments payments, String idempotencyKey, Order order) throws IOException {
    Outcome<Charge> charge = coordinator.runOnce("payments", idempotencyKey, order,
        ResultCodec.json(Charge.class), RunOptions.builder().maxWait(Duration.ofSeconds(5)).build(),
        lease -> payments.charge(order));   // InProgressException → 409, FingerprintMismatchException → 422
    return charge;
  }

  // ---------------------------------------------------------------------------------------
  // Running the snippets that make their own client, as a program of the reader's would.

  /** Payments that number the charges they make. */
  static final class NumberedPayments implements Payments {
    final AtomicInteger made = new AtomicInteger();

    @Override
    public Charge charge(Order order, long leaseToken) {
      return new Charge("ch_" + made.incrementAndGet(), order.cents());
    }

    @Override
    public Charge charge(Order order) {
      return charge(order, 0);
    }
  }

  /** An API that numbers the orders it creates. */
  static final class Orders extends HttpServlet {
    private static final long serialVersionUID = 1L;
    final AtomicInteger created = new AtomicInteger();

    @Override
    protected void doPost(HttpServletRequest request, HttpServletResponse response) throws IOException {
      request.getInputStream().readAllBytes();
      response.setStatus(201);
      response.setContentType("application/json");
      response.getWriter().write("{\"order\":" + created.incrementAndGet() + "}");
    }
  }

  /**
   * Runs the README's handler (a key twice, then with another order) and its filter in Jetty (one
   * request twice), against the coordinator at {@code COORDINATOR_ADDRESS}, with {@code
   * COORDINATOR_TOKEN} as the environment has it, and prints what they answered as one line of
   * JSON for {@link ReadmeExamplesTest}.
   *
   * @param args none
   * @throws Exception when an example fails
   */
  public static void main(String[] args) throws Exception {
    ObjectMapper json = new ObjectMapper();
    ObjectNode report = json.createObjectNode();

    NumberedPayments payments = new NumberedPayments();
    String key = "order-" + UUID.randomUUID();
    report.set("first", json.valueToTree(charge(payments, key, new Order("book", 1250))));
    report.set("again", json.valueToTree(charge(payments, key, new Order("book", 1250))));
    report.set("another_order", json.valueToTree(charge(payments, key, new Order("pen", 300))));
    report.put("charges_made", payments.made.get());

    Server server = LoopbackJetty.server();
    ServletContextHandler context = new ServletContextHandler();
    Orders orders = new Orders();
    context.addServlet(new ServletHolder(orders), "/orders/*");
    IdempotencyClient coordinator = registerFilter(context);
    try {
      server.setHandler(context);
      server.start();
      HttpClient http = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();
      HttpRequest post = HttpRequest.newBuilder(URI.create(LoopbackJetty.url(server) + "/orders/new"))
          .header("Content-Type", "application/json").header("Idempotency-Key", UUID.randomUUID().toString())
          .POST(HttpRequest.BodyPublishers.ofString("{\"item\":\"book\"}")).build();
      for (String name : new String[] {"filter_first", "filter_again"}) {
        HttpResponse<String> answer = http.send(post, HttpResponse.BodyHandlers.ofString());
        ObjectNode seen = report.putObject(name);
        seen.put("status", answer.statusCode());
        seen.put("body", answer.body());
        seen.put("replayed", answer.headers().firstValue(IdempotencyFilter.REPLAYED_HEADER).orElse(""));
      }
      report.put("orders_created", orders.created.get());
    } finally {
      server.stop();
      coordinator.close();
    }
    System.out.println(report);
  }
}
