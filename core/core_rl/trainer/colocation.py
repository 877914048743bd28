"""The rollout engine asleep while the trainer trains (``rollout.sleep_while_training``): where the
engine shares the trainer's GPUs, it gives back its memory for the update and takes it back for
the weight update and the next generation (:meth:`~core_rl.interfaces.RolloutEngine.release_memory`).

:func:`build_rollout_engine` resolves the option (``auto``: :func:`core_rl.placement.sleeps_while_training`),
builds the engine with it resolved (its factory sees ``rollout.sleep_while_training`` as ``True``
or ``False``: a server engine must start its servers able to sleep) and returns the
:class:`RolloutSleep` the synchronous loop drives on rank 0, each step:

1. before the step's first generation: the KV cache comes back (:meth:`RolloutSleep.before_generation`);
2. after its last generation and the rewards (dynamic sampling may generate several batches):
   everything goes (:meth:`RolloutSleep.after_generation`); the update then trains, reference
   and recomputed log-probs included, with that memory free;
3. in the weight sync, once the trainer has prepared the weights (exported or gathered) and just
   before the engine loads them: the weights' storage comes back (:meth:`RolloutSleep.before_weight_update`).

With sleeping off, on ranks other than 0, and before the first release, every call does nothing.

Metrics (rank 0, steps where the engine slept): ``timing/rollout_release_s``,
``timing/rollout_restore_s`` (the step's KV-cache and weights restores together) and, where the
trainer's CUDA device reports it, ``memory/rollout_released_gib``: how much the device's free
memory grew across the release (``torch.cuda.mem_get_info``: every process's memory on it).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from core_rl.components import build_component
from core_rl.config.schema import RunConfig
from core_rl.interfaces import RolloutEngine
from core_rl.kinds import ROLLOUT_ENGINE
from core_rl.placement import SLEEP_KEY, rollout_device, sleeps_while_training
from core_rl.plugins import PluginHost

GIB = 2**30


def build_rollout_engine(cfg: RunConfig, host: PluginHost, run_dir: Path) -> tuple[RolloutEngine, RolloutSleep]:
    """The run's rollout engine, built with ``rollout.sleep_while_training`` resolved for this
    machine, and the :class:`RolloutSleep` that drives it (doing nothing when sleeping is off). An
    ``auto`` that resolves to on is announced on stderr."""
    entry = host.get(ROLLOUT_ENGINE, cfg.rollout.engine.name)
    releases = bool(getattr(entry.config_cls, "releases_memory", False))
    cuda = torch.cuda.is_available()
    enabled = sleeps_while_training(cfg, releases_memory=releases, cuda_available=cuda)
    rollout = attrs.evolve(cfg.rollout, sleep_while_training=enabled)
    engine = build_component(
        entry, rollout, cfg.rollout.engine.config, model_path=cfg.actor.model_path, run_dir=run_dir
    )
    if enabled and cfg.rollout.sleep_while_training == "auto":
        where = rollout_device(cfg, cuda)[1]
        print(
            f"core-rl: note: {SLEEP_KEY}: auto -> true (placement colocate, {where}, synchronous): the rollout "
            "engine gives back its GPU memory while the trainer trains",
            file=sys.stderr,
            flush=True,
        )
    return engine, RolloutSleep(engine if enabled else None)


class RolloutSleep:
    """Drives one rollout engine's sleep through a synchronous step (see the module doc); with
    ``engine`` ``None`` (sleeping off, or a rank without the engine) every call does nothing."""

    def __init__(self, engine: RolloutEngine | None = None) -> None:
        self.engine = engine
        self._asleep: set[str] = set()  # the parts given back and not yet taken back
        self._restore_s = 0.0  # restores since the last weight update, reported with it

    @property
    def enabled(self) -> bool:
        return self.engine is not None

    def before_generation(self) -> None:
        """Take back the KV cache (a no-op unless released)."""
        self._restore(("kv_cache",))

    def after_generation(self) -> dict[str, float]:
        """Give back the engine's memory; its release time and the memory freed."""
        if self.engine is None:
            return {}
        free_before = _device_free_bytes()
        start = time.perf_counter()
        self.engine.release_memory()
        metrics = {"timing/rollout_release_s": time.perf_counter() - start}
        self._asleep = {"weights", "kv_cache"}
        free_after = _device_free_bytes()
        if free_before is not None and free_after is not None:
            metrics["memory/rollout_released_gib"] = (free_after - free_before) / GIB
        return metrics

    def before_weight_update(self) -> dict[str, float]:
        """Take back the weights' storage; the restore time of the step (KV cache and weights)."""
        if self.engine is None:
            return {}
        self._restore(("weights",))
        metrics = {"timing/rollout_restore_s": self._restore_s}
        self._restore_s = 0.0
        return metrics

    def _restore(self, parts: Sequence[str]) -> None:
        wanted = [p for p in parts if p in self._asleep]
        if self.engine is None or not wanted:
            return
        start = time.perf_counter()
        self.engine.restore_memory(wanted)
        self._restore_s += time.perf_counter() - start
        self._asleep.difference_update(wanted)


def _device_free_bytes() -> int | None:
    """Free memory of the trainer's current CUDA device (all processes'), or ``None`` where this
    process has not set up CUDA (asking would create a CUDA context of its own)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]
