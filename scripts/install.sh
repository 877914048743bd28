#!/usr/bin/env bash
# Install core-rl and every in-repo plugin (editable) into a virtual environment.
#   VENV=<dir> (default .venv) ; reuses it when it exists.
#   CORE_RL_INSTALLER=pip to install with pip alone (default: uv, several times faster).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
# torch first, pinned to the local CPU build, so nothing pulls a CUDA build from the registry
TORCH="torch==2.13.0"
# DeepSpeed (core-rl-deepspeed) is a source package: build it without compiling any op
export DS_BUILD_OPS=${DS_BUILD_OPS:-0}
# Where PYTHONDONTWRITEBYTECODE is set, no process writes the bytecode of what it imports, so every
# process would compile ~800 modules again (about 2 s of CPU each): compile everything now, as pip
# does (uv with --compile-bytecode). Otherwise the first process to import a module writes its
# bytecode, which costs less than compiling every installed module (~30 s).
compile=()
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then compile=(--compile-bytecode); fi
if [ "${CORE_RL_INSTALLER:-uv}" = "pip" ]; then
  "$PY" -m pip install -q --disable-pip-version-check "$TORCH"
  "$PY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
else
  # uv, with pip's configured indexes and find-links (uv does not read pip's configuration).
  # torch alone first (pip took ~34 s of it, most of it CPU compiling torch's ~2,300 modules ahead; uv
  # ~4 s): installed, it satisfies every plugin's bound and stays as it is
  "$PY" -m pip install -q --disable-pip-version-check "uv>=0.5"
  UV=$("$PY" -c 'from uv import find_uv_bin; print(find_uv_bin())')
  mapfile -t uv_flags < <("$PY" plugins/kits/server/src/core_rl_server_kit/pip_as_uv.py "$PY")
  uv_install=("$UV" pip install --quiet --python "$PY" --index-strategy unsafe-best-match "${compile[@]}" "${uv_flags[@]}")
  "${uv_install[@]}" "$TORCH"
  "${uv_install[@]}" -r requirements-dev.txt
fi
if [ ${#compile[@]} -gt 0 ]; then  # the editable sources of core-rl and its plugins, likewise
  "$PY" -m compileall -q -j 0 core plugins > /dev/null
fi
echo "installed into $VENV ($("$PY" -c 'import core_rl; print("core-rl", core_rl.__version__)'))"
