#!/usr/bin/env bash
# Install everything (scripts/install.sh), then lint and run the test suite, or the selection the
# arguments make (they go to pytest, e.g.  bash scripts/test.sh -k config).
# Besides .venv, the selected tests may need background steps, taken only when a selected test needs
# them (conftest.py's background_steps, read from the collected selection):
#   server-env NAME            the vLLM / SGLang server environments (core-rl server-env create NAME, ~2.5 GB
#                              each under $CORE_RL_HOME, default ~/.cache/core-rl; instant once built), for
#                              tests marked server_env; -m "not server_env" leaves those tests out
#   after-setup slurm-packages as root with apt-get, Debian's Slurm and MUNGE packages, system-wide (slurmctld,
#                              slurmd, slurm-client, munge), for the Slurm launcher's one-node test
# Opt-outs:  CORE_RL_TEST_INSTALL=0  use $VENV (default .venv) as it is, without installing
#            CORE_RL_SLURM_TEST=0    never install Slurm's packages (the test then skips, saying why)
#            CORE_RL_TEST_PLAN_ONLY=1  print what the selection would build and install, and stop
#            CORE_RL_TEST_WORKERS=N  pytest workers (default 3; 0: one process)
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests' processes write the bytecode of the modules they import (into .venv and the checkout),
# so nothing is compiled twice and the install compiles nothing ahead (scripts/install.sh)
unset PYTHONDONTWRITEBYTECODE
VENV=${VENV:-.venv}
plan_only=${CORE_RL_TEST_PLAN_ONLY:-0}
if [ "$plan_only" = "0" ] && [ "${CORE_RL_TEST_INSTALL:-1}" != "0" ]; then
  bash scripts/install.sh
elif [ ! -x "$VENV/bin/python" ]; then
  echo "test.sh: $VENV has no python: run bash scripts/install.sh first (or leave CORE_RL_TEST_INSTALL unset)" >&2
  exit 2
fi

builds=$(mktemp -d "${TMPDIR:-/tmp}/core-rl-server-envs.XXXXXX")
trap 'rm -rf "$builds"' EXIT  # a failed step's log is printed below first
export CORE_RL_SERVER_ENV_BUILDS=$builds
export CORE_RL_TEST_PLAN=$builds/plan
export CORE_RL_TEST_CPU=${CORE_RL_TEST_CPU:-$builds/cpu}  # each test's CPU seconds; the heaviest files are listed at the end (conftest.py)
mkdir -p "$CORE_RL_TEST_CPU"

slurm_skipped() {  # why Slurm's packages are not installed here (nothing: they are to be)
  if [ "${CORE_RL_SLURM_TEST:-1}" = "0" ]; then echo "CORE_RL_SLURM_TEST=0"
  elif command -v slurmctld > /dev/null; then echo "installed already"
  elif [ "$(id -u)" != "0" ]; then echo "not root"
  elif ! command -v apt-get > /dev/null; then echo "no apt-get"
  fi
}

describe_step() {  # KIND NAME: what the step does here, one line
  case "$1 ${2:-}" in
    "server-env "*) echo "build the $2 server environment (core-rl server-env create $2, ~2.5 GB under \
${CORE_RL_HOME:-~/.cache/core-rl}; instant when built)" ;;
    "after-setup slurm-packages")
      local why; why=$(slurm_skipped)
      if [ -n "$why" ]; then echo "Slurm's packages: not installed ($why)"
      else echo "apt-get install slurmctld slurmd slurm-client munge, system-wide (as root)"; fi ;;
    *) echo "unknown step '$1 ${2:-}': nothing to do (its tests say what they lack)" ;;
  esac
}

