#!/bin/sh
# System packages hetflow's test suite needs beyond the Python venv (Debian/Ubuntu, run as root):
#   chromium    -- headless browser that checks the timeline report renders (tests/test_timeline.py)
#   postgresql  -- a real PostgreSQL server for the state-store test (tests/test_store_postgres.py
#                  starts a private cluster on a Unix socket; the server itself is not enabled)
#   slurmctld slurmd slurm-client munge -- the Slurm lab cluster of the `slurm` tests
#                  (scripts/slurm-cluster.sh starts it; installing starts nothing)
set -eu
missing=""
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$missing postgresql"
for tool in slurmctld slurmd; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing="$missing $tool"
done
command -v srun >/dev/null 2>&1 || missing="$missing slurm-client"
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || missing="$missing munge"
if [ -z "$missing" ]; then
    exit 0
fi
apt-get update
# shellcheck disable=SC2086 -- package names are this script's own constants
apt-get install -y --no-install-recommends $missing
