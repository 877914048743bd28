"""Moving the policy's new weights to the rollout engine after each update, as
``rollout.weight_sync`` says: ``memory`` (in buckets, handed over in-process: :func:`sync_in_memory`),
``collective`` (the weights over a process group: :func:`collective_state`) or ``disk`` (a Hugging Face directory the
engine loads, or with ``rollout.lora_sync: adapter`` the LoRA adapter alone: :mod:`core_rl.lora_sync`;
in the background for an asynchronous run once its controller runs: :mod:`core_rl.trainer.weight_load`).
A rollout engine asleep while the trainer trained takes back its weights' storage once the trainer has
the weights ready, just before it loads them (:mod:`core_rl.trainer.colocation`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from core_rl.config.schema import RunConfig
from core_rl.engine_utils.buckets import nbytes
from core_rl.interfaces import RolloutEngine, TrainEngine
from core_rl.lora_sync import adapter_dir, adapter_sync, prune_adapter_dirs
from core_rl.trainer.colocation import RolloutSleep
from core_rl.trainer.rollout_flow import RolloutFlow
from core_rl.trainer.weight_load import BackgroundWeightLoad


class WeightSyncing:
    """The weight-sync part of a training loop. Every rank calls :meth:`_sync_weights`; the engine's
    weights reach :attr:`rollout`, which only rank 0 holds (``None`` elsewhere)."""

    cfg: RunConfig
    run_dir: Path
    is_main: bool
    engine: TrainEngine | None
    rollout: RolloutEngine | None
    flow: RolloutFlow | None
    weight_load: BackgroundWeightLoad
    rollout_sleep: RolloutSleep

    def _rollout_paused(self, version: int) -> AbstractContextManager[None]:
        """Rank 0: the rollout controller paused while the engine loads ``version``."""
        return self.flow.paused(version) if self.flow is not None else contextlib.nullcontext()

    def _loads_in_background(self) -> bool:
        """Whether the rollout engine loads a written version while the trainer goes on
        (:mod:`core_rl.trainer.weight_load`): an asynchronous run syncing by disk, once its
        controller runs (a resumed run's first load must land before the controller starts)."""
        return (
            self.cfg.rollout.weight_sync == "disk"
            and self.cfg.rollout.controller.max_head_offpolicyness > 0
            and self.flow is not None
            and self.flow.controller is not None
        )

    def _sync_weights(self, version: int) -> dict[str, float]:
        """Move the policy's weights to the rollout engine; return ``weight_sync/bytes`` (and,
        when loads run in the background, the wait for the previous one and its duration)."""
        assert self.engine is not None
        if self.cfg.rollout.replay_from is not None:  # saved rollouts, no rollout engine to receive them
            return {}
        mode = self.cfg.rollout.weight_sync
        if mode == "disk":
            return self._sync_by_disk(version)
        if mode == "memory":
            paused = self._rollout_paused(version)  # entered only where the rollout engine is
            woken = self.rollout_sleep.before_weight_update()
            return {"weight_sync/bytes": sync_in_memory(self.engine, self.rollout, version, paused), **woken}
        state = collective_state(self.engine)
        woken = self.rollout_sleep.before_weight_update()
        if self.rollout is not None:
            with self._rollout_paused(version):
                self.rollout.update_weights_collective(state, version)
        # the bytes on the wire, where the engine says (a server's weights may travel in its own dtype)
        sent = getattr(self.rollout, "last_sync", {}).get("bytes")
        return {"weight_sync/bytes": float(sent if sent is not None else nbytes(state.values())), **woken}

    def _sync_by_disk(self, version: int) -> dict[str, float]:
        """``weight_sync: disk``: export to ``<run>/weight_sync`` (with ``rollout.lora_sync: adapter``
        the adapter alone, to ``<run>/lora_sync/v<version>``) and have the engine load it."""
        assert self.engine is not None
        metrics: dict[str, float] = {}
        if self.is_main:  # the directory is rewritten below: the previous load must be done
            waited = self.weight_load.wait()
            if self._loads_in_background():
                metrics["timing/weight_load_wait_s"] = waited
                metrics["timing/weight_load_s"] = self.weight_load.last_load_s
        adapter = adapter_sync(self.cfg)
        if adapter:  # the LoRA adapter alone, a directory per version (core_rl.lora_sync)
            path = adapter_dir(self.run_dir, version)
            self.engine.export_adapter(path)
        else:
            path = self.run_dir / "weight_sync"
            self.engine.export_hf(path)
        metrics["weight_sync/bytes"] = float(sum(f.stat().st_size for f in path.glob("*.safetensors")))
        if self.rollout is not None:
            rollout = self.rollout

            def load() -> None:
                with self._rollout_paused(version):
                    rollout.load_weights_from_path(path, version)
                if adapter:  # the servers have moved on: the older versions go
                    prune_adapter_dirs(self.run_dir, keep=path)

            metrics.update(self.rollout_sleep.before_weight_update())  # never asleep when loads run behind
            if self._loads_in_background():
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
) -> float:
    """``weight_sync: memory``, on every rank: the train engine's weight buckets
    (:meth:`~core_rl.interfaces.TrainEngine.hf_weight_buckets`, on its device) go to ``rollout``
    (held by the main rank alone, ``None`` elsewhere) through
    :meth:`~core_rl.interfaces.RolloutEngine.update_weights_from_buckets` inside ``paused``; returns
    the bytes handed over. Should the rollout engine fail or stop early, the rest of the buckets is
    still drawn, so every rank finishes the engine's collectives, and then the error is raised."""
    buckets = engine.hf_weight_buckets()
    sent = 0

    def counted() -> Iterator[dict]:
        nonlocal sent
        for bucket in buckets:
            sent += nbytes(bucket.values())
            yield bucket
            del bucket  # not held while the next one is gathered

    try:
        if rollout is not None:
            with paused:
                rollout.update_weights_from_buckets(counted(), version)
    finally:
        for _ in buckets:  # the rest of the gathering (on other ranks: all of it)
            pass
    return float(sent)
