#!/usr/bin/env bash
# The failover suite of issue 38: the coordinator on a highly available PostgreSQL, three
# PostgreSQL 15 nodes under Patroni with etcd, reached through HAProxy and through a multi-host
# URL, under a load of lifecycles while the cluster loses its primary in every way a machine or
# a network can lose it. See deploy/ha/README.md for what it proves and the settings chosen.
#
# Run as root on this kind of machine (Debian 12): it makes a private bridge (brha0,
# 10.200.0.1/24) and three network namespaces (idha-pg1..3 at 10.200.0.11-13), etcd on the
# bridge, a Patroni-managed PostgreSQL 15 in each namespace (as the postgres user), HAProxy on
# the bridge, and then runs suite.py (the coordinators, the load, the faults, the figures). It
# touches nothing else: not the PostgreSQL at 127.0.0.1:5432, no port outside the bridge's
# addresses but the coordinators' free loopback ports, no firewall rule outside its namespaces
# (one FORWARD rule on the host only if the host's FORWARD policy would drop the bridge's
# traffic). Everything it starts is torn down on exit; a run interrupted before it could clean
# up is cleaned up by the next one, first.
#
# What is missing (Patroni, etcd, HAProxy, iptables, PostgreSQL 15) is installed by
# scripts/services, the repository's installer. The coordinator binary comes from
# IDEMPOTENCY_COORDINATOR_BIN, else <repo>/target/debug/idempotency-coordinator. The Python
# side runs in deploy/ha/.venv (the client from this checkout, pinned tools), checked with ruff
# and mypy --strict first. Logs go to /tmp/idempotency-ha-logs, kept after a failure.
#
# Settings (environment): HA_ROUNDS (default "haproxy,multihost,replicas"; a comma list of
# those), HA_ASYNC (1: measure the asynchronous mode at the end, the default; 0: skip).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# $repo, $started_at, $BIN (the coordinator binary, absolute).
# shellcheck source=../suite_start.sh
source "$here/../suite_start.sh"

# Names and addresses, chosen not to meet anything else on the machine: a /24 of its own on a
# bridge of its own, namespaces and links with a prefix of their own.
BRIDGE=brha0
SUBNET=10.200.0
HOST_IP=$SUBNET.1
NODES=(pg1 pg2 pg3)
NS_PREFIX=idha-
ETCD_CLIENT_URL=http://$HOST_IP:2379
ETCD_PEER_URL=http://$HOST_IP:2380
HAPROXY_ADDRESS=$HOST_IP:5000
HAPROXY_STATS=$HOST_IP:5001
PG_BIN=/usr/lib/postgresql/15/bin
LOG_DIR=/tmp/idempotency-ha-logs
LOCK_FILE=/tmp/idempotency-ha.lock
# Data lives on tmpfs: a kill -9 of the processes is not a power loss (the kernel keeps what
# was written), so fsync adds nothing to what is tested here, and the disk is shared with builds.
WORK_PARENT=/dev/shm
WORK_PREFIX=idempotency-ha.
# The mark on the one host firewall rule this may add, so that it and only it is removed.
RULE_COMMENT=idempotency-ha-suite

# Patroni's timing, its dynamic configuration (bootstrap.dcs), as the reference configuration
# sets it (reference/patroni.yml says why), read from there for the suite's own waits.
dcs_setting() { sed -n "s/^    $1: \([0-9]*\)\$/\1/p" "$here/reference/patroni.yml"; }
PATRONI_TTL=$(dcs_setting ttl)
PATRONI_LOOP_WAIT=$(dcs_setting loop_wait)
PATRONI_RETRY_TIMEOUT=$(dcs_setting retry_timeout)
if [ -z "$PATRONI_TTL" ] || [ -z "$PATRONI_LOOP_WAIT" ] || [ -z "$PATRONI_RETRY_TIMEOUT" ]; then
  echo "ha: reference/patroni.yml lacks bootstrap.dcs ttl, loop_wait or retry_timeout" >&2
  exit 1
fi

log() { echo "ha: $*" >&2; }
die() { log "$*"; exit 1; }

# $1 = what did not come up, $2 = its log file.
fail_with_log() {
  log "$1; the last lines of $2:"
  tail -n 40 "$2" 2>/dev/null | sed 's/^/    /' >&2 || log "    ($2 cannot be read)"
  exit 1
}

