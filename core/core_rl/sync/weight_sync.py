"""Moving the policy's new weights to the rollout engine after each update (the RL loop's
:class:`WeightSyncStage`), as ``rollout.weight_sync`` says: ``memory`` (in buckets, handed over
in-process: :func:`sync_in_memory`), ``collective`` (the weights over a process group:
:func:`collective_state`) or ``disk`` (a Hugging Face directory the engine loads, or with
``rollout.lora_sync: adapter`` the LoRA adapter alone: :mod:`core_rl.sync.lora`;
in the background for an asynchronous run once its controller runs: :mod:`core_rl.sync.background_load`).
After a sync (``rollout.sync_check``) the rollout engine must show it holds the weights sent
(:mod:`core_rl.sync.check`; for a load in the background, checked in the background after
it, the mismatch then stopping the run at the next step's wait). A test hook injects faults on the
way (:mod:`core_rl.sync.faults`). A rollout engine asleep while the trainer trained takes
back its weights' storage once the trainer has the weights ready, just before it loads them
(:mod:`core_rl.rollout.colocation`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager

import torch

from core_rl.config.schema import RunConfig
from core_rl.interfaces import RolloutEngine, TrainEngine
from core_rl.launch.ranks import agree_after
from core_rl.loops.rl.rollout_flow import RolloutFlow
from core_rl.rollout.colocation import RolloutSleep
from core_rl.sync.background_load import BackgroundWeightLoad
from core_rl.sync.buckets import nbytes
from core_rl.sync.check import SentWeights, SyncCheck, WeightSyncMismatch
from core_rl.sync.faults import SyncFault, injected
from core_rl.sync.lora import adapter_dir, adapter_sync, prune_adapter_dirs


class WeightSyncStage:
    """The weight-sync stage of the RL loop. Every rank calls :meth:`sync`; the ``engine``'s
    weights reach ``rollout``, which only rank 0 holds (``None`` elsewhere), paused under its
    rollout controller ``flow`` (``None``: none); ``weight_load`` runs rank 0's loads in the
    background, ``rollout_sleep`` wakes an engine asleep while the trainer trained."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        engine: TrainEngine,
        rollout: RolloutEngine | None,
        flow: RolloutFlow | None,
        weight_load: BackgroundWeightLoad,
        rollout_sleep: RolloutSleep,
        is_main: bool,
    ) -> None:
        self.cfg, self.run_dir, self.is_main = cfg, cfg.experiment.run_dir, is_main
        self.engine, self.rollout, self.flow = engine, rollout, flow
        self.weight_load, self.rollout_sleep = weight_load, rollout_sleep

    def _rollout_paused(self, version: int) -> AbstractContextManager[None]:
        """Rank 0: the rollout controller paused while the engine loads ``version``."""
        return self.flow.paused(version) if self.flow is not None else contextlib.nullcontext()

    def _loads_in_background(self) -> bool:
        """Whether the rollout engine loads a written version while the trainer goes on
        (:mod:`core_rl.sync.background_load`): an asynchronous run syncing by disk, once its
        controller runs (a resumed run's first load must land before the controller starts)."""
        return (
            self.cfg.rollout.weight_sync == "disk"
            and self.cfg.rollout.controller.max_head_offpolicyness > 0
            and self.flow is not None
            and self.flow.controller is not None
        )

    @functools.cached_property
    def sync_check(self) -> SyncCheck:
        """Which syncs are checked, and the check (:mod:`core_rl.sync.check`)."""
        return SyncCheck(self.cfg)

    def sync(self, version: int) -> dict[str, float]:
        """Move the policy's weights to the rollout engine and, when due, check that it holds them;
        return ``weight_sync/bytes`` (and, when loads run in the background, the wait for the
        previous one and its duration; when checked, ``timing/sync_check_s``). A failed check
        raises :class:`~core_rl.sync.check.WeightSyncMismatch` on every rank; so does an
        engine refusing the weights (on the main rank: :meth:`SyncCheck.refusals`)."""
        assert self.engine is not None
        if self.cfg.rollout.replay_from is not None:  # saved rollouts, no rollout engine to receive them
            return {}
        sent = self.sync_check.start(version, self.rollout.fingerprint_prefix if self.rollout is not None else None)
        fault = injected(version) if self.rollout is not None else None
        mode = self.cfg.rollout.weight_sync
        if mode == "disk":
            metrics = self._sync_by_disk(version, sent, fault)
            if self._loads_in_background():
                return metrics  # checked after the load, in the background
        elif mode == "memory":
            paused = self._rollout_paused(version)  # entered only where the rollout engine is
            woken = self.rollout_sleep.before_weight_update()
            with self.sync_check.refusals(version):
                sent_bytes = sync_in_memory(self.engine, self.rollout, version, paused, sent=sent, fault=fault)
            metrics = {"weight_sync/bytes": sent_bytes, **woken}
        else:
            metrics = self._sync_collective(version, sent, fault)
        if sent is None:
            return metrics
        error: WeightSyncMismatch | None = None
        if self.rollout is not None:
            try:
                metrics.update(self.sync_check.verify(self.rollout, sent))
            except WeightSyncMismatch as exc:
                error = exc
        agree_after(f"the weight sync check of version {version} (rank 0)", error)
        return metrics

    def _sync_collective(self, version: int, sent: SentWeights | None, fault: SyncFault | None) -> dict[str, float]:
        """``weight_sync: collective``: the weights broadcast from the main rank to the engine's workers."""
        assert self.engine is not None
        state = collective_state(self.engine)
        woken = self.rollout_sleep.before_weight_update()
        if self.rollout is not None:
            if sent is not None:
                sent.add_state(state)
            with self._rollout_paused(version), self.sync_check.refusals(version):
                self.rollout.update_weights_collective(fault.state(state) if fault else state, version)
        # the bytes on the wire, where the engine says (a server's weights may travel in its own dtype)
        sent_bytes = getattr(self.rollout, "last_sync", {}).get("bytes")
        return {"weight_sync/bytes": float(sent_bytes if sent_bytes is not None else nbytes(state.values())), **woken}

    def _sync_by_disk(self, version: int, sent: SentWeights | None, fault: SyncFault | None) -> dict[str, float]:
        """``weight_sync: disk``: export to ``<run>/weight_sync`` (with ``rollout.lora_sync: adapter``
        the adapter alone, to ``<run>/lora_sync/v<version>``) and have the engine load it; ``sent``
        samples the files written (a load in the background is checked right after it)."""
        assert self.engine is not None
        metrics: dict[str, float] = {}
        if self.is_main:  # the directory is rewritten below: the previous load must be done
            waited = self.weight_load.wait()
            if self._loads_in_background():
                metrics["timing/weight_load_wait_s"] = waited
                metrics["timing/weight_load_s"] = self.weight_load.last_load_s
        adapter = adapter_sync(self.cfg)
        if adapter:  # the LoRA adapter alone, a directory per version (core_rl.sync.lora)
            path = adapter_dir(self.run_dir, version)
            self.engine.export_adapter(path)
        else:
            path = self.run_dir / "weight_sync"
            self.engine.export_hf(path)
        metrics["weight_sync/bytes"] = float(sum(f.stat().st_size for f in path.glob("*.safetensors")))
        if self.rollout is not None:
            rollout = self.rollout
            if sent is not None:
                sent.add_dir(path)
            loaded = path
            if fault is not None and fault.kind == "stale_adapter":
                loaded = adapter_dir(self.run_dir, version - 1)
            elif fault is not None:
                fault.rewrite_dir(path)
            background = self._loads_in_background()

            def load() -> None:
                with self._rollout_paused(version), self.sync_check.refusals(version):
                    rollout.load_weights_from_path(loaded, version)
                if adapter:  # the servers have moved on: the older versions go
                    prune_adapter_dirs(self.run_dir, keep=loaded)
                if background and sent is not None:
                    self.sync_check.verify(rollout, sent)

            metrics.update(self.rollout_sleep.before_weight_update())  # never asleep when loads run behind
            if background:
                self.weight_load.start(load, version)
            else:
                load()
        return metrics


