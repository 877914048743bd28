"""Starts vLLM's OpenAI API server: ``python -m core_rl_vllm_server ARGS`` is
``python -m vllm.entrypoints.openai.api_server ARGS``, except that with ``CORE_RL_FORK_ENGINE=1`` in
the environment the engine-core process is forked from the API process instead of spawned.

This file runs in the vllm server environment (the engine puts its directory on the server's
``PYTHONPATH``), not in the trainer. vLLM's CPU platform always asks for ``spawn``; a spawned engine
core then imports vLLM, torch and transformers again before it loads the model: about 10 s of a 27 s
start on an idle 2-core machine, 18 s under load. A forked one shares the modules the API process has
already imported (17.5 s in all). The engine sets the variable only for a CPU server whose model runs
inside the engine-core process (one tensor- and data-parallel rank), the layout measured with fork:
same tokens, log-probs and generation speed as with spawn. Multi-rank and GPU servers keep vLLM's
``spawn``. Where this vLLM has no CPU platform hook to wrap, the server starts as vLLM's own would,
saying so in its log.

Under core-rl's supervisor, vLLM's ZMQ sockets go to the server's private runtime directory
(``VLLM_RPC_BASE_PATH`` from ``CORE_RL_SERVER_RUNTIME_DIR``), which the supervisor removes when the
server is gone; vLLM's default, the system's temporary directory, keeps those of a killed server.
So does the ``file://`` store through which a single-process executor forms its one-rank group
(``vllm_dist_<hex>``, one per start): it is made in the runtime directory too, wherever the executor
runs in this process or one forked from it (CPU servers). A spawned engine core (GPU servers)
imports vLLM afresh and keeps vLLM's own place.
"""

from __future__ import annotations

import atexit
import os
import runpy
import shutil
import sys
import uuid

FORK_VARIABLE = "CORE_RL_FORK_ENGINE"
RUNTIME_DIR_VARIABLE = "CORE_RL_SERVER_RUNTIME_DIR"
API_SERVER = "vllm.entrypoints.openai.api_server"


def fork_engine_core() -> bool:
    """Have vLLM's CPU platform leave ``VLLM_WORKER_MULTIPROC_METHOD=fork`` once it has configured
    itself (it sets ``spawn`` there). False when this vLLM lacks the hook."""
    try:
        from vllm.platforms.cpu import CpuPlatform

        configure = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]
    except (ImportError, AttributeError) as exc:
        print(f"core-rl: the engine core is spawned as vLLM does ({exc})", file=sys.stderr, flush=True)
        return False

    def check_and_update_config(cls, vllm_config):
        configure(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]
    return True


def remove_at_exit(runtime: str) -> None:
    """Remove ``runtime`` when this process exits (a supervisor killed outright cannot; processes
    forked from this one leave it alone)."""
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(runtime, ignore_errors=True))


def rendezvous_in(runtime: str) -> None:
    """Have vLLM's executors make their ``file://`` rendezvous store in ``runtime``: replaces
    ``vllm.utils.network_utils.get_file_store_init_method`` before the executor modules import the
    name (importing that module loads no executor)."""
    from vllm.utils import network_utils

    def file_store_in_runtime() -> str:
        return f"file://{runtime}/vllm_dist_{uuid.uuid4().hex}"

    network_utils.get_file_store_init_method = file_store_in_runtime


def main() -> None:
    runtime = os.environ.get(RUNTIME_DIR_VARIABLE)
    if runtime:
        remove_at_exit(runtime)
        os.environ.setdefault("VLLM_RPC_BASE_PATH", runtime)
        rendezvous_in(runtime)
    if os.environ.get(FORK_VARIABLE) == "1":
        fork_engine_core()
    runpy.run_module(API_SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
