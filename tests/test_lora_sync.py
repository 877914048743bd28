"""``rollout.lora_sync: adapter`` (:mod:`core_rl.sync.lora`): after a real training step of the
``fsdp`` engine with LoRA, the trainer's weight sync writes the adapter alone and one real vLLM
CPU server (started once for the module, from the managed server environment, with LoRA enabled)
loads it under a new name per version. Its greedy tokens and behaviour log-probs match a merged
sync into the same server; the sync moves only the adapter's bytes; a second sync replaces the
first; a restarted server loads the newest adapter; the sync check (``rollout.sync_check``) covers
the adapter and stops a stale one at its version. And the configurations where it cannot work
are refused, each naming its key."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from core_rl.config import load_config
from core_rl.config.schema import RunConfig
from core_rl.plugins.host import PluginHost
from core_rl.sync.buckets import nbytes
from core_rl.sync.lora import adapter_dir
from lora_sync_helpers import (
    GREEDY,
    LOGPROB_ATOL,
    PROMPTS,
    RANK,
    Syncer,
    assert_same_samples,
    check_adapter_syncs,
    lora_problems,
    lora_trainer,
    merged_samples,
    second_sync,
    served_adapters,
    train_step,
)

pytest.importorskip("peft")
pytest.importorskip("core_rl_vllm")
pytest.importorskip("core_rl_fsdp")

from core_rl_vllm.engine import GENERATE_PATH


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model, the ``fsdp`` engine training LoRA adapters of rank 8 on every linear layer,
    a vLLM server started as a run with ``rollout.lora_sync: adapter`` starts it (float32, so the
    comparison can be tight), and the trainer's sync stage between them."""
    from core_rl.testing.tiny import build_tiny_model
    from core_rl_vllm.config import VLLMConfig
    from core_rl_vllm.engine import make_engine

    work = tmp_path_factory.mktemp("lora_sync")
    model = build_tiny_model(work / "model", num_heads=2)  # vLLM's CPU attention: head size 32
    cfg, train = lora_trainer(model)
    options = VLLMConfig(dtype="float32", max_num_seqs=16)
    rollout = make_engine(cfg.rollout, options, model_path=str(model), run_dir=work / "run", lora_rank=RANK)
    syncer = Syncer(cfg, work / "run", train, rollout)
    yield syncer, model, work
    rollout.close()
    train.close()


def _merged_sync(url: str, path: Path, version: int, run_dir: Path) -> list:
    """Greedy samples of :data:`PROMPTS` after a merged sync of ``path`` into the server at ``url``,
    by a second engine that connects to it (its base model: the adapter-less requests)."""
    from core_rl_server_kit.remote import ServerOptions
    from core_rl_vllm.config import VLLMConfig
    from core_rl_vllm.engine import VLLMRolloutEngine

    options = VLLMConfig(dtype="float32", server=ServerOptions(urls=[url]))
    return merged_samples(VLLMRolloutEngine(path, options, run_dir), path, version)


def test_adapter_sync_matches_merged_sync_and_moves_only_the_adapter(setup) -> None:
    syncer, model, work = setup
    rollout = syncer.rollout
    train_step(syncer, seed=1)
    metrics = syncer.sync(1)
    path = adapter_dir(syncer.run_dir, 1)
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((path / "adapter_config.json").read_text())["r"] == RANK
    # only the adapter's tensors moved: A and B of every adapted layer, nothing of the base
    from safetensors.torch import load_file

    sent = load_file(str(path / "adapter_model.safetensors"))
    trained = {n: p for n, p in syncer.engine.model.named_parameters() if p.requires_grad}
    assert len(sent) == len(trained) > 0 and all(".lora_A." in n or ".lora_B." in n for n in sent)
    assert nbytes(sent.values()) == nbytes(trained.values())
    assert metrics["weight_sync/bytes"] == (path / "adapter_model.safetensors").stat().st_size
    assert rollout.last_sync["bytes"] == metrics["weight_sync/bytes"]
    base_bytes = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    print(f"adapter sync: {metrics['weight_sync/bytes']:.0f} bytes; merged sync: {base_bytes} bytes")
    assert metrics["weight_sync/bytes"] < base_bytes / 2

    url = rollout.endpoints[0].url
    assert served_adapters(url) == {"core-rl-lora-v1"}
    adapter = rollout.generate(PROMPTS, GREEDY)
    assert all(s.versions == [1] * 8 for (s,) in adapter)  # the server labels the adapter's tokens
    syncer.engine.export_hf(work / "merged")
    merged = _merged_sync(url, work / "merged", 1, work / "merged-run")
    assert_same_samples(adapter, merged)
    # the tokens differ from the untrained model's: the adapter did something
    base = _merged_sync(url, Path(model), 0, work / "base-run")  # the base weights back, for the next test
    assert [s.response_ids for (s,) in base] != [s.response_ids for (s,) in adapter]


def test_a_second_sync_replaces_the_first(setup) -> None:
    syncer, model, _ = setup
    second = second_sync(syncer)
    url = syncer.rollout.endpoints[0].url
    # the server itself labels the new adapter's tokens version 2 (what a request resumed across
    # the update reports token by token)
    body = {"model": "core-rl-lora-v2", "token_ids": PROMPTS[0], "sampling_params": {"max_tokens": 2}}
    answer = httpx.post(url + GENERATE_PATH, json=body, timeout=60).json()
    assert {str(span["version"]) for span in answer["choices"][0]["weight_versions"]} == {"2"}
    # the new version's tokens are those of the trained model: a transformers forward of the
    # merged weights, token by token (greedy)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    reference.load_state_dict(syncer.engine.full_state_dict())
    for prompt, (s,) in zip(PROMPTS, second):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert s.response_ids == out[0, len(prompt) :].tolist()


