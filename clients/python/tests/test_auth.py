"""Tokens: the client sends its bearer token, and refusals come back as typed errors."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support import StartCoordinator, coordinator_binary, unique_key

from idempotency_client import IdempotencyClient, PermissionDenied, Unauthenticated


def new_token(scopes: str, tokens_file: Path) -> str:
    """Makes a token with `token new`, appends its line to the tokens file, returns the token."""
    printed = subprocess.run(
        [coordinator_binary(), "token", "new", "--name", "python-client-tests", "--scopes", scopes],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    lines = [line for line in printed.splitlines() if line and not line.startswith("#")]
    token, tokens_file_line = lines
    with tokens_file.open("a") as tokens:
        tokens.write(tokens_file_line + "\n")
    return token


def test_a_token_opens_its_scopes_and_only_those(
    start_coordinator: StartCoordinator, tmp_path: Path
) -> None:
    tokens_file = tmp_path / "tokens"
    token = new_token("orders-*", tokens_file)
    coordinator = start_coordinator("--tokens-file", str(tokens_file))
    ran: list[str] = []

    with IdempotencyClient(coordinator.address, token=token) as client:
        outcome = client.run_once("orders-eu", unique_key(), lambda lease: ran.append("orders"))
        with pytest.raises(PermissionDenied) as denied:
            client.run_once("payments", unique_key(), lambda lease: ran.append("payments"))
    with IdempotencyClient(coordinator.address) as anonymous, pytest.raises(Unauthenticated):
        anonymous.run_once("orders-eu", unique_key(), lambda lease: ran.append("anonymous"))

    assert not outcome.replayed
    assert ran == ["orders"]
    assert denied.value.reason == "PERMISSION_DENIED"