# $1 = seconds, then a command: polls it every 0.1 s; true once it succeeds, false at the
# deadline.
wait_for() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.1
  done
}

ns_of() { echo "$NS_PREFIX$1"; }
ip_of() { echo "$SUBNET.$((10 + ${1#pg}))"; }

# ---------------------------------------------------------------------------------------------
# Before anything: root, the tools, the binary.

[ "$(id -u)" -eq 0 ] || die "run as root (network namespaces, a bridge, iptables): sudo $0"
[ -x "$BIN" ] || die "no coordinator binary at $BIN: build it (cargo build) or set IDEMPOTENCY_COORDINATOR_BIN"

tools_present() {
  local tool
  for tool in /usr/bin/patroni /usr/bin/patronictl /usr/bin/etcd /usr/sbin/haproxy \
      /usr/sbin/iptables /bin/ip /usr/bin/setpriv /usr/bin/curl "$PG_BIN/postgres" "$PG_BIN/pg_rewind"; do
    [ -x "$tool" ] || return 1
  done
}
if ! tools_present; then
  log "Patroni, etcd, HAProxy, iptables or PostgreSQL 15 is missing: running scripts/services"
  "$repo/scripts/services"
  tools_present || die "scripts/services ran, and a tool is still missing (patroni, etcd, haproxy, iptables, PostgreSQL 15)"
fi

# One run at a time: the names above are fixed, and a second run would tear down the first. The
# lock is this shell's alone: every process started below gets `9>&-`, so that one left behind
# by a run that was killed cannot keep the next run out.
exec 9>"$LOCK_FILE"
flock -n 9 || die "another run of this suite holds $LOCK_FILE"

# ---------------------------------------------------------------------------------------------
# The Python side first (no root needed, nothing started yet): the venv, then ruff and mypy.

cd "$here"
# shellcheck source=../suite_venv.sh
source ../suite_venv.sh requirements.txt
log "venv ready, ruff and mypy --strict clean ($((SECONDS - started_at)) s)"

# ---------------------------------------------------------------------------------------------
# Leftovers of an earlier run, and the teardown of this one. The same function does both: it
# kills what the pid files of any work folder name (only when the process is still the one
# started: its command line is checked), every process in the namespaces, then removes the
# namespaces, the bridge, the rule and the folders.

# kill_recorded: $1 = pid file; kills its process if it still runs the command the file names.
# shellcheck source=../processes.sh
source ../processes.sh

# $1 = namespace: SIGKILL to every process in it until none is left (a dying Patroni may still
# fork), bounded.
kill_namespace() {
  local pids tries=0
  while pids=$(ip netns pids "$1" 2>/dev/null) && [ -n "$pids" ]; do
    # shellcheck disable=SC2086 # one pid per word
    kill -9 $pids 2>/dev/null || true
    tries=$((tries + 1))
    [ $tries -lt 50 ] || { log "processes in namespace $1 survive SIGKILL: $pids"; return 1; }
    sleep 0.1
  done
}

# $1 = namespace: asks its Patroni to stop (it stops its PostgreSQL, which then removes its
# shared memory).
ask_patroni_to_stop() {
  local pid
  for pid in $(ip netns pids "$1" 2>/dev/null); do
    if tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q 'bin/patroni '; then
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
}
# True when every namespace named is empty.
namespaces_empty() {
  local ns
  for ns in "$@"; do
    [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] || return 1
  done
}

# $1 = a node's data folder: removes the System V segment its postmaster.pid names (key and id
# on line 7), which a killed PostgreSQL leaves behind, if no process has it attached.
release_shared_memory() {
  local key id
  read -r key id < <(sed -n 7p "$1/postmaster.pid" 2>/dev/null) || return 0
  [ -n "$key" ] && [ -n "$id" ] || return 0
  if ipcs -m | awk -v key="$(printf '0x%08x' "$key")" -v id="$id" \
      '$1 == key && $2 == id && $6 == 0 { found = 1 } END { exit !found }'; then
    ipcrm -m "$id" 2>/dev/null || true
  fi
}

