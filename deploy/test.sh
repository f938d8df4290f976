#!/usr/bin/env bash
# Validates the Kubernetes manifests against the Kubernetes API schemas (kubernetes-validate from
# PyPI, strict: unknown fields are errors), offline, from the schemas the package ships. Installs
# the validator into a venv here (gitignored). Also checks what the schemas cannot: the pod's
# termination grace outlasts --shutdown-grace, and the validator does refuse a broken manifest.
# Then the monitoring files: the Prometheus rules (promtool's check and unit tests) and the
# Grafana dashboard, both against the metrics docs/metrics.md lists (check_monitoring.py).
set -euo pipefail
cd "$(dirname "$0")"

if [ ! -x .venv/bin/kubernetes-validate ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check 'kubernetes-validate==1.37.0'
fi

# No network from here on when the kernel lets us say so: the schemas come from the package.
offline=()
if unshare -n true 2>/dev/null; then offline=(unshare -n); fi

"${offline[@]}" .venv/bin/kubernetes-validate --strict --quiet -k 1.37.0 kubernetes/*.yaml
echo "deploy: manifests valid against Kubernetes 1.37 schemas${offline:+ (offline)}"

# A manifest with a misspelled field must fail, or the step above proves nothing.
broken=$(mktemp --suffix=.yaml)
trap 'rm -f "$broken"' EXIT
sed 's/terminationGracePeriodSeconds:/terminationGracePeriodSecond:/' kubernetes/deployment.yaml >"$broken"
if "${offline[@]}" .venv/bin/kubernetes-validate --strict --quiet -k 1.37.0 "$broken" >/dev/null 2>&1; then
  echo "deploy: the validator accepted a misspelled field" >&2
  exit 1
fi

# Kubernetes kills the pod terminationGracePeriodSeconds after SIGTERM: it must outlast the drain.
.venv/bin/python - <<'PY'
import re, sys
text = open("kubernetes/deployment.yaml").read()
period = int(re.search(r"terminationGracePeriodSeconds: (\d+)", text).group(1))
grace = int(re.search(r"--shutdown-grace=(\d+)s", text).group(1))
if period <= grace + 1:
    sys.exit(f"terminationGracePeriodSeconds {period} must exceed --shutdown-grace {grace}s + 1s")
for flag in ("--no-migrate", "service: idempotency.v1.IdempotencyService"):
    if flag not in text:
        sys.exit(f"the Deployment lacks {flag}")
print(f"deploy: pods get {period}s to drain for {grace}s")
PY

# The two roles line up: the Job migrates and grants the role the serving URLs log in as, and
# every file a container's flags name is in the secret volume mounted there.
.venv/bin/python - <<'PY'
import sys, urllib.parse, yaml
def load(name):
    return yaml.safe_load(open(f"kubernetes/{name}"))
secret = load("secret.yaml")["stringData"]
def user(key):
    return urllib.parse.urlsplit(secret[key]).username
job = load("migrate-job.yaml")["spec"]["template"]["spec"]
args = job["containers"][0]["args"]
if args[0] != "migrate":
    sys.exit("the migrate Job does not run `migrate`")
grants = [a.split("=", 1)[1] for a in args if a.startswith("--grant-to=")]
if grants != [user("database-url")] or user("direct-database-url") != grants[0]:
    sys.exit(f"the Job grants {grants}, the replicas log in as {user('database-url')}")
# Each manifest, and the database URLs (secret keys) its container reads.
uses = {"migrate-job.yaml": ["migrate-database-url"],
        "deployment.yaml": ["database-url", "direct-database-url"]}
for name, urls in uses.items():
    spec = load(name)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    container = spec["containers"][0]
    mounted = {}
    for mount in container.get("volumeMounts", []):
        for item in volumes[mount["name"]]["secret"].get("items", []):
            if item["key"] not in secret:
                sys.exit(f"{name}: mounts {item['key']}, which the secret lacks")
            mounted[f"{mount['mountPath']}/{item['path']}"] = item["key"]
    named = [a.split("=", 1)[1] for a in container["args"] if a.split("=", 1)[0].endswith("-file")]
    named += [q.split("=", 1)[1] for key in urls
              for q in urllib.parse.urlsplit(secret[key]).query.split("&")
              if q.startswith("sslrootcert=")]
    for path in named:
        if path not in mounted:
            sys.exit(f"{name}: {path} is named but not mounted")
print("deploy: the migrate Job grants the serving role; every named file is mounted")
PY

# The Prometheus rules and the Grafana dashboard. promtool is Debian's `prometheus` package, which
# scripts/services installs.
if ! command -v promtool >/dev/null 2>&1; then
  echo "deploy: promtool is missing: run scripts/services as root (Debian's prometheus package)" >&2
  exit 1
fi
promtool check rules prometheus/idempotency-rules.yml
promtool test rules prometheus/idempotency-rules.test.yml
# Every query names only metrics the service exports, every metric has a panel, panel ids are
# unique, the dashboard's queries parse, and each alert's tests fail when the alert is broken
# either way (never firing, always firing).
export PYTHONDONTWRITEBYTECODE=1
python3 check_monitoring.py --mutate-alerts
# The checker itself refuses what it exists to refuse.
python3 -m unittest test_check_monitoring
echo "deploy: alert rules and dashboard checked against docs/metrics.md"
