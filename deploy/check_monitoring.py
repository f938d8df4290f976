#!/usr/bin/env python3
"""Checks deploy/'s monitoring files against what the service exports (Python 3.11, stdlib only).

- Every PromQL query of the Grafana dashboard (panels and template variables) and of the
  Prometheus rules names only metrics the service exports: those of docs/metrics.md's tables,
  plus the gauges the service gains before the doc lists them (PENDING_GAUGES). A histogram is
  queried through its `_bucket`, `_sum` and `_count` series, never its bare name.
- Every exported metric is shown by some panel of the dashboard.
- The dashboard is valid JSON and its panel ids (rows' nested panels included) are unique.
- The dashboard's queries parse: promtool checks them as recording rules, the Grafana variables
  replaced by plain values (the rules file promtool checks itself, in deploy/test.sh).
- Every alert's unit tests bite (with --mutate-alerts): with the alert's expression replaced by
  one that never fires, `promtool test rules` must fail on that alert; replaced by one that always
  fires, it must fail on a test that expects that alert quiet.

Usage: check_monitoring.py [--mutate-alerts]. Prints every problem found and exits 1 if any.
"""

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
METRICS_DOC = DEPLOY.parent / "docs" / "metrics.md"
RULES = DEPLOY / "prometheus" / "idempotency-rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "idempotency-rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "idempotency-coordinator.json"

# Gauges the service is gaining (the stuck-key stats) before docs/metrics.md lists them. Once the
# doc lists one, it is taken from there and this entry is only a reminder to remove it.
PENDING_GAUGES: tuple[str, ...] = ()

# A row of docs/metrics.md's metric tables: | `name` | type | ...
METRIC_ROW = re.compile(
    r"^\|\s*`([a-zA-Z_:][a-zA-Z0-9_:]*)`\s*\|\s*(counter|gauge|histogram|summary)\s*\|", re.M
)

