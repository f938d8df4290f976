package dev.idempotency.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.IOException;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.List;
import java.util.Set;

/**
 * clients/conformance/scenarios.json, read strictly: a field the runner ({@link ScenariosTest})
 * does not know, a step with none or several actions, or an expectation where none belongs fails
 * the suite, rather than being skipped or misread.
 */
final class ScenarioVectors {
  private static final List<String> ACTIONS = List.of("run", "await_started", "open_gate", "join", "fault", "refuse",
      "restore", "reset", "await_calls", "expect_calls", "claim", "pause_ms", "expect_key");
  private static final Set<String> ERROR_KINDS = Set.of("mismatch", "in_progress", "lease_lost", "result_not_stored",
      "unavailable", "unauthenticated", "work_failed", "other");

  /** Every scenario of the file, checked. */
  static List<JsonNode> load(Path path) throws IOException {
    JsonNode file = new ObjectMapper().readTree(path.toFile());
    only(file, "the file", "scenarios");
    List<JsonNode> scenarios = new ArrayList<>();
    Set<String> names = new HashSet<>();
    for (JsonNode scenario : file.path("scenarios")) {
      only(scenario, "a scenario", "name", "what", "client", "steps");
      String name = scenario.path("name").asText("");
      assertTrue(!name.isEmpty() && names.add(name), "a scenario without a name, or a name twice: " + name);
      only(scenario.path("client"), name + ": client", "retry_budget_ms");
      assertTrue(scenario.path("steps").size() > 0, name + ": no steps");
      int n = 0;
      for (JsonNode step : scenario.get("steps")) {
        check(step, name + ", step " + ++n);
      }
      scenarios.add(scenario);
    }
    assertFalse(scenarios.isEmpty(), "scenarios.json holds no scenario");
    return scenarios;
  }

  /** Refuses a step this runner would misread: an unknown field, none or several actions, a misplaced expect. */
  private static void check(JsonNode step, String where) {
    List<String> allowed = new ArrayList<>(ACTIONS);
    allowed.add("expect");
    only(step, where, allowed.toArray(String[]::new));
    assertEquals(1, ACTIONS.stream().filter(step::has).count(), where + ": a step has one action");
    for (String flag : List.of("refuse", "restore", "reset")) {
      assertTrue(!step.has(flag) || step.get(flag).asBoolean(false), where + ": " + flag + " is true when given");
    }
    boolean wantsExpect = step.has("join") || step.has("run") && !step.get("run").has("as");
    assertEquals(wantsExpect, step.has("expect"), where + ": a run without as, and a join, have an expect; nothing else has");
    if (step.has("run")) {
      JsonNode run = step.get("run");
      only(run, where + ": run", "as", "key", "request", "wait_ms", "lease_ttl_ms", "work");
      assertTrue(run.path("key").isTextual() && run.has("request"), where + ": a run has a key and a request");
      only(run.path("work"), where + ": work", "result", "fail", "gate", "until_cancelled", "duration_ms",
          "refuse_at_end");
      assertTrue(run.path("work").has("result") != run.path("work").has("fail"), where + ": a work has a result or fail");
      JsonNode duration = run.path("work").path("duration_ms");
      assertTrue(duration.isMissingNode() || duration.isInt() && duration.asInt() > 0,
          where + ": a work's duration_ms is a positive integer: " + duration);
    }
    if (step.has("claim")) {
      JsonNode claim = step.get("claim");
      only(claim, where + ": claim", "key", "request", "lease_ttl_ms");
      assertTrue(claim.path("key").isTextual() && claim.has("request") && claim.path("lease_ttl_ms").isInt(),
          where + ": a claim has a key, a request and a lease_ttl_ms");
    }
    assertTrue(!step.has("pause_ms") || step.get("pause_ms").isInt() && step.get("pause_ms").asInt() > 0,
        where + ": pause_ms is a positive integer");
    if (step.has("expect")) {
      JsonNode expect = step.get("expect");
      only(expect, where + ": expect", "result", "error", "carried_result", "work_ran", "work_cancelled", "attempt",
          "min_elapsed_ms");
      assertTrue(expect.has("result") != expect.has("error"), where + ": an expect has a result or an error");
      assertTrue(!expect.has("error") || ERROR_KINDS.contains(expect.get("error").asText()), where + ": unknown error kind");
      assertTrue(!expect.has("carried_result") || expect.path("error").asText().equals("result_not_stored"),
          where + ": carried_result belongs to result_not_stored");
    }
    only(step.path("await_calls"), where + ": await_calls", "method", "count");
    only(step.path("expect_calls"), where + ": expect_calls", "method", "count", "min_gap_ms");
    JsonNode calls = step.has("await_calls") ? step.get("await_calls") : step.path("expect_calls");
    assertTrue(calls.isMissingNode() || calls.path("method").isTextual() && calls.path("count").isInt()
        && (!calls.has("min_gap_ms") || calls.get("count").asInt() >= 2), where + ": a call count: " + calls);
    if (step.has("expect_key")) {
      JsonNode key = step.get("expect_key");
      only(key, where + ": expect_key", "key", "state", "attempt");
      assertTrue(Set.of("absent", "in_progress", "completed").contains(key.path("state").asText()),
          where + ": unknown key state");
      assertTrue(!key.has("attempt") || key.get("state").asText().equals("in_progress"),
          where + ": only a key in progress has an attempt to check");
    }
  }

  /** Fails for a field of {@code node} that is not one of {@code fields} (a missing node has none). */
  private static void only(JsonNode node, String where, String... fields) {
    Set<String> known = Set.of(fields);
    node.fieldNames().forEachRemaining(f -> assertTrue(known.contains(f), where + ": a field this runner does not know: " + f));
  }

  private ScenarioVectors() {}
}
