package dev.idempotency.client;

import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ChannelCredentials;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.ClientInterceptors;
import io.grpc.ForwardingClientCall;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import io.grpc.TlsChannelCredentials;
import java.io.ByteArrayInputStream;
import java.io.IOException;

/** The connection of a client: the channel it makes for a target, and the token on every call. */
final class Channels {
  private static final Metadata.Key<String> AUTHORIZATION =
      Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER);
  /** The largest answer accepted: the coordinator's largest response limit and its margin. */
  private static final int MAX_INBOUND_BYTES = 64 * 1024 * 1024 + 64 * 1024;

  private Channels() {}

  /**
   * How a client made for a target connects: plaintext, or TLS with these roots (null: the
   * system's) and, for mutual TLS, this client certificate (null: none).
   */
  record Security(boolean tls, byte[] trustedCertificates, byte[] clientCertificateChain, byte[] clientPrivateKey) {}

  /**
   * A channel to {@code target}; nothing is connected yet (the first call connects).
   *
   * @throws IllegalArgumentException for certificates or a key that do not parse
   */
  static ManagedChannel open(String target, Security security) {
    ChannelCredentials credentials = InsecureChannelCredentials.create();
    if (security.tls()) {
      TlsChannelCredentials.Builder creds = TlsChannelCredentials.newBuilder();
      try {
        if (security.trustedCertificates() != null) {
          creds.trustManager(new ByteArrayInputStream(security.trustedCertificates()));
        }
        if (security.clientCertificateChain() != null) {
          creds.keyManager(new ByteArrayInputStream(security.clientCertificateChain()),
              new ByteArrayInputStream(security.clientPrivateKey()));
        }
      } catch (IOException | IllegalArgumentException e) {
        throw Validation.invalid("tls", "the certificates or key cannot be read: " + e.getMessage());
      }
      credentials = creds.build();
    }
    return Grpc.newChannelBuilder(target, credentials).maxInboundMessageSize(MAX_INBOUND_BYTES).build();
  }

  /** The channel, sending {@code authorization: Bearer <token>} with every call when there is a token. */
  static Channel withToken(Channel channel, String token) {
    return token == null ? channel : ClientInterceptors.intercept(channel, bearer(token));
  }

  private static ClientInterceptor bearer(String token) {
    String value = "Bearer " + token;
    return new ClientInterceptor() {
      @Override
      public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> method, CallOptions options, Channel next) {
        return new ForwardingClientCall.SimpleForwardingClientCall<>(next.newCall(method, options)) {
          @Override
          public void start(Listener<R> listener, Metadata headers) {
            headers.put(AUTHORIZATION, value);
            super.start(listener, headers);
          }
        };
      }
    };
  }
}
