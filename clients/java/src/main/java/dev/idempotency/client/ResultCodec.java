package dev.idempotency.client;

import com.fasterxml.jackson.core.type.TypeReference;
import com.fasterxml.jackson.databind.JavaType;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.util.Objects;

/**
 * How {@code runOnce} stores a result as the key's response, and reads it back for a replay.
 *
 * @param <T> the result's type
 */
public interface ResultCodec<T> {
  /**
   * The result as stored.
   *
   * @param value the work's result
   * @return its bytes
   * @throws Exception when it cannot be encoded (the key is then released)
   */
  byte[] encode(T value) throws Exception;

  /**
   * A stored result.
   *
   * @param stored the bytes stored
   * @return the result
   * @throws Exception when they cannot be decoded
   */
  T decode(byte[] stored) throws Exception;

  /**
   * Results as compact JSON (no HTML escaping), as the other clients store them.
   *
   * @param <T> the result's type
   * @param type the result's class
   * @return the codec
   */
  static <T> ResultCodec<T> json(Class<T> type) {
    return json(Json.MAPPER, Json.MAPPER.constructType(type));
  }

  /**
   * Results of a generic type as compact JSON.
   *
   * @param <T> the result's type
   * @param type the result's type, e.g. {@code new TypeReference<List<Charge>>() {}}
   * @return the codec
   */
  static <T> ResultCodec<T> json(TypeReference<T> type) {
    return json(Json.MAPPER, Json.MAPPER.constructType(type));
  }

  /**
   * Results as JSON written and read by this mapper (with your modules).
   *
   * @param <T> the result's type
   * @param mapper the mapper
   * @param type the result's type
   * @return the codec
   */
  static <T> ResultCodec<T> json(ObjectMapper mapper, JavaType type) {
    Objects.requireNonNull(mapper, "mapper");
    Objects.requireNonNull(type, "type");
    return new ResultCodec<>() {
      @Override
      public byte[] encode(T value) throws IOException {
        return mapper.writeValueAsBytes(value);
      }

      @Override
      public T decode(byte[] stored) throws IOException {
        return mapper.readValue(stored, type);
      }
    };
  }

  /**
   * Results that are bytes already, stored as they are.
   *
   * @return the codec
   */
  static ResultCodec<byte[]> bytes() {
    return new ResultCodec<>() {
      @Override
      public byte[] encode(byte[] value) {
        return Objects.requireNonNull(value, "the result");
      }

      @Override
      public byte[] decode(byte[] stored) {
        return stored;
      }
    };
  }

  /**
   * Results that are text, stored as UTF-8.
   *
   * @return the codec
   */
  static ResultCodec<String> utf8() {
    return new ResultCodec<>() {
      @Override
      public byte[] encode(String value) {
        return value.getBytes(StandardCharsets.UTF_8);
      }

      @Override
      public String decode(byte[] stored) {
        return new String(stored, StandardCharsets.UTF_8);
      }
    };
  }
}

/** The mapper of the JSON codecs: Jackson's defaults (compact, no HTML escaping). */
final class Json {
  static final ObjectMapper MAPPER = new ObjectMapper();

  private Json() {}
}
