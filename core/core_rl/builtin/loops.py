"""The built-in ``rl`` training loop (:class:`core_rl.loops.rl.loop.SyncTrainer`), registered through
the same hook as a third party's loop. Registration only: no torch import."""

from __future__ import annotations

from typing import Any

from core_rl.config.schema import RunConfig
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import TrainingLoop
from core_rl.plugins.host import PluginHost


def make_rl_loop(cfg: RunConfig, host: PluginHost, *, stop: Any, data_rows: Any, config: None) -> TrainingLoop:
    """factory: the synchronous RL loop (rollout, rewards, advantages, policy loss)."""
    from core_rl.loops.rl.loop import SyncTrainer

    return SyncTrainer(cfg, host, stop=stop, data_rows=data_rows)


@hookimpl
def core_rl_register_loops(register: Register) -> None:
    register(
        "rl",
        make_rl_loop,
        description="Synchronous RL: rollout, rewards, advantages, policy-loss updates, weight sync",
    )