start_step() {  # KIND NAME: start the step in the background; its NAME.log exists on return
  case "$1 ${2:-}" in
    "server-env "*)
      : > "$builds/$2.log"
      ( start=$(date +%s)
        status=0
        "$VENV/bin/core-rl" server-env create "$2" > "$builds/$2.log" 2>&1 || status=$?
        echo "the $2 server environment: status $status after $(( $(date +%s) - start )) s" >> "$builds/$2.log"
        echo "$status" > "$builds/$2.rc.partial" && mv "$builds/$2.rc.partial" "$builds/$2.rc" ) & ;;  # never half-written
    "after-setup slurm-packages")
      [ -z "$(slurm_skipped)" ] || return 0
      : > "$builds/slurm-packages.log"
      ( export DEBIAN_FRONTEND=noninteractive
        status=0
        { timeout 300 apt-get update -q \
            && timeout 300 apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
        } > "$builds/slurm-packages.log" 2>&1 || status=$?
        echo "$status" > "$builds/slurm-packages.rc.partial" && mv "$builds/slurm-packages.rc.partial" "$builds/slurm-packages.rc" ) & ;;
  esac
}

start_planned_steps() {  # once pytest has written the plan (or ended without one): start its steps, wait for them
  while [ ! -f "$CORE_RL_TEST_PLAN" ] && [ ! -f "$builds/pytest.done" ]; do sleep 1; done
  if [ -f "$CORE_RL_TEST_PLAN" ]; then
    while read -r kind name; do start_step "$kind" "$name"; done < "$CORE_RL_TEST_PLAN"
  fi
  : > "$CORE_RL_TEST_PLAN.started"  # the tests waiting for a step look for its NAME.log from now on
  wait
}

if [ "$plan_only" != "0" ]; then
  collect_log=$builds/collect.log
  collected=0
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/python" -m pytest -q --collect-only -p no:xdist "$@" \
    > "$collect_log" 2>&1 || collected=$?
  if [ "$collected" != "0" ] && [ "$collected" != "5" ]; then  # 5: the selection holds no test
    cat "$collect_log"
    echo "test.sh: collecting the selection failed (pytest's status $collected)" >&2
    exit 1
  fi
  echo "test.sh plan: $(tail -n 1 "$collect_log")"
  if [ ! -s "$CORE_RL_TEST_PLAN" ]; then
    echo "  nothing to build or install besides $VENV"
  fi
  while read -r kind name; do echo "  $kind $name: $(describe_step "$kind" "$name")"; done < "$CORE_RL_TEST_PLAN"
  exit 0
fi

"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# The steps build in the background while the tests that do not need them run: the files holding
# tests that do are collected last and wait for their step (conftest.py). A failed build fails the
# run and prints its log.
start_planned_steps &
steps=$!
# Three pytest workers (pytest-xdist; CORE_RL_TEST_WORKERS to change, 0 for none), each taking whole
# files so a module's server or model fixture is built once, in the order conftest.py gives them.
# The 30 slowest tests are listed at the end: where to look first when the run grows.
workers=${CORE_RL_TEST_WORKERS:-3}
parallel=()
if [ "$workers" != "0" ]; then parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
# Inductor compiles in the test's own process (TORCHINDUCTOR_COMPILE_THREADS=1): its default on this
# machine, a pool of compile workers that each import torch again, doubled the CPU of the compiled-engine
# test (72.8 CPU s in 71.9 s against 35.9 in 40.7 with one thread, on 2 cores).
status=0
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1} \
  "$VENV/bin/python" -m pytest -q --durations=30 "${parallel[@]}" "$@" || status=$?
: > "$builds/pytest.done"
wait "$steps"
if [ -f "$CORE_RL_TEST_PLAN" ]; then
  while read -r kind name; do
    [ -f "$builds/$name.rc" ] || continue  # not started here
    rc=$(cat "$builds/$name.rc")
    if [ "$kind" = "server-env" ]; then
      tail -n 1 "$builds/$name.log"
      if [ "$rc" != "0" ]; then
        cat "$builds/$name.log"
        echo "building the $name server environment failed" >&2
        status=1
      fi
    elif [ "$rc" != "0" ]; then
      echo "the background step $name failed; the end of its log:"
      tail -n 40 "$builds/$name.log"
    fi
  done < "$CORE_RL_TEST_PLAN"
fi
exit "$status"
