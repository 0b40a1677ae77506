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
# One test process per CPU, at most 4 (each may hold torch and a job it runs): the suite is mostly
# subprocesses and waits on them, so two processes halve it on a 2-core machine. A file's tests stay in one
# process, so a module's fixtures are built once. PLASMIENT_TEST_WORKERS=0 runs it in this process alone.
workers="${PLASMIENT_TEST_WORKERS:-$(.venv/bin/python -c 'import os; print(min(len(os.sched_getaffinity(0)), 4))')}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile "$@"
