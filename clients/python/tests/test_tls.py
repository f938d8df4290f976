"""TLS: the client verifies the coordinator's certificate against the roots it is given."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme
from support import StartCoordinator, unique_key

from idempotency_client import IdempotencyClient, RetryPolicy, TlsConfig, Unavailable


def test_a_tls_client_trusts_only_the_roots_it_is_given(
    start_coordinator: StartCoordinator, tmp_path: Path
) -> None:
    authority = trustme.CA()
    certificate = authority.issue_cert("127.0.0.1")
    certificate_file, key_file = tmp_path / "server.pem", tmp_path / "server.key"
    certificate.cert_chain_pems[0].write_to_path(str(certificate_file))
    certificate.private_key_pem.write_to_path(str(key_file))
    coordinator = start_coordinator(
        "--tls-cert",
        str(certificate_file),
        "--tls-key",
        str(key_file),
        tls_roots=authority.cert_pem.bytes(),
    )

    trusting = TlsConfig(root_certificates=authority.cert_pem.bytes())
    with IdempotencyClient(coordinator.address, tls=trusting) as client:
        outcome = client.run_once("orders", unique_key(), lambda lease: "over tls")
    assert (outcome.value, outcome.replayed) == ("over tls", False)

    stranger = TlsConfig(root_certificates=trustme.CA().cert_pem.bytes())
    no_retries = RetryPolicy(total=0)
    with (
        IdempotencyClient(coordinator.address, tls=stranger, retry=no_retries) as client,
        pytest.raises(Unavailable) as refused,
    ):
        client.run_once("orders", unique_key(), lambda lease: "never")
    # The handshake failed: the coordinator never saw the call.
    assert "handshake" in refused.value.message.lower()
