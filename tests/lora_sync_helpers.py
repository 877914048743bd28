"""What the ``rollout.lora_sync: adapter`` tests of every rollout engine share
(``tests/test_lora_sync.py`` for vLLM, ``tests/test_lora_sync_sglang.py`` for SGLang): the
trainer's sync stage alone, the ``fsdp`` engine training LoRA on a tiny model, its prompts, and the
comparison of an adapter sync with a merged one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from core_rl.config import load_config
from core_rl.config.schema import ActorConfig, LoraConfig, OptimizerConfig, PluginSpec, RunConfig
from core_rl.errors import ConfigError
from core_rl.interfaces import SamplingParams
from core_rl.plugins.host import PluginHost
from core_rl.rollout.colocation import RolloutSleep
from core_rl.sync.background_load import BackgroundWeightLoad
from core_rl.sync.weight_sync import WeightSyncStage
from core_rl.testing.helpers import make_rl_batch, nll_loss

RANK = 8
PROMPTS = [[1, 10, 11, 12], [1, 20, 21], [1, 5, 6, 7, 8]]
GREEDY = SamplingParams(n=1, max_new_tokens=8, min_new_tokens=8, greedy=True)
#: the largest behaviour log-prob difference allowed between an adapter sync and a merged sync (a
#: float32 server): measured 2.4e-7 with vLLM and with SGLang (the adapter's ``x A^T B^T`` added to
#: ``x W^T`` against ``x (W + B A)^T``: float32 rounding); a bfloat16 vLLM server gave the same
#: tokens, log-probs within 4.1e-3
LOGPROB_ATOL = 1e-5


class Syncer(WeightSyncStage):
    """The trainer's weight-sync stage (:class:`core_rl.sync.weight_sync.WeightSyncStage`) on
    one rank, writing to ``run_dir``, with no rollout controller: what a synchronous run calls after
    each update."""

    def __init__(self, cfg: RunConfig, run_dir: Path, engine: Any, rollout: Any) -> None:
        weight_load, sleep = BackgroundWeightLoad(60.0, "test"), RolloutSleep(None)
        super().__init__(
            cfg, engine=engine, rollout=rollout, flow=None, weight_load=weight_load, rollout_sleep=sleep, is_main=True
        )
        self.run_dir = run_dir


def lora_trainer(model: Path) -> tuple[RunConfig, Any]:
    """A run with ``rollout.lora_sync: adapter`` from disk and the ``fsdp`` engine training LoRA
    adapters of rank :data:`RANK` on every linear layer of ``model``."""
    from core_rl_fsdp.config import FSDPConfig
    from core_rl_fsdp.engine import FSDPEngine

    lora = LoraConfig(rank=RANK, alpha=16.0, dropout=0.0, target_modules=["all-linear"])
    actor = ActorConfig(
        model_path=str(model),
        engine=PluginSpec(name="fsdp"),
        optimizer=OptimizerConfig(name="adamw", lr=5e-2),
        grad_clip=0.0,
        lora=lora,
    )
    cfg = RunConfig(actor=actor)
    cfg.rollout.weight_sync, cfg.rollout.lora_sync = "disk", "adapter"
    return cfg, FSDPEngine(actor, FSDPConfig(), trainable=True)


def train_step(syncer: Syncer, seed: int) -> None:
    syncer.engine.train_step(make_rl_batch(seed=seed), nll_loss)


def check_adapter_syncs(syncer: Syncer, monkeypatch: Any, server: str) -> None:
    """The sync check (``rollout.sync_check``) of adapter syncs to the server named ``server``: a
    correct sync passes with every adapter tensor checked; a stale adapter served (the previous
    version's directory loaded under the new version: the test hook's ``stale_adapter``) is caught
    at that version, naming the server, the mode and the first tensor."""
    import pytest
    from core_rl.sync.check import WeightSyncMismatch
    from core_rl.sync.faults import VARIABLE
    from core_rl.sync.lora import adapter_dir
    from safetensors.torch import load_file

    monkeypatch.delenv(VARIABLE, raising=False)
    version = syncer.rollout.weight_version + 1
    train_step(syncer, seed=version)
    metrics = syncer.sync(version)
    adapter = load_file(adapter_dir(syncer.run_dir, version) / "adapter_model.safetensors")
    assert metrics["weight_sync/checked_tensors"] == len(adapter) > 0

    stale = version + 1
    monkeypatch.setenv(VARIABLE, f"stale_adapter:{stale}")
    train_step(syncer, seed=stale)
    with pytest.raises(WeightSyncMismatch) as caught:
        syncer.sync(stale)
    message = str(caught.value)
    assert f"weight version {stale}: rollout engine " in message and f"(server {server} (" in message
    assert "rollout.weight_sync: disk (rollout.lora_sync: adapter): the first tensor that differs is " in message
    assert f"the first tensor that differs is {next(iter(adapter))} (fingerprint " in message


def response_ids(samples: list) -> list[list[int]]:
    """The response tokens of one sample per prompt."""
    return [s.response_ids for (s,) in samples]


def synced(syncer: Syncer, version: int) -> list:
    """Greedy samples of :data:`PROMPTS` after a training step and the adapter sync of version
    ``version``, which the server serves alone and labels its tokens with."""
    from core_rl.sync.lora import adapter_name

    train_step(syncer, seed=version)
    syncer.sync(version)
    assert served_adapters(syncer.rollout.endpoints[0].url) == {adapter_name(version)}
    samples = syncer.rollout.generate(PROMPTS, GREEDY)
    assert all(s.versions == [version] * GREEDY.max_new_tokens for (s,) in samples)
    return samples


def second_sync(syncer: Syncer) -> list:
    """Greedy samples after version 2 replaced version 1 (synced first where an earlier test did
    not): only version 2 served and its directory the only one kept, its tokens not version 1's."""
    from core_rl.sync.lora import adapter_dir

    if syncer.rollout.weight_version < 1:
        synced(syncer, 1)
    first = syncer.rollout.generate(PROMPTS, GREEDY)
    second = synced(syncer, 2)
    assert not adapter_dir(syncer.run_dir, 1).exists() and adapter_dir(syncer.run_dir, 2).is_dir()
    assert response_ids(first) != response_ids(second)
    return second


