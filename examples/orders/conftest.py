"""Prints the table of counts of every scenario that ran, and keeps it in .runs/last-table.md
(the README's table is copied from there)."""

from __future__ import annotations

from dataclasses import astuple, fields
from pathlib import Path

import pytest

from harness import HERE, ORDER_COUNT, RESULTS, Counts

HEADINGS = {
    "scenario": "scenario",
    "keys_sent": "keys sent",
    "http_attempts": "HTTP attempts",
    "orders_created": "orders created",
    "events_published": "events PUBLISHED",
    "events_republished": "events published again",
    "provider_keys_charged": "keys charged",
    "provider_calls": "provider calls",
    "provider_repeated_calls": "calls with a repeated key",
    "events_notified": "events notified",
    "notification_deliveries": "notification deliveries",
    "redeliveries_skipped": "redeliveries skipped",
}


def table(results: list[Counts]) -> str:
    names = [field.name for field in fields(Counts)]
    lines = [
        "| " + " | ".join(HEADINGS[name] for name in names) + " |",
        "|" + "|".join(" --- " if name == "scenario" else " ---: " for name in names) + "|",
    ]
    lines += ["| " + " | ".join(str(value) for value in astuple(row)) + " |" for row in results]
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RESULTS:
        return
    results = sorted(RESULTS, key=lambda row: row.scenario)
    text = table(results)
    terminalreporter.write_sep("=", f"counts per scenario ({ORDER_COUNT} orders each)")
    terminalreporter.write_line(text)
    runs = HERE / ".runs"
    runs.mkdir(exist_ok=True)
    Path(runs / "last-table.md").write_text(text + "\n")
