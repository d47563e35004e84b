#!/bin/sh
# System packages hetflow's test suite needs beyond the Python venv (Debian/Ubuntu, run as root):
#   chromium  -- headless browser that checks the timeline report renders (tests/test_timeline.py)
set -eu
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
apt-get update
apt-get install -y --no-install-recommends chromium
