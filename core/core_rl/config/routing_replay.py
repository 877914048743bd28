"""What routing replay (``actor.moe.routing_replay``, ``rollout.return_routed_experts``) asks of the
selected engines, checked when a configuration is validated.

Engines declare what they can do on their config class (as ``weight_sync_modes``):

- a rollout engine's ``returns_routed_experts = True``: its samples carry
  ``Sample.routed_experts`` when its factory's ``rollout.return_routed_experts`` is on;
- a train engine's ``replays_routes = True``: its forwards replay the batch's ``routed_experts``
  (``actor.moe.routing_replay: rollout``) or the routes of its own first forward (``first_forward``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core_rl.plugins.kinds import ROLLOUT_ENGINE, TRAIN_ENGINE

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig
    from core_rl.plugins.host import PluginHost


def returns_routes(host: PluginHost, name: str) -> bool | None:
    """Whether rollout engine ``name`` can return routed experts; ``None`` for an unknown name."""
    entry = host.registries[ROLLOUT_ENGINE.key].get(name)
    return None if entry is None else bool(getattr(entry.config_cls, "returns_routed_experts", False))


def routing_replay_problems(host: PluginHost, cfg: RunConfig) -> list[str]:
    """``actor.moe.routing_replay`` other than ``none`` needs a train engine that replays routes;
    ``rollout`` (and ``rollout.return_routed_experts``) a rollout engine that returns them (unless
    the run trains on saved rollouts, ``rollout.replay_from``, whose routes were saved with them)."""
    problems = []
    mode = cfg.actor.moe.routing_replay
    if mode != "none":
        entry = host.registries[TRAIN_ENGINE.key].get(cfg.actor.engine.name)
        if entry is not None and not getattr(entry.config_cls, "replays_routes", False):
            problems.append(
                f"actor.moe.routing_replay: {mode} needs a train engine that replays MoE routes, but train "
                f"engine {entry.name!r} ({entry.distribution}) cannot; use actor.engine.name fsdp, or set "
                "routing_replay: none"
            )
    wants_routes = mode == "rollout" or cfg.rollout.return_routed_experts
    if wants_routes and cfg.rollout.replay_from is None:
        name = cfg.rollout.engine.name
        if returns_routes(host, name) is False:
            entry = host.registries[ROLLOUT_ENGINE.key].get(name)
            assert entry is not None
            key = "actor.moe.routing_replay: rollout" if mode == "rollout" else "rollout.return_routed_experts: true"
            problems.append(
                f"{key} needs routed experts from the rollout engine, but rollout engine {name!r} "
                f"({entry.distribution}) cannot return them; use rollout.engine.name hf, or "
                "actor.moe.routing_replay: first_forward (replays the trainer's own first forward) or none"
            )
    return problems
