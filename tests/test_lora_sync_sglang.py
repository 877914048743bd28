"""``rollout.lora_sync: adapter`` with the ``sglang`` rollout engine (:mod:`core_rl_sglang.lora`):
after a real training step of the ``fsdp`` engine with LoRA, the trainer's weight sync writes the
adapter alone and one real SGLang CPU server (started once for the module, from the managed server
environment, with LoRA enabled) loads it under a new name per version. Its greedy tokens and
behaviour log-probs match a merged sync into the same server; a second sync replaces the first; a
trainer resumed against the surviving server reloads the version it serves; the sync check
covers the adapter and stops a stale one. And the config accepts SGLang."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_rl.sync.lora import adapter_dir
from lora_sync_helpers import (
    GREEDY,
    PROMPTS,
    RANK,
    Syncer,
    assert_same_samples,
    check_adapter_syncs,
    lora_problems,
    lora_trainer,
    merged_samples,
    response_ids,
    second_sync,
    served_adapters,
    synced,
)

pytest.importorskip("peft")
pytest.importorskip("core_rl_sglang")
pytest.importorskip("core_rl_fsdp")


def _options(**server):
    from core_rl_server_kit.remote import ServerOptions
    from core_rl_sglang.config import SGLangConfig

    return SGLangConfig(dtype="float32", max_running_requests=16, server=ServerOptions(**server))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model, the ``fsdp`` engine training LoRA adapters of rank 8 on every linear layer,
    an SGLang server started as a run with ``rollout.lora_sync: adapter`` starts it (float32, so the
    comparison can be tight), and the trainer's sync stage between them."""
    from core_rl.testing.tiny import build_tiny_model
    from core_rl_sglang.engine import make_engine

    work = tmp_path_factory.mktemp("lora_sync_sglang")
    model = build_tiny_model(work / "model", num_heads=2)
    cfg, train = lora_trainer(model)
    rollout = make_engine(cfg.rollout, _options(), model_path=str(model), run_dir=work / "run", lora_rank=RANK)
    syncer = Syncer(cfg, work / "run", train, rollout)
    yield syncer, model, work
    rollout.close()
    train.close()


def _connected(url: str, model: Path, run_dir: Path, lora_rank: int = 0):
    """A second engine on the server at ``url`` (as a trainer given ``server.urls``)."""
    from core_rl_sglang.engine import SGLangRolloutEngine

    return SGLangRolloutEngine(model, _options(urls=[url]), run_dir, lora_rank=lora_rank)


def _server_labels(url: str, adapter: str) -> set[str]:
    """The weight versions the server itself gives the tokens of a request naming ``adapter`` (what
    a request resumed across an update reports token by token)."""
    import httpx

    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}, "lora_path": adapter}
    answer = httpx.post(url + "/generate", json=body, timeout=60).json()
    return {str(span["version"]) for span in answer["meta_info"]["weight_versions"]}


def _merged_sync(url: str, path: Path, version: int, run_dir: Path) -> list:
    """Greedy samples of :data:`PROMPTS` after a merged sync of ``path`` into the server at ``url``
    by a second engine (its requests name no adapter: the base weights)."""
    return merged_samples(_connected(url, path, run_dir), path, version)


def test_adapter_sync_matches_merged_sync(setup) -> None:
    syncer, model, work = setup
    rollout = syncer.rollout
    adapter = synced(syncer, 1)  # served under its version's name, its tokens labelled
    url = rollout.endpoints[0].url
    assert _server_labels(url, "core-rl-lora-v1") == {"1"}
    syncer.engine.export_hf(work / "merged")
    assert_same_samples(adapter, _merged_sync(url, work / "merged", 1, work / "merged-run"))
    # the tokens differ from the untrained model's: the adapter did something
    base = _merged_sync(url, Path(model), 0, work / "base-run")  # the base weights back, for the next test
    assert response_ids(base) != response_ids(adapter)


def test_a_second_sync_replaces_the_first_and_a_resumed_trainer_reloads_it(setup) -> None:
    """Version 2 replaces version 1 (served, labelled, its directory the only one kept); a second
    engine on the same server (a trainer resumed against servers that outlived it) loads the
    version the server serves already afresh, and its next version leaves exactly one served."""
    syncer, model, work = setup
    rollout = syncer.rollout
    second = second_sync(syncer)
    url = rollout.endpoints[0].url
    assert _server_labels(url, "core-rl-lora-v2") == {"2"}

    resumed = _connected(url, Path(model), work / "resumed", lora_rank=RANK)
    try:
        resumed.load_weights_from_path(adapter_dir(syncer.run_dir, 2), 2)  # the name is served already
        assert served_adapters(url) == {"core-rl-lora-v2"}
        assert response_ids(resumed.generate(PROMPTS, GREEDY)) == response_ids(second)
        resumed.load_weights_from_path(adapter_dir(syncer.run_dir, 2), 9)
        assert served_adapters(url) == {"core-rl-lora-v9"}
    finally:
        resumed.close()
    rollout.load_weights_from_path(adapter_dir(syncer.run_dir, 2), 2)  # as the fixture's engine left it
    assert served_adapters(url) == {"core-rl-lora-v2"}
    assert response_ids(rollout.generate(PROMPTS, GREEDY)) == response_ids(second)


def test_the_config_accepts_sglang(tmp_path: Path) -> None:
    assert lora_problems(tmp_path, "sglang", []) == []


def test_the_sync_check_covers_the_adapter_and_a_stale_one_stops_the_sync(setup, monkeypatch) -> None:
    """The sync check compares the adapter the trainer wrote with the files of the directory
    SGLang reports it loaded under this version's name (:func:`lora_sync_helpers.check_adapter_syncs`).
    Last in the module: the stale sync leaves the server serving the stale adapter."""
    check_adapter_syncs(setup[0], monkeypatch, "sglang-0")