def test_a_resumed_trainer_reloads_the_version_a_surviving_server_serves(setup) -> None:
    """A second engine on the same server (as a trainer resumed against servers given by
    ``server.urls``, which outlived it) loads the version the server already serves, in place, and
    the next version leaves exactly one core-rl adapter served."""
    from core_rl_server_kit.remote import ServerOptions
    from core_rl_vllm.config import VLLMConfig
    from core_rl_vllm.engine import VLLMRolloutEngine

    syncer, model, work = setup
    rollout = syncer.rollout
    if rollout.weight_version < 1:
        train_step(syncer, seed=1)
        syncer.sync(1)
    version = rollout.weight_version
    url = rollout.endpoints[0].url
    served = VLLMConfig(dtype="float32", server=ServerOptions(urls=[url]))
    resumed = VLLMRolloutEngine(model, served, work / "resumed", lora_rank=RANK)
    try:
        resumed.load_weights_from_path(adapter_dir(syncer.run_dir, version), version)  # refused before: name taken
        assert served_adapters(url) == {f"core-rl-lora-v{version}"}
        assert [s.response_ids for (s,) in resumed.generate(PROMPTS, GREEDY)] == [
            s.response_ids for (s,) in rollout.generate(PROMPTS, GREEDY)
        ]
        resumed.load_weights_from_path(adapter_dir(syncer.run_dir, version), version + 7)
        assert served_adapters(url) == {f"core-rl-lora-v{version + 7}"}
    finally:
        resumed.close()
    rollout.load_weights_from_path(adapter_dir(syncer.run_dir, version), version)  # as the fixture's engine left it
    assert served_adapters(url) == {f"core-rl-lora-v{version}"}


def test_a_restarted_server_serves_the_newest_adapter(setup) -> None:
    """A server killed after an adapter sync is restarted from the base model and loads the newest
    adapter directory (the one kept), then answers as before."""
    import os
    import signal
    import time

    syncer, _, _ = setup
    rollout = syncer.rollout
    if rollout.weight_version < 1:
        train_step(syncer, seed=1)
        syncer.sync(1)
    before = rollout.generate(PROMPTS, GREEDY)
    server = rollout.endpoints[0].server
    os.kill(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    after = rollout.generate(PROMPTS, GREEDY)  # restarts the server (on_server_failure: restart)
    assert rollout.endpoints[0].restarts == 1
    version = rollout.weight_version
    for (a,), (b,) in zip(before, after):
        assert a.response_ids == b.response_ids and b.versions == [version] * 8
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= LOGPROB_ATOL


def _problems(tmp_path: Path, overrides: list[str]) -> list[str]:
    return lora_problems(tmp_path, "vllm", overrides)


def test_the_default_is_merged_and_a_valid_adapter_config_loads(tmp_path: Path) -> None:
    assert RunConfig().rollout.lora_sync == "merged"
    assert _problems(tmp_path, []) == []


@pytest.mark.parametrize(
    ("overrides", "starts", "says"),
    [
        (["actor.lora.rank=0"], "rollout.lora_sync:", "actor.lora.rank is 0"),
        (["rollout.engine.name=hf"], "rollout.lora_sync:", "'hf'"),
        (["rollout.weight_sync=collective"], "rollout.lora_sync:", "rollout.weight_sync: disk"),
        (["rollout.sleep_while_training=true"], "rollout.lora_sync:", "sleep_while_training: false"),
        (["rollout.engine.server.update_pause_mode=keep"], "rollout.lora_sync:", "use wait or abort"),
        (["actor.lora.rank=1024"], "actor.lora.rank:", "at most 512"),
        (["rollout.lora_sync=adapters"], "rollout.lora_sync:", "adapter"),
    ],
)
def test_what_cannot_work_is_refused_naming_the_key(tmp_path: Path, overrides, starts, says) -> None:
    problems = _problems(tmp_path, overrides)
    assert len(problems) == 1, problems
    assert problems[0].startswith(starts) and says in problems[0], problems[0]


def test_the_run_builds_its_servers_for_adapters_and_never_asleep(tmp_path: Path) -> None:
    """As the trainer builds the rollout engine (:mod:`core_rl.rollout.colocation`): the factory gets
    ``lora_rank`` with ``adapter`` only, and ``sleep_while_training: auto``, on for this colocated
    synchronous run on a GPU with ``merged``, stays off with ``adapter`` (a sleeping server would drop
    the base weights that adapter syncs never send)."""
    from core_rl.plugins.kinds import ROLLOUT_ENGINE
    from core_rl.rollout.colocation import _sleeps
    from core_rl.sync.lora import rollout_factory_kwargs

    example = Path(__file__).resolve().parents[1] / "examples" / "server_grpo" / "vllm.yaml"
    host = PluginHost(environ={})
    common = ["actor.lora.rank=10", "rollout.weight_sync=disk"]
    for mode, kwargs, sleeps in (("merged", {}, True), ("adapter", {"lora_rank": 10}, False)):
        cfg = load_config(example, [*common, f"rollout.lora_sync={mode}"], host=host)
        assert rollout_factory_kwargs(cfg) == kwargs
        assert _sleeps(cfg, host.get(ROLLOUT_ENGINE, "vllm"), cuda=True) is sleeps


def test_the_sync_check_covers_the_adapter_and_a_stale_one_stops_the_sync(setup, monkeypatch) -> None:
    """The sync check compares the adapter the trainer wrote with the one the server's handler
    loaded (:func:`lora_sync_helpers.check_adapter_syncs`)."""
    check_adapter_syncs(setup[0], monkeypatch, "vllm-0")
