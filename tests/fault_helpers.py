"""Shared set-up of the fault tests: a tiny model and task, a run configuration, ways to run it
(in this process, or as a real ``core-rl train`` process) and bitwise comparisons of runs."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from core_rl.testing import preloaded
from core_rl.testing.faults import build_task, checkpoint, merged, run_dir, stable_metrics, state_digest

__all__ = ["build_task", "checkpoint", "merged", "run_dir", "stable_metrics", "state_digest"]


def write_config(config: Mapping[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(dict(config)))
    return path


def train_here(config: Mapping[str, Any], host) -> Mapping[str, Any]:
    """Load ``config`` with ``host`` and train in this process."""
    from core_rl.config import load_config
    from core_rl.loops import train

    path = Path(config["experiment"]["output_dir"]).parent / f"{config['experiment']['name']}.yaml"
    return train(load_config(write_config(config, path), host=host), host=host)


def cli_command(*args: str, faults: bool = False) -> list[str]:
    """``core-rl ARGS`` as a command; ``faults``: with :mod:`core_rl.testing.faults` installed."""
    return [sys.executable, "-m", "core_rl.testing.faults" if faults else "core_rl.cli", *args]


def cli_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def cli_train(config: Mapping[str, Any], *overrides: str, faults: bool = False, timeout: float = 300):
    """Run ``core-rl train`` on ``config`` in a new process; return the completed process."""
    path = Path(config["experiment"]["output_dir"]).parent / f"{config['experiment']['name']}.yaml"
    write_config(config, path)
    return preloaded.run(
        cli_command("train", str(path), *overrides, faults=faults),
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=timeout,
    )


def ranks_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """A process of ``tests/test_ranks.py``: exercises the agreement points of
    :mod:`core_rl.launch.ranks` over a real 2-process gloo group and writes what it saw."""
    import datetime

    import torch.distributed as dist
    from core_rl.errors import ConfigError
    from core_rl.launch.ranks import agree_after, broadcast_outcome, set_collective_timeout
    from core_rl.loops.errors import CollectiveTimeout, RewardError

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    seen: dict[str, Any] = {}

    def attempt(name: str, fn) -> None:
        try:
            seen[name] = ["ok", fn()]
        except Exception as exc:
            seen[name] = [type(exc).__name__, str(exc), getattr(exc, "exit_code", None)]

    attempt("build", lambda: agree_after("building (rank 0)", ValueError("boom") if rank == 0 else None))
    attempt("config", lambda: agree_after("step 1", ConfigError("x: bad") if rank == 1 else None))
    attempt("stop", lambda: agree_after("step 2", None, "SIGTERM" if rank == 1 else None))
    attempt("send", lambda: broadcast_outcome("the batch of step 3", "batch" if rank == 0 else None, None))
    attempt(
        "send_failed",
        lambda: broadcast_outcome("the batch of step 4", None, RewardError("broke") if rank == 0 else None),
    )
    set_collective_timeout(2.0)
    if rank == 1:
        time.sleep(6.0)
    try:
        agree_after("step 5", None)
        seen["timeout"] = ["ok"]
    except CollectiveTimeout as exc:
        seen["timeout"] = ["CollectiveTimeout", str(exc)]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)  # the group is broken now; do not wait in its destructor
