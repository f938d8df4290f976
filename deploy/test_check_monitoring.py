"""Tests of check_monitoring.py: each check refuses what it exists to refuse, on broken copies of
the real files (run by deploy/test.sh: `python3 -m unittest test_check_monitoring`)."""

import json
import tempfile
import unittest
from pathlib import Path

import check_monitoring as cm

METRICS_TEXT = cm.METRICS_DOC.read_text()
RULES_TEXT = cm.RULES.read_text()
DASHBOARD_TEXT = cm.DASHBOARD.read_text()


class MetricNames(unittest.TestCase):
    def test_metrics_not_labels_functions_keywords_strings_or_durations(self):
        promql = """
            histogram_quantile(0.99, sum by (le, m) (rate(a_bucket{x="b_c",y=~"d|e"}[5m])))
            / on (instance) group_left (version) sum without (pod) (b_total offset 1h @ start())
            > bool 0.5 and ignoring (z) topk(3, c) or count_values("label", d)
            unless e{le="+Inf"} > Inf  # f, a comment
        """
        self.assertEqual(cm.metric_names(promql), {"a_bucket", "b_total", "c", "d", "e"})

    def test_aggregation_with_trailing_grouping_and_subquery(self):
        promql = "max(max_over_time(f[30m:1m])) by (job) - min(g) without (instance)"
        self.assertEqual(cm.metric_names(promql), {"f", "g"})

    def test_keywords_are_case_insensitive_metric_names_are_not(self):
        self.assertEqual(cm.metric_names("SUM BY (x) (h) AND On(y) Sum(i)"), {"h", "i"})

    def test_grafana_variables_inside_strings_and_ranges_are_fine(self):
        self.assertEqual(cm.metric_names('rate(j{job=~"$job"}[$__rate_interval])'), {"j"})

    def test_refuses_what_it_cannot_check(self):
        for promql in ('{__name__="k"}', "$metric", "sum by (x"):
            with self.subTest(promql=promql), self.assertRaises(cm.CheckError):
                cm.metric_names(promql)


class ExportedMetrics(unittest.TestCase):
    def test_reads_both_tables_of_the_doc_and_adds_the_pending_gauges(self):
        metrics = cm.exported_metrics(METRICS_TEXT)
        self.assertEqual(metrics["grpc_server_handling_seconds"], "histogram")
        self.assertEqual(metrics["idempotency_try_start_total"], "counter")
        self.assertEqual(metrics["idempotency_held_key_reruns_total"], "counter")
        for name in cm.PENDING_GAUGES:
            self.assertEqual(metrics[name], "gauge")

    def test_a_histogram_is_queried_through_its_series_only(self):
        series = cm.series_of(cm.exported_metrics(METRICS_TEXT))
        self.assertIn("grpc_server_handling_seconds_bucket", series)
        self.assertIn("idempotency_store_seconds_count", series)
        self.assertNotIn("grpc_server_handling_seconds", series)
        self.assertNotIn("idempotency_waiters_bucket", series)

    def test_a_doc_without_tables_is_refused(self):
        with self.assertRaises(cm.CheckError):
            cm.exported_metrics("# Metrics\n\nNone.\n")


class Rules(unittest.TestCase):
    def test_reads_every_rule_of_the_real_file(self):
        rules = dict(cm.rule_expressions(RULES_TEXT))
        self.assertEqual(len(rules), RULES_TEXT.count("- alert:"))
        self.assertEqual(rules["IdempotencyStuckKeysPilingUp"], "max(idempotency_stuck_keys) > 100")
        self.assertIn('grpc_code=~"Unavailable', rules["IdempotencyHighErrorRatio"])
        self.assertTrue(rules["IdempotencyHighErrorRatio"].endswith("> 0.01"))

    def assert_only_problem(self, old: str, new: str, problem: str) -> None:
        """The rules with `old` replaced by `new` have one problem, `problem`."""
        self.assertEqual(check_files(rules=RULES_TEXT.replace(old, new)), [problem])

    def test_a_misspelled_metric_in_a_rule_is_reported(self):
        self.assert_only_problem(
            "max(idempotency_stuck_keys)",
            "max(idempotency_stuck_key)",
            "rule IdempotencyStuckKeysPilingUp: idempotency_stuck_key is not a "
            "metric the service exports (docs/metrics.md)",
        )

    def test_a_bare_histogram_name_in_a_rule_is_reported(self):
        self.assert_only_problem(
            "grpc_server_handling_seconds_bucket{",
            "grpc_server_handling_seconds{",
            "rule IdempotencyHighLatencyP99: grpc_server_handling_seconds is not a metric the "
            "service exports (docs/metrics.md)",
        )

    def test_a_layout_it_cannot_read_is_refused(self):
        flow_style = RULES_TEXT.replace(
            "        expr: |\n          max(idempotency_waiters) > 8000\n",
            "        {expr: max(idempotency_waiters) > 8000}\n",
        )
        self.assertNotEqual(flow_style, RULES_TEXT)
        with self.assertRaises(cm.CheckError):
            cm.rule_expressions(flow_style)

    def test_replacing_an_expression_touches_that_alert_only(self):
        replaced = cm.with_expression_replaced(
            RULES_TEXT, "IdempotencyHighErrorRatio", cm.NEVER_FIRES
        )
        before, after = dict(cm.rule_expressions(RULES_TEXT)), dict(cm.rule_expressions(replaced))
        self.assertEqual(after.pop("IdempotencyHighErrorRatio"), cm.NEVER_FIRES)
        before.pop("IdempotencyHighErrorRatio")
        self.assertEqual(after, before)

    def test_an_alert_without_a_quiet_test_is_reported(self):
        quiet_test = "  - name: waiters below the mark do not fire, even many replicas' together\n"
        self.assert_bite_problem(
            quiet_test,
            "IdempotencyWaitersNearLimit: no test fails when it always fires "
            "(no test expects it quiet)",
        )

    def test_an_alert_without_a_firing_test_is_reported(self):
        firing_test = "  - name: more than 8000 waiters on one replica for 5 minutes fire\n"
        self.assert_bite_problem(
            firing_test,
            "IdempotencyWaitersNearLimit: no test fails when it never fires "
            "(no test expects it to fire)",
        )

    def assert_bite_problem(self, removed_test_start: str, problem: str) -> None:
        """With the test starting so removed, the mutation check of IdempotencyWaitersNearLimit
        says `problem`, and only it."""
        alert = "IdempotencyWaitersNearLimit"
        self.assertEqual(self.bite_problems(alert, removed_test_start), [problem])

    @staticmethod
    def bite_problems(alert: str, removed_test_start: str) -> list[str]:
        """What the mutation check says of one alert once the test starting so is removed."""
        tests = cm.RULE_TESTS.read_text()
        start = tests.index(removed_test_start)
        end = tests.index("\n  - name: ", start + 1) + 1
        with tempfile.TemporaryDirectory() as directory:
            tests_path, rules_path = (
                Path(directory) / cm.RULE_TESTS.name,
                Path(directory) / cm.RULES.name,
            )
            tests_path.write_text(tests[:start] + tests[end:])
            rules_path.write_text(RULES_TEXT)
            return cm.alerts_whose_tests_do_not_bite(rules_path, tests_path, only=[alert])


