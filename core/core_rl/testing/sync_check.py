"""What a server engine plugin's tests of the sync check (``rollout.sync_check``,
:mod:`core_rl.sync.check`) share: two tiny models of one shape to sync between, the check
of a mode, the trainer's side of an update, and a server restarted without its updates."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from core_rl_server_kit.remote.weights import UPDATE

from core_rl.config.loader import structure
from core_rl.config.schema import RunConfig
from core_rl.sync.check import SentWeights, SyncCheck, WeightSyncMismatch
from core_rl.testing.tiny import build_tiny_model


def two_models(root: Path) -> dict[str, Path]:
    """Two tiny models of one shape (head size 32, which the CPU servers run) with different
    weights: ``a`` (seed 0) and ``b`` (seed 1), under ``root``."""
    return {name: build_tiny_model(root / name, seed=seed, num_heads=2) for seed, name in enumerate("ab")}


def check(engine_name: str, mode: str) -> SyncCheck:
    """The sync check of a run with rollout engine ``engine_name`` and ``rollout.weight_sync: mode``."""
    return SyncCheck(structure({"rollout": {"engine": {"name": engine_name}, "weight_sync": mode}}, RunConfig))


def sent_state(engine: Any, version: int, state: Mapping[str, torch.Tensor]) -> SentWeights:
    """The trainer's samples of ``state`` sent as ``version`` to ``engine`` (within its
    ``fingerprint_prefix``)."""
    sent = SentWeights(version, engine.fingerprint_prefix)
    sent.add_state(state)
    return sent


def sent_dir(engine: Any, version: int, path: Path) -> SentWeights:
    """The trainer's samples of the weight directory ``path`` sent as ``version`` to ``engine``."""
    sent = SentWeights(version, engine.fingerprint_prefix)
    sent.add_dir(path)
    return sent


def assert_a_restart_without_the_weights_is_caught(engine: Any, engine_name: str, model: Path, version: int) -> None:
    """A disk update of ``model`` as ``version`` passes the check; then ``engine``'s first server
    restarts with the weights it started from (:func:`restart_without_weights`), and the check of
    ``version`` fails naming that server: it holds no weights of this version."""
    sent = sent_dir(engine, version, model)
    engine.load_weights_from_path(model, version)
    check(engine_name, "disk").verify(engine, sent)
    restart_without_weights(engine)
    with pytest.raises(WeightSyncMismatch, match="it holds no weights of this version") as caught:
        check(engine_name, "disk").verify(engine, sent)
    assert f"weight version {version}" in str(caught.value) and f"server {engine_name}-0" in str(caught.value)


def restart_without_weights(engine: Any) -> None:
    """Stop ``engine``'s first server and have the engine restart it without reloading the weights
    it held: it comes back with the model it started from, as a server restarted behind the
    trainer's back would."""
    ep = engine.endpoints[0]
    ep.server.stop()
    engine._call(engine._recover(ep, ep.generation, None, during=UPDATE, reload=False), None, "a restart")
