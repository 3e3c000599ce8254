#!/usr/bin/env bash
# Start Debian's PostgreSQL server on this machine for the several-hosts tuning tests and print
# the URL of a role that may create databases (the tests make a fresh database each).
# Installs the package first where it is missing. Needs root (apt, and the server runs as the
# postgres user).
set -euo pipefail
if ! command -v pg_ctlcluster >/dev/null; then
  echo "installing postgresql (Debian package)" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
fi
version=$(pg_lsclusters -h | awk 'NR==1 {print $1}')
if [ -z "$version" ]; then
  version=$(ls /usr/lib/postgresql | sort -n | tail -1)
  pg_createcluster "$version" main >&2
fi
cluster=$(pg_lsclusters -h | awk -v v="$version" '$1==v {print $2; exit}')
port=$(pg_lsclusters -h | awk -v v="$version" -v c="$cluster" '$1==v && $2==c {print $3}')
pg_ctlcluster "$version" "$cluster" start >/dev/null 2>&1 || true
for _ in $(seq 30); do
  pg_isready -q -h 127.0.0.1 -p "$port" && break
  sleep 1
done
su postgres -c "psql -q -p $port -tAc \"SELECT 1 FROM pg_roles WHERE rolname='kvgen'\"" |
  grep -q 1 ||
  su postgres -c "psql -q -p $port -c \"CREATE ROLE kvgen LOGIN PASSWORD 'kvgen' CREATEDB\"" >&2
echo "postgresql://kvgen:kvgen@127.0.0.1:$port/postgres"