SERIES_SUFFIXES = {
    "counter": ("",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


class CheckError(Exception):
    """A monitoring file that cannot be read or checked at all."""


def exported_metrics(metrics_doc: str) -> dict[str, str]:
    """Metric name -> type, from the doc's tables plus PENDING_GAUGES."""
    metrics = {name: kind for name, kind in METRIC_ROW.findall(metrics_doc)}
    if not metrics:
        raise CheckError("docs/metrics.md: no metric table rows (| `name` | type | ...) found")
    for name in PENDING_GAUGES:
        metrics.setdefault(name, "gauge")
    return metrics


def pending_gauges_documented(metrics_doc: str) -> list[str]:
    documented = {name for name, _ in METRIC_ROW.findall(metrics_doc)}
    return [name for name in PENDING_GAUGES if name in documented]


def series_of(metrics: dict[str, str]) -> dict[str, str]:
    """Series name as queried -> the metric it belongs to."""
    return {
        name + suffix: name for name, kind in metrics.items() for suffix in SERIES_SUFFIXES[kind]
    }


# --- PromQL: the metric names a query selects ----------------------------------------------------

_STRING = r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'
_TOKEN = re.compile(
    rf"""
      (?P<string>{_STRING})
    | (?P<matchers>\{{(?:{_STRING}|[^}}"'`])*\}})
    | (?P<range>\[[^\]]*\])
    | (?P<number>0[xX][0-9a-fA-F]+|\d[\w.]*|\.\d[\w.]*)
    | (?P<variable>\$\{{?\w+(?::\w+)?\}}?)
    | (?P<identifier>[a-zA-Z_:][a-zA-Z0-9_:]*)
    | (?P<comment>\#[^\n]*)
    | (?P<space>\s+)
    | (?P<punctuation>.)
    """,
    re.X | re.S,
)
# Followed by a parenthesised list of label names, not of expressions.
_LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_OTHER_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}


def metric_names(promql: str) -> set[str]:
    """The metric names a PromQL expression selects. Raises CheckError on what it cannot read."""
    tokens = [
        (m.lastgroup, m.group())
        for m in _TOKEN.finditer(promql)
        if m.lastgroup not in ("space", "comment")
    ]
    names = set()
    position = 0
    while position < len(tokens):
        kind, text = tokens[position]
        following = tokens[position + 1][1] if position + 1 < len(tokens) else None
        if kind == "matchers" and re.search(r"\b__name__\s*[=!]", text):
            raise CheckError(f"selects a metric through __name__ (name it instead): {promql!r}")
        if kind == "variable":
            raise CheckError(
                f"a Grafana variable outside a string or a range cannot be checked: {text} in "
                f"{promql!r}"
            )
        if kind == "identifier":
            keyword = text.lower()
            if keyword in _LABEL_LIST_KEYWORDS:
                if following == "(":
                    position = _after_closing_parenthesis(tokens, position + 1, promql)
                    continue
            elif (
                keyword in _OTHER_KEYWORDS
                or following == "("
                or (following or "").lower() in ("by", "without")
            ):
                pass  # an operator, a number, a function, an aggregation (`sum by (x) (...)`)
            else:
                names.add(text)
        position += 1
    return names


def _after_closing_parenthesis(tokens, opening: int, promql: str) -> int:
    for position in range(opening, len(tokens)):
        if tokens[position][1] == ")":
            return position + 1
    raise CheckError(f"unclosed label list: {promql!r}")


# --- Where the queries are ------------------------------------------------------------------------


def rule_expressions(rules_yaml: str) -> list[tuple[str, str]]:
    """(rule name, expression) of each rule, from the plain layout idempotency-rules.yml keeps:
    `- alert: Name` or `- record: name`, then `expr: |` and an indented block (or `expr: <one
    line>`). Refuses a file where the count of rules and of expressions read differ."""
    lines = rules_yaml.splitlines()
    rules = []
    name = None
    for number, line in enumerate(lines):
        rule_start = re.match(r"\s*- (?:alert|record):\s*(\S+)\s*$", line)
        if rule_start:
            name = rule_start.group(1)
            continue
        expression = re.match(r"(\s*)expr:\s*(.*)$", line)
        if not expression or name is None:
            continue
        indent, inline = len(expression.group(1)), expression.group(2).strip()
        if inline in ("|", "|-", ">", ">-"):
            block = []
            for following in lines[number + 1 :]:
                if following.strip() and len(following) - len(following.lstrip()) <= indent:
                    break
                block.append(following.strip())
            text = (" " if inline.startswith(">") else "\n").join(block).strip()
        else:
            text = inline.strip("'\"")
        rules.append((name, text))
        name = None
    declared = len(re.findall(r"^\s*- (?:alert|record):", rules_yaml, re.M))
    if declared == 0 or declared != len(rules):
        raise CheckError(
            f"rules file: {declared} rules declared, {len(rules)} expressions read: "
            "keep one `expr:` per rule in the plain layout"
        )
    return rules


def all_panels(panels: list) -> list[dict]:
    """Panels, with those nested in (collapsed) rows."""
    found = []
    for panel in panels:
        found.append(panel)
        found.extend(all_panels(panel.get("panels", [])))
    return found


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and template variable query."""
    queries = []
    for panel in all_panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            where = f"panel {panel.get('id')} ({panel.get('title')!r}) target {target.get('refId')}"
            if "expr" not in target:
                raise CheckError(f"{where}: no `expr`: only Prometheus queries can be checked")
            queries.append((where, target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else query or ""
        queries.extend(
            (f"variable ${variable.get('name')}", promql) for promql in _variable_promql(text)
        )
    return queries


def _variable_promql(query: str) -> list[str]:
    """The PromQL inside a Grafana Prometheus variable query."""
    label_values = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*\w+\s*\)\s*", query, re.S)
    if label_values:
        return [label_values.group(1)]
    if re.fullmatch(r"\s*label_values\(\s*\w+\s*\)\s*", query):
        return []
    query_result = re.fullmatch(r"\s*query_result\(\s*(.+)\)\s*", query, re.S)
    if query_result:
        return [query_result.group(1)]
    raise CheckError(f"a variable query of a form this check does not read: {query!r}")


def load_dashboard(text: str) -> dict:
    try:
        dashboard = json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckError(f"dashboard: not valid JSON: {error}") from None
    if not isinstance(dashboard, dict) or not isinstance(dashboard.get("panels"), list):
        raise CheckError("dashboard: not a Grafana dashboard (an object with a `panels` list)")
    return dashboard


# --- The checks ----------------------------------------------------------------------------------


def unexported_names(queries: list[tuple[str, str]], series: dict[str, str]) -> list[str]:
    problems = []
    for where, promql in queries:
        try:
            names = metric_names(promql)
        except CheckError as error:
            problems.append(f"{where}: {error}")
            continue
        if not names:
            problems.append(f"{where}: names no metric: {promql!r}")
        for name in sorted(names - series.keys()):
            problems.append(
                f"{where}: {name} is not a metric the service exports (docs/metrics.md)"
            )
    return problems


def metrics_not_shown(
    dashboard_queries_: list[tuple[str, str]], metrics: dict[str, str], series: dict[str, str]
) -> list[str]:
    shown = set()
    for _, promql in dashboard_queries_:
        with contextlib.suppress(CheckError):  # reported by unexported_names
            shown |= {series[name] for name in metric_names(promql) if name in series}
    return [f"dashboard: no panel shows {name}" for name in sorted(metrics.keys() - shown)]


def duplicate_panel_ids(dashboard: dict) -> list[str]:
    seen: dict[int, str] = {}
    problems = []
    for panel in all_panels(dashboard["panels"]):
        panel_id, title = panel.get("id"), panel.get("title")
        if not isinstance(panel_id, int) or isinstance(panel_id, bool):
            problems.append(f"dashboard: panel {title!r} has no integer id")
        elif panel_id in seen:
            problems.append(
                f"dashboard: panel id {panel_id} used by {seen[panel_id]!r} and {title!r}"
            )
        else:
            seen[panel_id] = title
    return problems


def grafana_variables_replaced(promql: str) -> str:
    """The query as Prometheus would get it: intervals become 5m, other variables `.*`."""
    promql = re.sub(r"\$\{?__\w+\}?", "5m", promql)
    return re.sub(r"\$\{?\w+(?::\w+)?\}?", ".*", promql)


def unparsable_queries(queries: list[tuple[str, str]]) -> list[str]:
    """Queries promtool refuses, checked as recording rules of a throwaway rules file."""
    rules = [
        {"record": f"dashboard_query:{index}", "expr": grafana_variables_replaced(promql)}
        for index, (_, promql) in enumerate(queries)
    ]
    with tempfile.TemporaryDirectory() as directory:
        rules_file = Path(directory) / "dashboard-queries.yml"
        # JSON is YAML: no YAML library needed.
        rules_file.write_text(
            json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}, indent=1)
        )
        result = subprocess.run(
            ["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True
        )
    if result.returncode == 0:
        return []
    output = (result.stdout + result.stderr).strip()
    problems = []
    for index, (where, promql) in enumerate(queries):
        if f'"dashboard_query:{index}"' in output:
            problems.append(f"{where}: promtool refuses the query {promql!r}")
    problems.append(
        "promtool check rules on the dashboard's queries failed:\n    "
        + output.replace("\n", "\n    ")
    )
    return problems


# --- Do the alerts' tests bite? ------------------------------------------------------------------

NEVER_FIRES = "vector(0) > 1"
ALWAYS_FIRES = "vector(1)"


def with_expression_replaced(rules_yaml: str, alert: str, expression: str) -> str:
    """The rules file with one alert's `expr` (block or line) replaced by a one-line expression."""
    lines = rules_yaml.splitlines()
    start = next(
        (
            n
            for n, line in enumerate(lines)
            if re.fullmatch(rf"\s*- alert:\s*{re.escape(alert)}\s*", line)
        ),
        None,
    )
    if start is None:
        raise CheckError(f"rules file: no alert {alert}")
    expr_line = next(n for n in range(start + 1, len(lines)) if re.match(r"\s*expr:", lines[n]))
    indent = len(lines[expr_line]) - len(lines[expr_line].lstrip())
    end = expr_line + 1
    while end < len(lines) and (
        not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent
    ):
        end += 1
    replaced = [*lines[:expr_line], " " * indent + f"expr: {expression}", *lines[end:]]
    return "\n".join(replaced) + "\n"


def run_rule_tests(
    rules_yaml: str, rules_path: Path, tests_path: Path
) -> subprocess.CompletedProcess:
    """`promtool test rules` on the tests, against the given text of the rules file."""
    with tempfile.TemporaryDirectory() as directory:
        shutil.copy(tests_path, Path(directory) / tests_path.name)
        (Path(directory) / rules_path.name).write_text(rules_yaml)
        return subprocess.run(
            ["promtool", "test", "rules", tests_path.name],
            cwd=directory,
            capture_output=True,
            text=True,
        )


def alerts_whose_tests_do_not_bite(
    rules_path: Path, tests_path: Path, only: list[str] | None = None
) -> list[str]:
    """Every alert of the file (or those named), broken both ways, must fail its unit tests."""
    rules_yaml = rules_path.read_text()
    problems = []
    alerts = only or re.findall(r"^\s*- alert:\s*(\S+)\s*$", rules_yaml, re.M)
    if not alerts:
        raise CheckError(f"{rules_path}: no alerts")
    for alert in alerts:
        never = run_rule_tests(
            with_expression_replaced(rules_yaml, alert, NEVER_FIRES), rules_path, tests_path
        )
        if never.returncode == 0 or f"alertname: {alert}," not in never.stdout + never.stderr:
            problems.append(
                f"{alert}: no test fails when it never fires (no test expects it to fire)"
            )
        always = run_rule_tests(
            with_expression_replaced(rules_yaml, alert, ALWAYS_FIRES), rules_path, tests_path
        )
        expected_quiet_failed = re.search(
            rf"alertname: {re.escape(alert)}, time: [^,]+, \s*exp:\[\],",
            always.stdout + always.stderr,
        )
        if always.returncode == 0 or not expected_quiet_failed:
            problems.append(
                f"{alert}: no test fails when it always fires (no test expects it quiet)"
            )
    return problems


# --- Main ----------------------------------------------------------------------------------------


def check(metrics_doc: Path, rules: Path, dashboard_path: Path) -> list[str]:
    metrics_text = metrics_doc.read_text()
    metrics = exported_metrics(metrics_text)
    series = series_of(metrics)
    for name in pending_gauges_documented(metrics_text):
        print(f"check_monitoring: note: docs/metrics.md lists {name}: drop it from PENDING_GAUGES")

    dashboard = load_dashboard(dashboard_path.read_text())
    dashboard_queries_ = dashboard_queries(dashboard)
    rule_queries = [(f"rule {name}", expr) for name, expr in rule_expressions(rules.read_text())]

    return (
        duplicate_panel_ids(dashboard)
        + unexported_names(rule_queries + dashboard_queries_, series)
        + metrics_not_shown(dashboard_queries_, metrics, series)
        + unparsable_queries(dashboard_queries_)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--metrics-doc", type=Path, default=METRICS_DOC)
    parser.add_argument("--rules", type=Path, default=RULES)
    parser.add_argument("--rule-tests", type=Path, default=RULE_TESTS)
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument(
        "--mutate-alerts",
        action="store_true",
        help="also check that every alert's unit tests fail when the alert is broken",
    )
    arguments = parser.parse_args()
    try:
        problems = check(arguments.metrics_doc, arguments.rules, arguments.dashboard)
        if arguments.mutate_alerts:
            problems += alerts_whose_tests_do_not_bite(arguments.rules, arguments.rule_tests)
    except (CheckError, OSError) as error:
        problems = [str(error)]
    for problem in problems:
        print(f"check_monitoring: {problem}", file=sys.stderr)
    if problems:
        print(f"check_monitoring: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(
        "check_monitoring: the dashboard's and the rules' queries name only exported metrics, "
        "every metric has a panel, panel ids are unique"
        + (", every alert's tests bite" if arguments.mutate_alerts else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