def collective_state(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """What ``weight_sync: collective`` sends: the train engine's weight buckets
    (:meth:`~core_rl.interfaces.TrainEngine.hf_weight_buckets`) joined, on the main rank (``{}``
    elsewhere; every rank draws them, for the gathers inside). A tied weight is in it once (the
    receiver ties its twin), and on one rank the tensors are the parameters themselves, not a copy of
    the model: nothing may train until the rollout engine has taken them."""
    return {name: tensor for bucket in engine.hf_weight_buckets() for name, tensor in bucket.items()}


def sync_in_memory(
    engine: TrainEngine,
    rollout: RolloutEngine | None,
    version: int,
    paused: AbstractContextManager[object],
    *,
    sent: SentWeights | None = None,
    fault: SyncFault | None = None,
) -> float:
    """``weight_sync: memory``, on every rank: the train engine's weight buckets
    (:meth:`~core_rl.interfaces.TrainEngine.hf_weight_buckets`, on its device) go to ``rollout``
    (held by the main rank alone, ``None`` elsewhere) through
    :meth:`~core_rl.interfaces.RolloutEngine.update_weights_from_buckets` inside ``paused``; returns
    the bytes handed over. ``sent`` (the sync check's) samples each tensor as it passes; ``fault``
    (the test hook's) alters what reaches the engine after that. Should the rollout engine fail or
    stop early, the rest of the buckets is still drawn, so every rank finishes the engine's
    collectives, and then the error is raised."""
    buckets = engine.hf_weight_buckets()
    sent_bytes = 0

    def counted() -> Iterator[Mapping[str, torch.Tensor]]:
        nonlocal sent_bytes
        for bucket in buckets:
            sent_bytes += nbytes(bucket.values())
            yield bucket
            del bucket  # not held while the next one is gathered

    try:
        if rollout is not None:
            stream: Iterable[Mapping[str, torch.Tensor]] = counted()
            if sent is not None:
                stream = sent.passing(stream)
            if fault is not None:
                stream = fault.buckets(stream)
            with paused:
                rollout.update_weights_from_buckets(stream, version)
    finally:
        for _ in buckets:  # the rest of the gathering (on other ranks: all of it)
            pass
    return float(sent_bytes)
