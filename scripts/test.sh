#!/usr/bin/env bash
# The one test command (README and .ci/run): venv, install with test extras (CPU torch 2.13.0),
# HTA in a venv of its own (the timeline oracle), system packages the browser tests need, schema
# drift check, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'
[ -x .venv-hta/bin/python ] || python3 -m venv .venv-hta
.venv-hta/bin/python -m pip install -q --no-deps -r scripts/hta-requirements.txt
export PLASMIENT_HTA_PYTHON="${PLASMIENT_HTA_PYTHON:-$PWD/.venv-hta/bin/python}"
bash scripts/install-test-deps.sh
.venv/bin/python -m plasmient_trace.schemas --check
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
