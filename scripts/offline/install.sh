#!/usr/bin/env bash
# Install core-rl from a wheelhouse (scripts/offline/build_wheelhouse.py) on a machine without a package
# index, into a virtual environment that also sees the packages of the Python that holds the machine's CUDA
# torch. Nothing is fetched, and torch is left as it is (checked: same version before and after).
#
#   bash scripts/offline/install.sh WHEELHOUSE
#     PYTHON=...   the interpreter with the CUDA torch (default python3)
#     VENV=...     the environment to create or reuse (default .venv); VENV=none installs into PYTHON's own
#     CORE_RL_ANY_WHEELHOUSE=1   install a wheelhouse built from other sources than this checkout
#
# Then: VENV/bin/core-rl ..., VENV/bin/python -m pytest ...
set -euo pipefail
WH=$(cd "${1:?usage: install.sh WHEELHOUSE  (see scripts/offline/build_wheelhouse.py)}" && pwd)
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
torch_before=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null) || {
  echo "install.sh: error: $PY cannot import torch; set PYTHON to the interpreter that has the machine's torch" >&2
  exit 2
}
# core-rl's wheels must be this checkout's: one built before a change would install (and test) the old code
checkout=$(cd "$(dirname "$0")/../.." && pwd)
if [ ! -d "$checkout/core" ] || [ ! -f "$checkout/scripts/offline/sources_digest.py" ]; then
  echo "install.sh: note: no core-rl checkout around this script ($checkout): the wheelhouse's sources are not checked" >&2
elif [ -f "$WH/sources.txt" ] && [ -z "${CORE_RL_ANY_WHEELHOUSE:-}" ]; then
  here=$("$PY" "$checkout/scripts/offline/sources_digest.py" "$checkout")
  if [ "$here" != "$(cat "$WH/sources.txt")" ]; then
    echo "install.sh: error: $WH was built from other sources than $checkout (core/ or plugins/ changed since):" \
      "rebuild it with scripts/offline/build_wheelhouse.py, or set CORE_RL_ANY_WHEELHOUSE=1 to install it anyway" >&2
    exit 2
  fi
fi
if [ "$VENV" = none ]; then
  TARGET_PY=$PY
else
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    # the new environment sees PYTHON's packages after its own (a .pth line per site-packages folder):
    # unlike --system-site-packages this also works when PYTHON is itself a virtual environment
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_core_rl_base_python.pth"
    # the build tools venv bundles (an old setuptools on 3.11) would shadow PYTHON's own, which its
    # packages may require at a newer version (torch does): keep PYTHON's
    "$VENV/bin/python" -m pip uninstall -q -y setuptools wheel 2>/dev/null || true
  fi
  TARGET_PY=$VENV/bin/python
fi
# every file the manifest lists; their requirements resolve against the wheelhouse and what is installed
# already. DeepSpeed is a source package: built here without compiling any op (they compile on first use).
[ -f "$WH/manifest.txt" ] || { echo "install.sh: error: $WH/manifest.txt is missing (not a wheelhouse)" >&2; exit 2; }
files=()
while read -r name _; do files+=("$WH/$name"); done < "$WH/manifest.txt"
DS_BUILD_OPS=${DS_BUILD_OPS:-0} "$TARGET_PY" -m pip install -q --disable-pip-version-check --no-index \
  --find-links "$WH" --no-build-isolation "${files[@]}"
# core-rl's own wheels keep their version number from build to build, so pip would keep an earlier
# install of them: put these in again (their dependencies are in place already)
own=("$WH"/core_rl*.whl)
[ -e "${own[0]}" ] && "$TARGET_PY" -m pip install -q --disable-pip-version-check --no-index --no-deps \
  --force-reinstall "${own[@]}"
torch_after=$("$TARGET_PY" -c 'import torch; print(torch.__version__)')
if [ "$torch_after" != "$torch_before" ]; then
  echo "install.sh: error: torch changed from $torch_before to $torch_after; the wheelhouse must not hold torch" >&2
  exit 1
fi
"$TARGET_PY" -c 'import core_rl, torch; print(f"installed core-rl {core_rl.__version__} with torch {torch.__version__} (cuda: {torch.cuda.is_available()})")'