class Dashboard(unittest.TestCase):
    def test_the_real_files_pass(self):
        self.assertEqual(check_files(), [])

    def test_a_misspelled_metric_in_a_panel_is_reported(self):
        broken = DASHBOARD_TEXT.replace(
            "idempotency_reaped_rows_total", "idempotency_reaped_row_total"
        )
        self.assertEqual(
            check_files(dashboard=broken),
            [
                "panel 35 ('Rows reaped') target A: idempotency_reaped_row_total is not a metric "
                "the service exports (docs/metrics.md)",
                "dashboard: no panel shows idempotency_reaped_rows_total",
            ],
        )

    def test_a_misspelled_metric_in_a_variable_query_is_reported(self):
        broken = DASHBOARD_TEXT.replace(
            "label_values(idempotency_health_status, job)", "label_values(idempotency_health, job)"
        )
        self.assertIn(
            "variable $job: idempotency_health is not a metric the service exports "
            "(docs/metrics.md)",
            check_files(dashboard=broken),
        )

    def test_a_metric_without_a_panel_is_reported(self):
        dashboard = json.loads(DASHBOARD_TEXT)
        dashboard["panels"] = [
            panel for panel in dashboard["panels"] if panel.get("title") != "Log lines dropped"
        ]
        self.assertEqual(
            check_files(dashboard=json.dumps(dashboard)),
            ["dashboard: no panel shows idempotency_log_lines_dropped_total"],
        )

    def test_duplicate_panel_ids_are_reported_nested_ones_too(self):
        dashboard = json.loads(DASHBOARD_TEXT)
        dashboard["panels"][0]["panels"] = [{"id": 3, "title": "nested", "type": "text"}]
        self.assertEqual(
            check_files(dashboard=json.dumps(dashboard)),
            ["dashboard: panel id 3 used by 'nested' and 'Replicas not serving'"],
        )

    def test_invalid_json_is_refused(self):
        with self.assertRaises(cm.CheckError):
            check_files(dashboard=DASHBOARD_TEXT.rstrip().rstrip("}"))

    def test_a_query_promtool_cannot_parse_is_reported(self):
        broken = DASHBOARD_TEXT.replace(
            '"max(idempotency_tokens_loaded{job=~\\"$job\\"})"',
            '"max(idempotency_tokens_loaded{job=~\\"$job\\"}"',
        )
        self.assertNotEqual(broken, DASHBOARD_TEXT)
        problems = check_files(dashboard=broken)
        self.assertTrue(
            problems[0].startswith("panel 7 ('Tokens in force') target A: promtool refuses"),
            problems,
        )

    def test_a_target_of_another_datasource_is_refused(self):
        dashboard = json.loads(DASHBOARD_TEXT)
        dashboard["panels"][1]["targets"] = [{"refId": "A", "rawSql": "select 1"}]
        with self.assertRaises(cm.CheckError):
            check_files(dashboard=json.dumps(dashboard))


def check_files(rules=RULES_TEXT, dashboard=DASHBOARD_TEXT):
    """check_monitoring.check on the real metrics doc and the given rules and dashboard texts."""
    with tempfile.TemporaryDirectory() as directory:
        rules_path, dashboard_path = (
            Path(directory) / "rules.yml",
            Path(directory) / "dashboard.json",
        )
        rules_path.write_text(rules)
        dashboard_path.write_text(dashboard)
        return cm.check(cm.METRICS_DOC, rules_path, dashboard_path)


if __name__ == "__main__":
    unittest.main()
