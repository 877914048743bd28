"""The tiny Qwen3-MoE on DeepSpeed (ZeRO 2 and 3, one rank): rollout routing replay gives the
log-probs of a plain transformers forward replaying the same routes, and the update logs the MoE
metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_rl.config.model_sections import MoEConfig
from core_rl.config.schema import ActorConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch
from core_rl.testing.tiny import build_tiny_model
from core_rl_deepspeed.config import DeepSpeedConfig
from core_rl_deepspeed.engine import DeepSpeedEngine
from core_rl_train_kit import moe


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "model", architecture="qwen3_moe", num_layers=2)


def nll(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    return LossOutput(per_token_loss=-logprobs, token_metrics={})


def routed_batch(model_path: Path) -> tuple[TensorBatch, torch.Tensor]:
    """A batch whose routes come from a bf16 forward, and the float32 log-probs of a plain
    transformers forward that replays them."""
    from transformers import AutoModelForCausalLM

    batch = make_rl_batch(batch_size=4, seed=0, max_response_len=5)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), moe.RouteRecorder(model) as recorder:
        model(input_ids=ids, attention_mask=mask)
        routes = recorder.take().reshape(*ids.shape, *moe.route_shape(model))
    batch["routed_experts"] = torch.where(mask[..., None, None] > 0, routes, -1).to(torch.int16)
    batch["loss_weight"] = batch["response_mask"] / batch["response_mask"].sum()
    with torch.no_grad(), moe.RouteReplay(model) as replay:
        replay.routes = batch["routed_experts"].reshape(-1, *routes.shape[-2:])
        logits = model(input_ids=ids, attention_mask=mask).logits
    expected = torch.zeros(ids.shape)
    expected[:, 1:] = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return batch, expected


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_replays_routes_and_logs_moe_metrics(moe_model: Path, zero_stage: int) -> None:
    batch, expected = routed_batch(moe_model)
    actor = ActorConfig(
        model_path=str(moe_model),
        engine=PluginSpec(name="deepspeed"),
        optimizer=OptimizerConfig(name="adamw", lr=1e-3),
        moe=MoEConfig(routing_replay="rollout", router_aux_loss_coef=0.01),
    )
    engine = DeepSpeedEngine(actor, DeepSpeedConfig(zero_stage=zero_stage))
    try:
        logprobs = engine.compute_logprobs(batch)
        metrics = engine.train_step(batch, nll)
    finally:
        engine.close()
    response = batch["response_mask"] > 0
    torch.testing.assert_close(logprobs[response], expected[response], atol=1e-5, rtol=1e-5)
    assert 0.0 < metrics["moe/routing_agreement"] <= 1.0
    assert metrics["moe/imbalance"] >= 1.0 and metrics["moe/aux_loss"] > 0.0
