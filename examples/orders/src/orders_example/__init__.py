"""The orders example: an orders API, an outbox relay, a payments consumer and a notifications
consumer on the idempotency coordinator, PostgreSQL and RabbitMQ (see the README beside this
package)."""
