"""The rollout engine asleep while the trainer trains (``rollout.sleep_while_training``): where the
engine shares the trainer's GPUs, it gives back its memory for the update and takes it back for
the weight update and the next generation (:meth:`~core_rl.interfaces.RolloutEngine.release_memory`).

:func:`build_rollout_engine` chooses the GPUs of the servers it starts where the configuration
leaves that to the placement (:func:`core_rl.launch.gpus.resolve_server_gpus`), sizes servers on
the trainer's GPU (:mod:`core_rl.rollout.colocated_memory`), resolves the option
(``auto``: :func:`core_rl.launch.placement.sleeps_while_training`), builds the engine with it resolved
(its factory sees ``rollout.sleep_while_training`` as ``True`` or ``False``: a server engine must
start its servers able to sleep) and returns the
:class:`RolloutSleep` the synchronous loop drives on rank 0, each step:

1. before the step's first generation: the KV cache comes back (:meth:`RolloutSleep.before_generation`);
2. after its last generation and the rewards (dynamic sampling may generate several batches):
   everything goes (:meth:`RolloutSleep.after_generation`); the update then trains, reference
   and recomputed log-probs included, with that memory free;
3. in the weight sync, once the trainer has prepared the weights (exported or gathered) and just
   before the engine loads them: the weights' storage comes back (:meth:`RolloutSleep.before_weight_update`).

Before memory comes back, torch's cached device memory is given back (:func:`release_cached_memory`,
on every rank before the weight update: :func:`peer_rollout_sleep`): training leaves its
activations' blocks in torch's caching allocator, free to the trainer but not to a server process
waking on that GPU. With sleeping off, and before the first release, every call does nothing.

Metrics (rank 0, steps where the engine slept): ``timing/rollout_release_s``,
``timing/rollout_restore_s`` (the step's KV-cache and weights restores together) and, where the
trainer's CUDA device reports it, ``memory/rollout_released_gib``: how much the device's free
memory grew across the release (``torch.cuda.mem_get_info``: every process's memory on it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from core_rl.config.schema import RunConfig
from core_rl.errors import stderr_line
from core_rl.interfaces import RolloutEngine
from core_rl.launch.gpus import resolve_server_gpus
from core_rl.launch.placement import SLEEP_KEY, rollout_device, sleeps_while_training
from core_rl.loops.preflight import detect_machine
from core_rl.plugins.components import build_component
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ROLLOUT_ENGINE
from core_rl.roles.built_engines import BuiltEngine
from core_rl.roles.remote_code import rollout_factory_kwargs
from core_rl.rollout.colocated_memory import fit_colocated_memory, held_for_trainer, release_cached_memory, shared_gpu
from core_rl.sync.lora import adapter_sync
from core_rl.sync.lora import rollout_factory_kwargs as lora_kwargs

GIB = 2**30


def build_rollout_engine(
    cfg: RunConfig, host: PluginHost, run_dir: Path, built: Sequence[BuiltEngine] = ()
) -> tuple[RolloutEngine, RolloutSleep]:
    """The run's rollout engine, built with ``rollout.sleep_while_training`` resolved for this
    machine, and the :class:`RolloutSleep` that drives it (doing nothing when sleeping is off). An
    ``auto`` that resolves to on is announced on stderr, as are the servers' GPUs and memory share
    where the configuration leaves them to the placement (``built``: this rank's train engines)."""
    entry = host.get(ROLLOUT_ENGINE, cfg.rollout.engine.name)
    cuda = torch.cuda.is_available()
    enabled = _sleeps(cfg, entry, cuda)
    routes = cfg.rollout.return_routed_experts or cfg.actor.moe.routing_replay == "rollout"
    rollout = attrs.evolve(cfg.rollout, sleep_while_training=enabled, return_routed_experts=routes)
    machine = detect_machine()
    engine_config, gpus_note = resolve_server_gpus(cfg, machine)
    shared = shared_gpu(engine_config, built, machine)  # servers on the trainer's GPU: rollout/colocated_memory.py
    engine_config, memory_note = fit_colocated_memory(engine_config, shared)
    for note in (gpus_note, memory_note):
        if note:
            stderr_line(f"core-rl: note: {note}")
    kwargs = {**rollout_factory_kwargs(cfg), **lora_kwargs(cfg)}
    with held_for_trainer(shared):
        engine = build_component(
            entry, rollout, engine_config, model_path=cfg.actor.model_path, run_dir=run_dir, **kwargs
        )
    if enabled and cfg.rollout.sleep_while_training == "auto":
        where = rollout_device(cfg, cuda)[1]
        stderr_line(
            f"core-rl: note: {SLEEP_KEY}: auto -> true (placement colocate, {where}, synchronous): the rollout "
            "engine gives back its GPU memory while the trainer trains"
        )
    return engine, RolloutSleep(engine if enabled else None)


def peer_rollout_sleep(cfg: RunConfig, host: PluginHost) -> RolloutSleep:
    """The :class:`RolloutSleep` of a rank without the rollout engine: it drives nothing, but where
    the run's engine sleeps it gives back this rank's cached device memory before each weight
    update (a colocated server may wake on this rank's GPU)."""
    entry = host.get(ROLLOUT_ENGINE, cfg.rollout.engine.name)
    return RolloutSleep(None, release_cache=_sleeps(cfg, entry, torch.cuda.is_available()))


def _sleeps(cfg: RunConfig, entry: Any, cuda: bool) -> bool:
    """``rollout.sleep_while_training`` resolved for the engine ``entry`` (its config class says
    whether it can give back memory) on a machine with or without CUDA. Never with
    ``rollout.lora_sync: adapter``: a sleeping server drops its base weights, which that sync never
    sends again (:mod:`core_rl.sync.lora`)."""
    releases = bool(getattr(entry.config_cls, "releases_memory", False)) and not adapter_sync(cfg)
    return sleeps_while_training(cfg, releases_memory=releases, cuda_available=cuda)


class RolloutSleep:
    """Drives one rollout engine's sleep through a synchronous step (see the module doc); with
    ``engine`` ``None`` (sleeping off, or a rank without the engine) every call does nothing."""

    def __init__(self, engine: RolloutEngine | None = None, *, release_cache: bool | None = None) -> None:
        self.engine = engine
        #: give back torch's cached device memory before the engine takes its memory back (default:
        #: with an engine): what training left in the caching allocator is free to torch but not to
        #: a server in another process
        self.release_cache = engine is not None if release_cache is None else release_cache
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
        if self.engine is None:  # a peer rank: its cache goes back for a server waking on its GPU
            if self.release_cache:
                release_cached_memory()
            return {}
        self._restore(("weights",))  # gives the cache back first
        metrics = {"timing/rollout_restore_s": self._restore_s}
        self._restore_s = 0.0
        return metrics

    def _restore(self, parts: Sequence[str]) -> None:
        wanted = [p for p in parts if p in self._asleep]
        if self.engine is None or not wanted:
            return
        start = time.perf_counter()
        if self.release_cache:
            release_cached_memory()
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
