#!/usr/bin/env bash
# Install everything (scripts/install.sh), then lint and run the whole test suite.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/python" -m pytest -q "$@"
