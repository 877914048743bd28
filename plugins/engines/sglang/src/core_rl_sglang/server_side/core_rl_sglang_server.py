"""Starts an SGLang server: ``python -m core_rl_sglang_server ARGS`` is
``python -m sglang.launch_server ARGS``, except that with ``CORE_RL_FORK_ENGINE=1`` in the
environment the scheduler and detokenizer processes are forked from the server process instead of
spawned.

This file runs in the sglang server environment (the engine puts its directory on the server's
``PYTHONPATH``), not in the trainer. SGLang sets the ``spawn`` start method for every launch; each
spawned process then imports SGLang, torch and transformers again before it loads the model: about
11 s of a 29 s start on an idle 2-core machine, 40 s under load (two processes importing at once). A
forked one shares the modules the server process has already imported (17.8 s in all). The engine
sets the variable only for a CPU server with one tensor- and data-parallel rank, the layout measured
with fork: same tokens and log-probs as with spawn. Multi-rank and GPU servers keep SGLang's
``spawn``. Where this SGLang has no hook to wrap, the server starts as SGLang's own would, saying so
in its log.

It also adds core-rl's route for requests with pixel inputs (:mod:`core_rl_sglang_media`).

Under core-rl's supervisor, SGLang's IPC sockets (named with :mod:`tempfile` in
``PortArgs.init_new``) go to the server's private runtime directory (``CORE_RL_SERVER_RUNTIME_DIR``),
which the supervisor removes when the server is gone; in the system's temporary directory those of a
killed server would stay. So would the file in ``/dev/shm`` through which its scheduler reports its
load (``sglang_loads_<id>.shm``, one per start): the server lists it in the runtime directory's
``remove-when-gone`` for the supervisor to remove, and removes it itself when it exits.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import shutil
import sys
import tempfile

FORK_VARIABLE = "CORE_RL_FORK_ENGINE"
RUNTIME_DIR_VARIABLE = "CORE_RL_SERVER_RUNTIME_DIR"
#: core_rl_server_kit.supervise.LEFTOVERS_FILE (this file runs where core-rl is not installed)
LEFTOVERS_FILE = "remove-when-gone"
LAUNCH_SERVER = "sglang.launch_server"


def fork_subprocesses() -> bool:
    """Have SGLang's launch set the ``fork`` start method right after its own setup (which sets
    ``spawn``). False when this SGLang lacks the hook."""
    try:
        from sglang.srt.entrypoints import engine

        configure = engine._set_envs_and_config
    except (ImportError, AttributeError) as exc:
        print(f"core-rl: SGLang's processes are spawned as SGLang does ({exc})", file=sys.stderr, flush=True)
        return False

    def set_envs_and_config(server_args):
        configure(server_args)
        multiprocessing.set_start_method("fork", force=True)

    engine._set_envs_and_config = set_envs_and_config
    return True


def ipc_in(runtime: str) -> bool:
    """Have ``PortArgs.init_new`` name its IPC sockets in ``runtime`` (only while it runs: the rest of
    the server keeps the system's temporary directory). False when this SGLang lacks the hook."""
    try:
        from sglang.srt.server_args import PortArgs

        init_new = PortArgs.init_new
    except (ImportError, AttributeError) as exc:
        print(f"core-rl: SGLang's sockets go to {tempfile.gettempdir()} ({exc})", file=sys.stderr, flush=True)
        return False

    def init_new_in_runtime(*args, **kwargs):
        saved, tempfile.tempdir = tempfile.tempdir, runtime
        try:
            port_args = init_new(*args, **kwargs)
        finally:
            tempfile.tempdir = saved
        load_report_goes_with_the_server(runtime, port_args)
        return port_args

    PortArgs.init_new = staticmethod(init_new_in_runtime)
    return True


def load_report_goes_with_the_server(runtime: str, port_args: object) -> None:
    """List the ``/dev/shm`` file of these ports' load report in ``runtime``'s :data:`LEFTOVERS_FILE`
    and remove it when this process exits. Nothing where this SGLang names no such file."""
    try:
        from sglang.srt.managers.load_snapshot import shm_path_for

        path = shm_path_for(port_args.instance_id)  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        return
    with open(os.path.join(runtime, LEFTOVERS_FILE), "a") as listing:
        listing.write(path + "\n")
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and _unlink(path))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_at_exit(runtime: str) -> None:
    """Remove ``runtime`` when this process exits (a supervisor killed outright cannot; processes
    forked from this one leave it alone)."""
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(runtime, ignore_errors=True))


def main() -> None:
    runtime = os.environ.get(RUNTIME_DIR_VARIABLE)
    if runtime:
        remove_at_exit(runtime)
        ipc_in(runtime)
    if os.environ.get(FORK_VARIABLE) == "1":
        fork_subprocesses()
    import core_rl_sglang_media

    core_rl_sglang_media.register()
    runpy.run_module(LAUNCH_SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
