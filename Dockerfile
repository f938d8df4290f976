# The service's image: built in a Rust image, run from a distroless one that holds the binary
# and nothing else (glibc and CA certificates only: no shell, no package manager), as a non-root
# user. The protos are compiled by protox, in Rust: no protoc is needed.
#   docker build -t idempotency-coordinator .
FROM rust:1.94-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin idempotency-coordinator

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/idempotency-coordinator /usr/local/bin/idempotency-coordinator
# gRPC API; the metrics port (--metrics-listen) is 9464 by convention.
EXPOSE 50051 9464
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/idempotency-coordinator"]
CMD ["serve"]
