#!/usr/bin/env bash
# Install everything (scripts/install.sh), then lint and run the whole test suite.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests' processes write the bytecode of the modules they import (into .venv and the checkout),
# so nothing is compiled twice and the install compiles nothing ahead (scripts/install.sh)
unset PYTHONDONTWRITEBYTECODE
bash scripts/install.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# The inference servers' own environments (core-rl server-env; cached under $CORE_RL_HOME, default
# ~/.cache/core-rl, so this is instant when they are built already) build in the background while
# the tests that do not need them run: the files holding server tests are collected last and wait
# for their environment (conftest.py reads CORE_RL_SERVER_ENV_BUILDS). A failed build fails the run
# and prints its log.
builds=$(mktemp -d "${TMPDIR:-/tmp}/core-rl-server-envs.XXXXXX")
trap 'rm -rf "$builds"' EXIT  # a failed step's log is printed below first
export CORE_RL_SERVER_ENV_BUILDS=$builds
envs=(vllm sglang)
pids=()
for env in "${envs[@]}"; do
  ( start=$(date +%s)
    status=0
    "$VENV/bin/core-rl" server-env create "$env" > "$builds/$env.log" 2>&1 || status=$?
    echo "the $env server environment: status $status after $(( $(date +%s) - start )) s" >> "$builds/$env.log"
    echo "$status" > "$builds/$env.rc.partial" && mv "$builds/$env.rc.partial" "$builds/$env.rc" ) &  # whole, never read half-written
  pids+=($!)
done
# The Slurm launcher's test against a real one-node Slurm needs Debian's Slurm and MUNGE packages:
# as root with apt-get, install them when absent, in the background too (about 15 s; the files of
# tests marked after_setup("slurm-packages") are collected last and wait for it; CORE_RL_SLURM_TEST=0
# leaves them out, and without them that test skips saying why).
if [ "${CORE_RL_SLURM_TEST:-1}" != "0" ] && [ "$(id -u)" = "0" ] && command -v apt-get > /dev/null \
    && ! command -v slurmctld > /dev/null; then
  : > "$builds/slurm-packages.log"  # before pytest starts: its tests wait for the .rc
  ( export DEBIAN_FRONTEND=noninteractive
    status=0
    { timeout 300 apt-get update -q \
        && timeout 300 apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
    } > "$builds/slurm-packages.log" 2>&1 || status=$?
    echo "$status" > "$builds/slurm-packages.rc.partial" && mv "$builds/slurm-packages.rc.partial" "$builds/slurm-packages.rc" ) &
  pids+=($!)
fi
# Two pytest workers (pytest-xdist; CORE_RL_TEST_WORKERS to change, 0 for none), each taking whole
# files so a module's server or model fixture is built once, in the order conftest.py gives them.
workers=${CORE_RL_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != "0" ]; then parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
status=0
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/python" -m pytest -q "${parallel[@]}" "$@" || status=$?
wait "${pids[@]}"
for env in "${envs[@]}"; do
  tail -n 1 "$builds/$env.log"
  if [ "$(cat "$builds/$env.rc")" != "0" ]; then
    cat "$builds/$env.log"
    echo "building the $env server environment failed" >&2
    status=1
  fi
done
if [ -f "$builds/slurm-packages.rc" ] && [ "$(cat "$builds/slurm-packages.rc")" != "0" ]; then
  echo "installing Slurm's packages failed; the end of its log:"
  tail -n 40 "$builds/slurm-packages.log"
fi
exit "$status"