def merged_samples(engine: Any, path: Path, version: int) -> list:
    """Greedy samples of :data:`PROMPTS` after a merged sync of the weight directory ``path`` by
    ``engine`` (a second engine on the server, with no adapter: its requests use the base
    weights), which is closed after."""
    try:
        engine.load_weights_from_path(path, version)
        return engine.generate(PROMPTS, GREEDY)
    finally:
        engine.close()


def assert_same_samples(adapter: list, merged: list) -> float:
    """Same greedy tokens for every prompt; the largest behaviour log-prob difference, at most
    :data:`LOGPROB_ATOL`."""
    worst = 0.0
    for (a,), (m,) in zip(adapter, merged, strict=True):
        assert a.response_ids == m.response_ids
        worst = max(worst, *(abs(x - y) for x, y in zip(a.logprobs, m.logprobs, strict=True)))
    print(f"adapter vs merged sync, largest behaviour log-prob difference: {worst:.2e}")
    assert worst <= LOGPROB_ATOL
    return worst


def served_adapters(url: str) -> set[str]:
    """The names of the core-rl adapters the server at ``url`` lists in ``GET /v1/models``."""
    import httpx
    from core_rl.sync.lora import NAME_PREFIX

    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    return {m["id"] for m in models if m["id"].startswith(NAME_PREFIX)}


def lora_problems(tmp_path: Path, engine: str, overrides: list[str]) -> list[str]:
    """The problems naming LoRA that validating a valid adapter-sync run with rollout engine
    ``engine`` and ``overrides`` reports."""
    data = {
        "actor": {"model_path": "/models/tiny", "engine": {"name": "fsdp"}, "lora": {"rank": 8}},
        "rollout": {"engine": {"name": engine}, "weight_sync": "disk", "lora_sync": "adapter"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        load_config(path, overrides, host=PluginHost(environ={}), require_complete=False)
    except ConfigError as exc:
        return [p for p in exc.problems if "lora" in p]
    return []
