#!/bin/sh
# System packages hetflow's test suite needs beyond the Python venv (Debian/Ubuntu, run as root):
#   chromium    -- headless browser that checks the timeline report renders (tests/test_timeline.py)
#   postgresql  -- a real PostgreSQL server for the state-store test (tests/test_store_postgres.py
#                  starts a private cluster on a Unix socket; the server itself is not enabled)
set -eu
missing=""
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$missing postgresql"
if [ -z "$missing" ]; then
    exit 0
fi
apt-get update
# shellcheck disable=SC2086 -- package names are this script's own constants
apt-get install -y --no-install-recommends $missing
