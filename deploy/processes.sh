# Sourced (not run) by the suites' test.sh (deploy/ha, deploy/upgrade): what their teardowns
# share. A suite records each process it starts in a pid file: the pid on the first line, and
# on the second a word of its command line that tells it is still that process (a pid is reused
# once its process is gone).

# $1 = pid file: kills its process if it still runs the command the file's second line names.
kill_recorded() {
  local pid expected
  pid=$(sed -n 1p "$1" 2>/dev/null) || return 0
  expected=$(sed -n 2p "$1" 2>/dev/null) || return 0
  [ -n "$pid" ] && [ -n "$expected" ] || return 0
  if tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF -- "$expected"; then
    kill -9 "$pid" 2>/dev/null || true
  fi
}

# Tears the suite down on exit, however it exits: the suite's own `clean_up` runs to its end
# (it is bounded: a second Ctrl-C or a TERM does not cut it short), the logs in $LOG_DIR are
# removed after a pass and kept after a failure, and `log` says which, with the wall time since
# $started_at; an interrupted run reports failure (and tears down) rather than passing.
# $1 = what the teardown leaves behind, in the last line's words.
tear_down_on_exit() {
  TORN_DOWN=$1
  trap finish EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

finish() {
  local status=$?
  set +e
  trap '' INT TERM
  clean_up
  if [ $status -eq 0 ]; then
    rm -rf "$LOG_DIR"
    log "passed; $TORN_DOWN (wall time $((SECONDS - started_at)) s)"
  else
    log "FAILED (exit $status); $TORN_DOWN; the logs are kept in $LOG_DIR (wall time $((SECONDS - started_at)) s)"
  fi
  exit $status
}
