package dev.idempotency.client;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;

/**
 * A throwaway certificate authority made with {@code openssl} in a folder of the test's: the CA, a
 * server certificate for 127.0.0.1 and a client certificate, each with its PKCS#8 key (EC P-256),
 * valid for two days.
 */
public final class TestPki {
  private final Path dir;

  private TestPki(Path dir) {
    this.dir = dir;
  }

  /** Makes the CA and both certificates in {@code dir}. */
  public static TestPki create(Path dir) {
    TestPki pki = new TestPki(dir);
    openssl("req", "-x509", "-new", "-key", pki.key("ca").toString(), "-subj", "/CN=idempotency test CA",
        "-days", "2", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", pki.cert("ca").toString());
    pki.issue("server", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n");
    pki.issue("client", "/CN=idempotency test client", "extendedKeyUsage=clientAuth\n");
    return pki;
  }

  /** The PEM certificate of "ca", "server" or "client". */
  public Path cert(String name) {
    return dir.resolve(name + ".pem");
  }

  /** The PKCS#8 PEM key of "ca", "server" or "client". */
  public Path key(String name) {
    Path key = dir.resolve(name + ".key");
    if (!Files.exists(key)) {
      openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", key.toString());
    }
    return key;
  }

  /** A file's bytes, for the client builder. */
  public static byte[] read(Path file) {
    try {
      return Files.readAllBytes(file);
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
  }

  private void issue(String name, String subject, String extensions) {
    Path csr = dir.resolve(name + ".csr");
    Path ext = dir.resolve(name + ".ext");
    try {
      Files.writeString(ext, "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n" + extensions,
          StandardCharsets.UTF_8);
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
    openssl("req", "-new", "-key", key(name).toString(), "-subj", subject, "-out", csr.toString());
    openssl("x509", "-req", "-in", csr.toString(), "-CA", cert("ca").toString(), "-CAkey", key("ca").toString(),
        "-set_serial", Long.toString(System.nanoTime()), "-days", "2", "-extfile", ext.toString(),
        "-out", cert(name).toString());
  }

  private static void openssl(String... args) {
    List<String> command = new ArrayList<>(List.of("openssl"));
    command.addAll(List.of(args));
    try {
      Process p = new ProcessBuilder(command).redirectErrorStream(true).start();
      String out = new String(p.getInputStream().readAllBytes(), StandardCharsets.UTF_8);
      if (p.waitFor() != 0) {
        throw new IllegalStateException(String.join(" ", command) + " failed:\n" + out);
      }
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      throw new IllegalStateException(e);
    }
  }
}
