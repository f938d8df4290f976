package dev.idempotency.client;

/**
 * One bad field of a request, as the coordinator (or this client) named it: {@code event_ids[3]}
 * for an element.
 *
 * @param field the field's name
 * @param description what is wrong with it
 */
public record FieldViolation(String field, String description) {}
