#!/usr/bin/env bash
# Install core-rl and every in-repo plugin (editable) into a virtual environment.
#   VENV=<dir> (default .venv) ; reuses it when it exists.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
# torch first, pinned to the local CPU build, so nothing pulls a CUDA build from the registry
"$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
# DeepSpeed (core-rl-deepspeed) is a source package: build it without compiling any op
DS_BUILD_OPS=${DS_BUILD_OPS:-0} "$PY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
echo "installed into $VENV ($("$PY" -c 'import core_rl; print("core-rl", core_rl.__version__)'))"
