package dev.idempotency.client.servlet;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import dev.idempotency.client.Coordinator;
import dev.idempotency.client.IdempotencyClient;
import dev.idempotency.client.KeyState;
import dev.idempotency.client.LoopbackJetty;
import dev.idempotency.client.SharedCoordinator;
import dev.idempotency.client.readme.Snippets;
import java.io.IOException;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.Comparator;
import java.util.List;
import java.util.UUID;
import java.util.stream.Stream;
import org.eclipse.jetty.ee10.servlet.ServletHolder;
import org.eclipse.jetty.ee10.webapp.WebAppContext;
import org.eclipse.jetty.server.Server;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;

/**
 * {@link ConfiguredIdempotencyFilter} deployed as a container deploys a web application: Jetty's
 * WebAppContext reads WEB-INF/web.xml, makes the filter from its class name with its no-argument
 * constructor and hands it its init-params. The web.xml holds the README's fragment, verbatim but
 * for the coordinator's address.
 */
class WebXmlTest {
  private static final Path README = Coordinator.repoRoot().resolve("clients/java/README.md");
  private static final String README_COORDINATOR = "http://127.0.0.1:50051";

  @RegisterExtension
  static final SharedCoordinator COORDINATOR = new SharedCoordinator();

  /** The README's web.xml fragment: the xml block that declares the filter. */
  private static String readmeFragment() throws IOException {
    List<String> fragments = Snippets.of(README, "xml").stream().map(b -> String.join("\n", b))
        .filter(b -> b.contains("<filter-class>")).toList();
    assertEquals(1, fragments.size(), "the README's web.xml fragments");
    String fragment = fragments.get(0);
    assertEquals(fragment.indexOf(README_COORDINATOR), fragment.lastIndexOf(README_COORDINATOR),
        "the fragment names the coordinator once");
    assertTrue(fragment.contains(README_COORDINATOR), "the fragment names the coordinator at " + README_COORDINATOR);
    return fragment;
  }

  /** A web application of this web.xml content and the orders servlet, served on a free port. */
  private record WebApp(Server server, String url, FilterTest.Orders orders, Path dir) implements AutoCloseable {
    static WebApp deploy(String webXmlContent) throws Exception {
      Path dir = Files.createTempDirectory("idc-java-webapp-");
      Files.createDirectories(dir.resolve("WEB-INF"));
      Files.writeString(dir.resolve("WEB-INF/web.xml"), "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
          + "<web-app xmlns=\"https://jakarta.ee/xml/ns/jakartaee\" version=\"6.0\">\n" + webXmlContent
          + "\n</web-app>\n", StandardCharsets.UTF_8);
      Server server = LoopbackJetty.server();
      WebAppContext context = new WebAppContext();
      context.setContextPath("/");
      context.setWar(dir.toString());
      context.setParentLoaderPriority(true); // the client and the filter come from the test's class path
      context.setThrowUnavailableOnStartupException(true); // a filter that fails init fails the deployment
      FilterTest.Orders orders = new FilterTest.Orders();
      context.addServlet(new ServletHolder(orders), "/*"); // every path: the filter guards /orders/* only
      server.setHandler(context);
      try {
        server.start();
      } catch (Exception e) {
        server.stop();
        deleteTree(dir);
        throw e;
      }
      return new WebApp(server, LoopbackJetty.url(server), orders, dir);
    }

    @Override
    public void close() throws IOException {
      try {
        server.stop();
      } catch (Exception e) {
        throw new IllegalStateException(e);
      } finally {
        deleteTree(dir);
      }
    }

    private static void deleteTree(Path dir) throws IOException {
      try (Stream<Path> files = Files.walk(dir)) {
        for (Path f : files.sorted(Comparator.reverseOrder()).toList()) {
          Files.delete(f);
        }
      }
    }
  }

  @Test
  void theReadmesWebXmlDeclaresTheFilterByItsClassAndInitParams() throws Exception {
    String webXml = readmeFragment().replace(README_COORDINATOR, "http://" + COORDINATOR.get().address());
    try (WebApp app = WebApp.deploy(webXml); IdempotencyClient client = COORDINATOR.get().client()) {
      String key = UUID.randomUUID().toString();
      String body = "{\"item\":\"book\"}";
      HttpResponse<String> first = FilterTest.post(app.url() + "/orders/new", key, body);
      assertEquals(201, first.statusCode(), first.body());
      assertTrue(first.body().contains("\"lease_token\":\""), "the servlet ran under a claim: " + first.body());
      HttpResponse<String> again = FilterTest.post(app.url() + "/orders/new", key, body);
      assertEquals(201, again.statusCode());
      assertEquals(first.body(), again.body());
      assertEquals("true", again.headers().firstValue("idempotent-replayed").orElse(""));
      assertEquals(1, app.orders().created.get(), "the servlet ran once");
      // In the namespace of the init-param; outside the filter's mapping, requests pass through.
      assertInstanceOf(KeyState.Completed.class, client.lookup("orders", key));
      assertEquals(201, FilterTest.post(app.url() + "/elsewhere", key, body).statusCode());
      assertEquals(2, app.orders().created.get());
    }
  }

  @Test
  void aMisspeltInitParamFailsTheDeployment() throws Exception {
    String webXml = readmeFragment().replace(README_COORDINATOR, "http://" + COORDINATOR.get().address())
        .replace("<param-name>wait</param-name>", "<param-name>wiat</param-name>");
    Exception refused = assertThrows(Exception.class, () -> WebApp.deploy(webXml).close());
    StringBuilder messages = new StringBuilder();
    for (Throwable t = refused; t != null; t = t.getCause()) {
      messages.append(t).append('\n');
    }
    assertTrue(messages.toString().contains("unknown init-params [wiat]"), messages.toString());
  }

  @Test
  void durationsAreWrittenAsTheGatewayWritesThem() {
    assertEquals(Duration.ofMillis(500), ConfiguredIdempotencyFilter.duration("wait", "500ms"));
    assertEquals(Duration.ofSeconds(5), ConfiguredIdempotencyFilter.duration("wait", " 5s "));
    assertEquals(Duration.ofMinutes(90), ConfiguredIdempotencyFilter.duration("wait", "1h30m"));
    assertEquals(Duration.ofDays(30), ConfiguredIdempotencyFilter.duration("wait", "30d"));
    for (String wrong : List.of("", "5", "s", "5 s", "-1s", "1.5s", "5sec", "5s 3", "99999999999999999999s",
        "9223372036854775807d")) {
      assertThrows(IllegalArgumentException.class, () -> ConfiguredIdempotencyFilter.duration("wait", wrong), wrong);
    }
  }
}
