#!/usr/bin/env bash
# Installs the system packages the test suite needs beyond the Python venv:
# Debian's chromium (the HTML report is tested in a real headless browser), a
# font so screenshots render text, and promtool. Idempotent: does nothing when both are present.
set -euo pipefail

need=()
[ -x /usr/bin/chromium ] || need+=(chromium)
dpkg-query -W -f='${Status}' fonts-dejavu-core 2>/dev/null | grep -q "install ok installed" || need+=(fonts-dejavu-core)
# promtool (from Debian's prometheus) validates collector-config/'s Prometheus config and alert rules.
command -v promtool >/dev/null 2>&1 || need+=(prometheus)

if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
