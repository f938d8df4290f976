package dev.idempotency.client;

import org.eclipse.jetty.server.Server;
import org.eclipse.jetty.server.ServerConnector;

/** Jetty for the tests: a server that listens on loopback only, at a port picked when it starts. */
public final class LoopbackJetty {
  private LoopbackJetty() {}

  /**
   * A server with one connector on 127.0.0.1, port 0; give it a handler and start it.
   *
   * @return the server, not started
   */
  public static Server server() {
    Server server = new Server();
    ServerConnector connector = new ServerConnector(server);
    connector.setHost("127.0.0.1");
    connector.setPort(0);
    server.addConnector(connector);
    return server;
  }

  /**
   * The base URL of a started {@link #server()}.
   *
   * @param server the started server
   * @return {@code http://127.0.0.1:} and the port it listens on
   */
  public static String url(Server server) {
    return "http://127.0.0.1:" + ((ServerConnector) server.getConnectors()[0]).getLocalPort();
  }
}
