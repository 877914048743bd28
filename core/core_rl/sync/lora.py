"""Adapter-only weight sync with LoRA (``rollout.lora_sync: adapter``).

With ``actor.lora.rank > 0`` only the adapters train; the base weights never change. ``merged``
(the default) still sends every weight on every sync, the adapters merged in. ``adapter`` sends
the adapter alone: each sync the train engine writes it (peft's ``save_pretrained`` format:
``adapter_config.json`` + ``adapter_model.safetensors``) to a fresh directory per version,
:func:`adapter_dir`, atomically, and the rollout engine, started from ``actor.model_path`` with
adapters enabled and a maximum rank of ``actor.lora.rank`` (the ``lora_rank`` keyword of its
factory, :func:`rollout_factory_kwargs`), loads it under a new name per version and names it in
every later request. The previous version's directory is removed once the new one is loaded
(:func:`prune_adapter_dirs`); the newest stays, for a server restarted later.

What cannot work is refused when the config is validated (:func:`problems`): no LoRA, a rollout
engine that does not serve adapters (``serves_lora_adapters`` on its config class), a train engine
that cannot write the adapter alone (``exports_lora_adapter``), a weight sync other than ``disk``
(the servers read the adapter from a directory), sleeping while training (a sleeping server drops
its base weights, which an adapter sync never sends again), and a server pause mode ``keep`` (a
request kept running through a swap would go on with the adapter it started with).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig
    from core_rl.plugins.host import PluginHost

KEY = "rollout.lora_sync"
ADAPTER = "adapter"
#: the config-class attribute by which a rollout engine declares it loads adapters (``lora_rank`` factory keyword)
SERVES_ATTRIBUTE = "serves_lora_adapters"
#: the config-class attribute by which a train engine declares :meth:`~core_rl.interfaces.TrainEngine.export_adapter`
EXPORTS_ATTRIBUTE = "exports_lora_adapter"
#: the directory under the run that holds the adapter versions
SYNC_DIR = "lora_sync"
#: the prefix of every adapter name core-rl has a server serve (:func:`adapter_name`)
NAME_PREFIX = "core-rl-lora-v"


def adapter_sync(cfg: RunConfig) -> bool:
    """Whether this run sends the adapter alone."""
    return cfg.rollout.lora_sync == ADAPTER


def adapter_name(version: int) -> str:
    """The name version ``version`` of the adapter is served under: a new one per version (servers
    keep prefix-cache entries per adapter, which a reused name would serve stale). A rollout engine
    unloads every other name starting with :data:`NAME_PREFIX` once it serves this one."""
    return f"{NAME_PREFIX}{version}"


def adapter_dir(run_dir: Path, version: int) -> Path:
    """Where version ``version`` of the adapter is written: ``<run>/lora_sync/v<version, 8 digits>``."""
    return Path(run_dir) / SYNC_DIR / f"v{version:08d}"


def prune_adapter_dirs(run_dir: Path, keep: Path) -> None:
    """Remove every adapter version under the run but ``keep`` (the one the engine serves now)."""
    root = Path(run_dir) / SYNC_DIR
    for old in root.glob("v*") if root.is_dir() else ():
        if old.resolve() != Path(keep).resolve():
            shutil.rmtree(old, ignore_errors=True)


def rollout_factory_kwargs(cfg: RunConfig) -> dict[str, int]:
    """The keyword to add to the rollout engine factory's call: ``lora_rank=actor.lora.rank`` with
    ``rollout.lora_sync: adapter``, else none (engines that serve no adapters keep their signature;
    :func:`problems` refused the option for them)."""
    return {"lora_rank": cfg.actor.lora.rank} if adapter_sync(cfg) else {}


def _entry(host: PluginHost, kind_key: str, name: str) -> Any:
    return host.registries[kind_key].get(name)


def problems(cfg: RunConfig, host: PluginHost) -> list[str]:
    """Why ``rollout.lora_sync: adapter`` cannot work for this run (see the module docstring);
    empty with ``merged``."""
    if not adapter_sync(cfg):
        return []
    from core_rl.plugins.kinds import ROLLOUT_ENGINE, TRAIN_ENGINE

    out = []
    if not cfg.actor.lora.enabled:
        out.append(
            f"{KEY}: adapter sends the LoRA adapter alone, but actor.lora.rank is 0 (no adapter); set "
            f"actor.lora.rank above 0, or {KEY}: merged"
        )
    rollout = _entry(host, ROLLOUT_ENGINE.key, cfg.rollout.engine.name)
    if rollout is not None and not getattr(rollout.config_cls, SERVES_ATTRIBUTE, False):
        out.append(
            f"{KEY}: adapter: rollout engine {rollout.name!r} ({rollout.distribution}) cannot load LoRA adapters; "
            f"use rollout.engine.name: vllm or sglang, or {KEY}: merged"
        )
    train = _entry(host, TRAIN_ENGINE.key, cfg.actor.engine.name)
    if train is not None and not getattr(train.config_cls, EXPORTS_ATTRIBUTE, False):
        out.append(
            f"{KEY}: adapter: train engine {train.name!r} ({train.distribution}) cannot write the adapter alone; "
            f"use actor.engine.name: fsdp or deepspeed, or {KEY}: merged"
        )
    if cfg.rollout.weight_sync != "disk":
        out.append(
            f"{KEY}: adapter: the servers load each version's adapter from a directory; set rollout.weight_sync: "
            f"disk (not {cfg.rollout.weight_sync})"
        )
    if cfg.rollout.sleep_while_training is True:
        out.append(
            f"{KEY}: adapter: rollout.sleep_while_training: true drops the servers' base weights, which an adapter "
            f"sync never sends again; set rollout.sleep_while_training: false, or {KEY}: merged"
        )
    server = getattr(cfg.rollout.engine.config, "server", None)
    if getattr(server, "update_pause_mode", None) == "keep":
        out.append(
            f"{KEY}: adapter: rollout.engine.server.update_pause_mode: keep continues running requests through a "
            "weight update, but a request keeps the adapter it started with; use wait or abort"
        )
    return out
