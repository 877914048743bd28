#!/usr/bin/env bash
# Install everything (scripts/install.sh), then lint and run the whole test suite.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# The inference servers' own environments (core-rl server-env; cached under $CORE_RL_HOME, default
# ~/.cache/core-rl, so this is instant when they are built already). Built in parallel; a failure
# prints its log.
start=$(date +%s)
envs=(vllm sglang)
pids=()
for env in "${envs[@]}"; do
  "$VENV/bin/core-rl" server-env create "$env" > "${TMPDIR:-/tmp}/core-rl-server-env-$env.log" 2>&1 &
  pids+=($!)
done
for i in "${!envs[@]}"; do
  if ! wait "${pids[$i]}"; then
    cat "${TMPDIR:-/tmp}/core-rl-server-env-${envs[$i]}.log"
    echo "building the ${envs[$i]} server environment failed" >&2
    exit 1
  fi
done
echo "server environments ready in $(( $(date +%s) - start )) s"
# Two pytest workers (pytest-xdist; CORE_RL_TEST_WORKERS to change, 0 for none), each taking whole
# files so a module's server or model fixture is built once.
workers=${CORE_RL_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != "0" ]; then parallel=(-n "$workers" --dist loadfile); fi
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/python" -m pytest -q "${parallel[@]}" "$@"
