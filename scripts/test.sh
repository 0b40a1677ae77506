#!/usr/bin/env bash
# The one test command (README and .ci/run): venv, install with test extras (CPU torch 2.13.0),
# HTA in a venv of its own (the timeline oracle), system packages the browser tests need, schema
# drift check, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'
# HTA is downloaded from PyPI (no local wheel): without a network its tests skip, and this says so.
if { [ -x .venv-hta/bin/python ] || python3 -m venv .venv-hta; } &&
    .venv-hta/bin/python -m pip install -q --retries 2 --timeout 30 --no-deps -r scripts/hta-requirements.txt; then
    export PLASMIENT_HTA_PYTHON="${PLASMIENT_HTA_PYTHON:-$PWD/.venv-hta/bin/python}"
else
    echo "scripts/test.sh: HTA could not be installed into .venv-hta; tests/test_hta_compare.py will skip" >&2
fi
bash scripts/install-test-deps.sh
.venv/bin/python -m plasmient_trace.schemas --check
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
