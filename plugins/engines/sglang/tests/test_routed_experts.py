"""Routing replay with a real SGLang server (CPU, the managed ``sglang`` server environment): with
``rollout.return_routed_experts`` the servers start with ``--enable-return-routed-experts`` and
every sample carries, per token, the experts each MoE layer of the tiny Qwen3-MoE routed it to;
the ``fsdp`` train engine replays them.

Both sides compute in float32, so the server's routes are those a transformers forward over the
same tokens chooses, and replayed, the trainer's log-probs agree with the server's within the
engines' usual tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.server_env("sglang")  # the repository's conftest: built or skipped, files run last

LAYERS, TOP_K = 3, 2
PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 9, 10, 11], [1, 20, 21, 22, 23]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from core_rl.testing.tiny import build_tiny_model

    # head size 32 (64 / 2 heads), as the other SGLang tests
    return build_tiny_model(
        tmp_path_factory.mktemp("moe") / "model", architecture="qwen3_moe", num_layers=LAYERS, top_k=TOP_K, num_heads=2
    )


@pytest.fixture(scope="module")
def batch(model: Path, tmp_path_factory: pytest.TempPathFactory):
    """Samples of the server (n=2 per prompt, sampled), as a training batch with their routes."""
    from core_rl.interfaces import SamplingParams
    from core_rl.protocol import samples_to_batch
    from core_rl_sglang.config import SGLangConfig
    from core_rl_sglang.engine import SGLangRolloutEngine

    config = SGLangConfig(dtype="float32", max_running_requests=8)
    engine = SGLangRolloutEngine(model, config, tmp_path_factory.mktemp("run"), return_routed_experts=True)
    try:
        groups = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=12))
    finally:
        engine.close()
    samples = [s for group in groups for s in group]
    for s in samples:
        assert s.routed_experts is not None
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids), LAYERS, TOP_K)
        assert (s.routed_experts[-1] == -1).all()  # the last token was never fed to the model
        assert ((s.routed_experts[:-1] >= 0) & (s.routed_experts[:-1] < 8)).all()
    return samples_to_batch(samples, [i // 2 for i in range(len(samples))], 0)


def test_the_servers_routes_are_those_of_a_float32_forward(model: Path, batch) -> None:
    from core_rl_train_kit import moe
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad(), moe.RouteRecorder(hf) as recorder:
        hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        own = recorder.take().reshape(*batch["input_ids"].shape, LAYERS, TOP_K)
    agreement = moe.routing_agreement(batch["routed_experts"], own, batch["attention_mask"])
    assert torch.equal(agreement, torch.ones(LAYERS)), agreement


def test_the_trainer_replays_the_servers_routes(model: Path, batch) -> None:
    from core_rl.config.model_sections import MoEConfig
    from core_rl.config.schema import ActorConfig, OptimizerConfig, PluginSpec
    from core_rl_fsdp.engine import FSDPEngine
    from core_rl_train_kit import moe

    actor = ActorConfig(
        model_path=str(model),
        engine=PluginSpec(name="fsdp"),
        optimizer=OptimizerConfig(name="sgd", lr=0.1),
        moe=MoEConfig(routing_replay="rollout"),
    )
    engine = FSDPEngine(actor)
    try:
        logprobs = engine.compute_logprobs(batch)
        routing = engine.runner.moe
        with routing.forward(batch["routed_experts"]), torch.no_grad():
            engine.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        used = routing.replay.observed("used").reshape(batch["routed_experts"].shape)
    finally:
        engine.close()
    valid = batch["attention_mask"].bool() & (batch["routed_experts"] >= 0).all(-1).all(-1)
    assert torch.equal(moe.routing_agreement(batch["routed_experts"], used, valid), torch.ones(LAYERS))
    response = batch["response_mask"] > 0
    gap = (logprobs - batch["behave_logprobs"]).abs()[response]
    assert float(gap.max()) < 2e-3, float(gap.max())  # SGLang's float32 log-probs against the trainer's
