#!/usr/bin/env bash
# Installs the system tools the test suite needs, only when they are missing:
#   - PostgreSQL 15 server binaries (initdb, pg_ctl, postgres) for the distributed tests,
#   - spin and gcc for the protocol model check (model/check),
#   - chromium for the browser test,
#   - a Java runtime (OpenJDK 17, headless) for the Spark engine's tests (pyspark starts a JVM),
#   - curl and jq for the distributed quick start (docs/deployment.md),
#   - promtool (Debian package prometheus) to check the shipped alert rules (deploy/alerts.yml).
# Idempotent: a machine that has everything runs no apt command at all. As root it installs with
# apt-get; as another user it prints what is missing and exits 0, so the tests that need a missing
# tool fail loudly in CI (DATAFLOW_REQUIRE_POSTGRES=1) instead of this script hiding it.
set -euo pipefail

have_postgres() {
  command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1 && return 0
  compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null
}
have_chromium() {
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1
}
have_java() {
  command -v java >/dev/null 2>&1 || [ -n "${JAVA_HOME:-}" ]
}

missing=()      # human-readable names of what is absent
packages=()     # apt packages that would provide them
have_postgres || { missing+=("PostgreSQL server (initdb/pg_ctl)"); packages+=("@postgres"); }
command -v spin >/dev/null 2>&1 || { missing+=("spin"); packages+=("spin"); }
command -v gcc >/dev/null 2>&1 || { missing+=("gcc"); packages+=("gcc"); }
have_chromium || { missing+=("chromium"); packages+=("chromium"); }
have_java || { missing+=("java"); packages+=("openjdk-17-jre-headless"); }
# The distributed quick start of docs/deployment.md, run as written by tests/acceptance/test_distributed_quickstart.py.
command -v curl >/dev/null 2>&1 || { missing+=("curl"); packages+=("curl"); }
command -v jq >/dev/null 2>&1 || { missing+=("jq"); packages+=("jq"); }
# promtool checks the shipped alert rules (deploy/alerts.yml, tests/integration/test_alert_rules.py).
command -v promtool >/dev/null 2>&1 || { missing+=("promtool"); packages+=("prometheus"); }

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-system-deps: PostgreSQL, spin, gcc, chromium, java, curl, jq and promtool are present"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install-system-deps: missing: ${missing[*]}" >&2
  echo "install-system-deps: not root, so not installing; run 'sudo $0' or install them yourself" >&2
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
echo "install-system-deps: installing: ${missing[*]}"
apt-get update -qq

# PostgreSQL 15 is what the project is tested on; Debian releases without it get their default.
resolved=()
for p in "${packages[@]}"; do
  if [ "$p" = "@postgres" ]; then
    if apt-cache policy postgresql-15 2>/dev/null | grep -q 'Candidate: [0-9]'; then
      resolved+=("postgresql-15")
    else
      resolved+=("postgresql")
    fi
    # The tests start their own throwaway clusters; a packaged 'main' cluster would only use memory.
    mkdir -p /etc/postgresql-common/createcluster.d
    conf=/etc/postgresql-common/createcluster.d/00-durable-dataflow.conf
    [ -e "$conf" ] || echo "create_main_cluster = false" > "$conf"
  else
    resolved+=("$p")
  fi
done

apt-get install -y --no-install-recommends "${resolved[@]}"

still=()
have_postgres || still+=("PostgreSQL")
command -v spin >/dev/null 2>&1 || still+=("spin")
have_chromium || still+=("chromium")
have_java || still+=("java")
command -v curl >/dev/null 2>&1 || still+=("curl")
command -v jq >/dev/null 2>&1 || still+=("jq")
if [ "${#still[@]}" -gt 0 ]; then
  echo "install-system-deps: still missing after apt-get install: ${still[*]}" >&2
  exit 1
fi
echo "install-system-deps: done"
