"""Renders reference/patroni.yml for one node of the failover suite: every ${NAME} of the
reference and of the suite's changes (suite-patroni.yml) from the environment, then the changes
merged over the reference, printed as YAML. A name the environment lacks, or one left in the
result, is an error: the suite must never run a configuration the reference does not describe.

Run by deploy/ha/test.sh with the system's python3 (Patroni's own, which has PyYAML).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import yaml

PLACEHOLDER = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)\}")


def render(path: str) -> Any:
    with open(path, encoding="utf-8") as file:
        text = file.read()

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise SystemExit(f"{path}: ${{{name}}} is not set in the environment")
        return os.environ[name]

    return yaml.safe_load(PLACEHOLDER.sub(value, text))


def merged(base: Any, changes: Any) -> Any:
    """`changes` over `base`: mappings merged key by key, anything else replaced."""
    if isinstance(base, dict) and isinstance(changes, dict):
        result = dict(base)
        for key, change in changes.items():
            result[key] = merged(base[key], change) if key in base else change
        return result
    return changes


def main() -> None:
    reference, changes = sys.argv[1], sys.argv[2]
    configuration = merged(render(reference), render(changes))
    text = yaml.safe_dump(configuration, sort_keys=False)
    if "${" in text:
        raise SystemExit(f"a placeholder is left in the rendered configuration:\n{text}")
    sys.stdout.write(f"# Rendered by deploy/ha/test.sh from {reference} and {changes}.\n{text}")


if __name__ == "__main__":
    main()