clean_up() {
  local folder file node ns namespaces=()
  # Patroni first, every node at once and while etcd still answers its last calls, for at most
  # 10 s; then whatever is left in the namespaces is killed.
  for node in "${NODES[@]}"; do
    ns=$(ns_of "$node")
    if ip netns list | grep -qw "$ns"; then
      namespaces+=("$ns")
      ask_patroni_to_stop "$ns"
    fi
  done
  if [ ${#namespaces[@]} -gt 0 ]; then
    wait_for 10 namespaces_empty "${namespaces[@]}" || true
    for ns in "${namespaces[@]}"; do
      kill_namespace "$ns" || true
      ip netns delete "$ns" 2>/dev/null || true
    done
  fi
  for node in "${NODES[@]}"; do
    ip link delete "vha-$node" 2>/dev/null || true
  done
  for folder in "$WORK_PARENT/$WORK_PREFIX"*; do
    [ -d "$folder" ] || continue
    for file in "$folder"/pids/*.pid; do
      if [ -e "$file" ]; then kill_recorded "$file"; fi
    done
  done
  for folder in "$WORK_PARENT/$WORK_PREFIX"*/pg*/data; do
    if [ -d "$folder" ]; then release_shared_memory "$folder"; fi
  done
  ip link delete "$BRIDGE" 2>/dev/null || true
  while iptables -S FORWARD 2>/dev/null | grep -q -- "--comment $RULE_COMMENT"; do
    iptables -D FORWARD -i "$BRIDGE" -o "$BRIDGE" -m comment --comment "$RULE_COMMENT" -j ACCEPT \
      2>/dev/null || break
  done
  for folder in "$WORK_PARENT/$WORK_PREFIX"*; do
    if [ -d "$folder" ]; then rm -rf "$folder"; fi
  done
}

clean_up
tear_down_on_exit "everything torn down"
rm -rf "$LOG_DIR"
mkdir -p "$LOG_DIR"
work=$(mktemp -d "$WORK_PARENT/${WORK_PREFIX}XXXXXX")
chmod 755 "$work"
mkdir -p "$work/pids"
setup_started=$SECONDS

# $1 = name, $2 = pid, $3 = a word of its command line that tells it is still ours.
record_pid() { printf '%s\n%s\n' "$2" "$3" >"$work/pids/$1.pid"; }

# ---------------------------------------------------------------------------------------------
# The network: a bridge with the host at .1, a namespace per node on a veth pair.

if ip route show | grep -q "^$SUBNET\.0/24"; then
  die "$SUBNET.0/24 is already routed on this machine ($(ip route show | grep "^$SUBNET\.0/24")): this suite needs it to itself"
fi
ip link add "$BRIDGE" type bridge
ip addr add "$HOST_IP/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
for node in "${NODES[@]}"; do
  ns=$(ns_of "$node")
  ip netns add "$ns"
  ip link add "vha-$node" type veth peer name eth0 netns "$ns"
  ip link set "vha-$node" master "$BRIDGE" up
  ip -n "$ns" addr add "$(ip_of "$node")/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
done
# Bridged frames pass the host's FORWARD chain when br_netfilter is loaded: a host whose policy
# drops them (as Docker sets it) gets one rule for this bridge, marked, removed on exit.
if [ "$(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || echo 0)" = 1 ] \
    && ! iptables -S FORWARD 2>/dev/null | grep -qx -- '-P FORWARD ACCEPT'; then
  iptables -I FORWARD -i "$BRIDGE" -o "$BRIDGE" -m comment --comment "$RULE_COMMENT" -j ACCEPT
fi

# ---------------------------------------------------------------------------------------------
# etcd, the DCS, on the host's bridge address only.

mkdir -p "$work/etcd"
setsid etcd --name ha --data-dir "$work/etcd/data" \
  --listen-client-urls "$ETCD_CLIENT_URL" --advertise-client-urls "$ETCD_CLIENT_URL" \
  --listen-peer-urls "$ETCD_PEER_URL" --initial-advertise-peer-urls "$ETCD_PEER_URL" \
  --initial-cluster "ha=$ETCD_PEER_URL" --initial-cluster-state new \
  --listen-metrics-urls "http://$HOST_IP:2381" \
  >"$LOG_DIR/etcd.log" 2>&1 </dev/null 9>&- &
record_pid etcd $! "$work/etcd/data"
disown
etcd_ready() { curl -fsS --max-time 1 "$ETCD_CLIENT_URL/health" 2>/dev/null | grep -q '"health":"true"'; }
wait_for 20 etcd_ready || fail_with_log "etcd did not answer healthy on $ETCD_CLIENT_URL within 20 s" "$LOG_DIR/etcd.log"
# Every namespace reaches it over the bridge.
etcd_reached_from() { ip netns exec "$(ns_of "$1")" curl -fsS --max-time 1 -o /dev/null "$ETCD_CLIENT_URL/health" 2>/dev/null; }
for node in "${NODES[@]}"; do
  wait_for 10 etcd_reached_from "$node" || die "namespace $(ns_of "$node") cannot reach etcd at $ETCD_CLIENT_URL over $BRIDGE"
done

# ---------------------------------------------------------------------------------------------
# Patroni, one per namespace, as the postgres user. Each node gets a configuration and a start
# script (suite.py restarts a killed node with the same script).

for node in "${NODES[@]}"; do
  ip=$(ip_of "$node")
  dir=$work/$node
  mkdir -p "$dir/run" "$LOG_DIR/$node"
  chown -R postgres:postgres "$dir" "$LOG_DIR/$node"
  chmod 700 "$dir"
  # The reference configuration an operator copies (reference/patroni.yml), rendered with this
  # node's values, and the suite's few changes for a cluster on one machine merged over it
  # (suite-patroni.yml): what runs here is what the reference sets.
  NODE_NAME=$node NODE_ADDRESS=$ip ETCD_HOSTS=$HOST_IP:2379 CLUSTER_NETWORK=$SUBNET.0/24 \
    DATA_DIR=$dir/data PG_BIN_DIR=$PG_BIN SUPERUSER_PASSWORD=suite-superuser \
    REPLICATION_PASSWORD=suite-replication REWIND_PASSWORD=suite-rewind \
    WORK_DIR=$dir NODE_LOG_DIR=$LOG_DIR/$node \
    /usr/bin/python3 "$here/render_patroni.py" "$here/reference/patroni.yml" "$here/suite-patroni.yml" \
    >"$dir/patroni.yml"
  chown postgres:postgres "$dir/patroni.yml"
  chmod 600 "$dir/patroni.yml"
  cat >"$dir/start" <<SCRIPT
#!/bin/sh
# Starts Patroni for $node in namespace $(ns_of "$node") as postgres, in a session of its own,
# its output appended to $LOG_DIR/$node/patroni.log. Written by deploy/ha/test.sh.
exec setsid ip netns exec $(ns_of "$node") setpriv --reuid=postgres --regid=postgres --init-groups \\
  env -i HOME=$dir PATH=/usr/bin:/bin LANG=C.UTF-8 patroni $dir/patroni.yml \\
  >>$LOG_DIR/$node/patroni.log 2>&1 </dev/null
SCRIPT
  chmod 755 "$dir/start"
  "$dir/start" 9>&- &
  disown
done

# $1 = node: its REST API says it is the running primary.
is_primary() { curl -fsS --max-time 1 -o /dev/null "http://$(ip_of "$1"):8008/primary" 2>/dev/null; }
primary=""
find_primary() {
  local node
  for node in "${NODES[@]}"; do
    if is_primary "$node"; then primary=$node; return 0; fi
  done
  return 1
}
wait_for 60 find_primary || fail_with_log "no Patroni node became the primary within 60 s" "$LOG_DIR/pg1/patroni.log"

# Both standbys stream from the primary, one of them synchronous (pg_stat_replication, not
# Patroni's lag: see the issue's note).
replication_state() {
  psql "host=$(ip_of "$primary") port=5432 user=postgres dbname=postgres connect_timeout=2" -X -q -t -A \
    -c "SELECT string_agg(application_name || ':' || state || ':' || sync_state, ' ' ORDER BY application_name) FROM pg_stat_replication" 2>/dev/null
}
standbys_stream() {
  local state node streaming=0 sync=0
  state=$(replication_state) || return 1
  for node in "${NODES[@]}"; do
    [ "$node" = "$primary" ] && continue
    [[ " $state " == *" $node:streaming:"* ]] || return 1
    streaming=$((streaming + 1))
  done
  [[ "$state" == *":streaming:sync"* ]] && sync=1
  [ $streaming -eq 2 ] && [ $sync -eq 1 ]
}
standby=$(printf '%s\n' "${NODES[@]}" | grep -vx "$primary" | head -n 1)
wait_for 90 standbys_stream \
  || fail_with_log "the standbys did not both stream from $primary within 90 s ($(replication_state || echo 'pg_stat_replication unreadable'))" "$LOG_DIR/$standby/patroni.log"
log "Patroni cluster up in $((SECONDS - setup_started)) s: primary $primary, $(replication_state)"

# ---------------------------------------------------------------------------------------------
# HAProxy on the bridge, to whichever node Patroni's REST API calls the primary.

# The reference configuration an operator copies (reference/haproxy.cfg), as it is, its
# addresses from the environment; beside it, for the suite only, a stats page that says which
# server HAProxy routes to.
cp "$here/reference/haproxy.cfg" "$work/haproxy.cfg"
cat >"$work/haproxy-stats.cfg" <<CFG
# Written by deploy/ha/test.sh: each server's state, as CSV, for the suite.
frontend stats
    mode http
    bind $HAPROXY_STATS
    timeout client 10s
    stats enable
    stats uri /stats
CFG
HAPROXY_BIND=$HAPROXY_ADDRESS
PATRONI_NODE_1=$(ip_of pg1):5432
PATRONI_NODE_2=$(ip_of pg2):5432
PATRONI_NODE_3=$(ip_of pg3):5432
export HAPROXY_BIND PATRONI_NODE_1 PATRONI_NODE_2 PATRONI_NODE_3
haproxy -c -q -f "$work/haproxy.cfg" -f "$work/haproxy-stats.cfg" >"$LOG_DIR/haproxy-check.log" 2>&1 \
  || fail_with_log "HAProxy refused its configuration" "$LOG_DIR/haproxy-check.log"
setsid haproxy -db -f "$work/haproxy.cfg" -f "$work/haproxy-stats.cfg" >"$LOG_DIR/haproxy.log" 2>&1 </dev/null 9>&- &
record_pid haproxy $! "$work/haproxy.cfg"
disown
# HAProxy takes every server for UP until its first checks: ready once only the primary is.
servers_up() {
  curl -fsS --max-time 1 "http://$HAPROXY_STATS/stats;csv" 2>/dev/null \
    | awk -F, '$1 == "postgres" && $2 != "FRONTEND" && $2 != "BACKEND" && $18 == "UP" { print $2 }' | paste -sd' '
}
only_primary_up() { [ "$(servers_up)" = "$primary" ]; }
wait_for 20 only_primary_up \
  || fail_with_log "HAProxy did not route to $primary alone within 20 s (UP: $(servers_up))" "$LOG_DIR/haproxy.log"
log "set up in $((SECONDS - setup_started)) s: bridge, namespaces, etcd, 3 Patroni nodes, HAProxy"

# ---------------------------------------------------------------------------------------------
# The suite: coordinators, load, faults, figures.

node_json() {
  local node=$1
  printf '{"name":"%s","namespace":"%s","ip":"%s","config":"%s","start":"%s","log":"%s","postgres_log":"%s"}' \
    "$node" "$(ns_of "$node")" "$(ip_of "$node")" "$work/$node/patroni.yml" "$work/$node/start" \
    "$LOG_DIR/$node/patroni.log" "$LOG_DIR/$node/postgresql.log"
}
{
  printf '{"work":"%s","logs":"%s","binary":"%s","haproxy":"%s","haproxy_stats":"%s","host_ip":"%s","etcd":"%s",' \
    "$work" "$LOG_DIR" "$BIN" "$HAPROXY_ADDRESS" "http://$HAPROXY_STATS/stats;csv" "$HOST_IP" "$ETCD_CLIENT_URL"
  printf '"patroni":{"ttl":%d,"loop_wait":%d,"retry_timeout":%d},"nodes":[' \
    "$PATRONI_TTL" "$PATRONI_LOOP_WAIT" "$PATRONI_RETRY_TIMEOUT"
  first=1
  for node in "${NODES[@]}"; do
    [ $first -eq 1 ] || printf ','
    first=0
    node_json "$node"
  done
  printf ']}\n'
} >"$work/environment.json"

"$venv/bin/python" -u suite.py --environment "$work/environment.json" \
  --rounds "${HA_ROUNDS:-haproxy,multihost,replicas}" --async-measurement "${HA_ASYNC:-1}" 9>&-
