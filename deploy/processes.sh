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
