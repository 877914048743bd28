"""Routing replay (R3) on the tiny Qwen3-MoE: the ``hf`` rollout engine records each token's
experts, the ``fsdp`` train engine replays them.

The rollouts come from a model that routes differently from the trainer's: a bf16 rollout of the
same weights, or a copy whose routers were perturbed. Without replay the trainer's routers then
choose other experts for some tokens (agreement < 1) and its log-probs move away from the
rollout's; with replay the trainer's forward uses exactly the rollout's experts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_rl.config.model_sections import MoEConfig
from core_rl.config.schema import ActorConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput, SamplingParams
from core_rl.protocol import TensorBatch, samples_to_batch
from core_rl.testing.tiny import build_tiny_model
from core_rl_train_kit import moe

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")

LAYERS, TOP_K = 3, 2
PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 9, 10, 11], [1, 20, 21, 22, 23]]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("moe") / "model", architecture="qwen3_moe", num_layers=LAYERS, top_k=TOP_K
    )


@pytest.fixture(scope="module")
def perturbed_model(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``moe_model`` with noise (std 0.05, the routers' being 1) on its routers' weights only: the
    experts' and attention weights are the trainer's, so replayed routes leave only the routing
    weights' small difference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(moe_model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in moe.find_routers(model):
            router.weight.add_(0.05 * torch.randn(router.weight.shape, generator=generator))
    out = tmp_path_factory.mktemp("moe_perturbed") / "model"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(moe_model).save_pretrained(out)
    return out


def rollout(model: Path, autocast_dtype: str | None = None) -> TensorBatch:
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine

    engine = HFRolloutEngine(model, HFRolloutConfig(seed=0, autocast_dtype=autocast_dtype), return_routed_experts=True)
    try:
        groups = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=16))
    finally:
        engine.close()
    samples = [s for group in groups for s in group]
    for s in samples:
        assert s.routed_experts is not None
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids), LAYERS, TOP_K)
        assert (s.routed_experts[-1] == -1).all()  # the last token was never fed
        assert (s.routed_experts[:-1] >= 0).all()
    return samples_to_batch(samples, [i // 4 for i in range(len(samples))], 0)


def fsdp(model: Path, mode: str, **moe_options: object):
    from core_rl_fsdp.engine import FSDPEngine

    actor = ActorConfig(
        model_path=str(model),
        engine=PluginSpec(name="fsdp"),
        optimizer=OptimizerConfig(name="sgd", lr=0.1),
        grad_clip=0.0,
        moe=MoEConfig(routing_replay=mode, **moe_options),  # type: ignore[arg-type]
    )
    return FSDPEngine(actor)


def mismatch(batch: TensorBatch, logprobs: torch.Tensor) -> tuple[float, float]:
    """Mean and max |train - rollout| log-prob over the response tokens."""
    gap = (logprobs - batch["behave_logprobs"]).abs()[batch["response_mask"] > 0]
    return float(gap.mean()), float(gap.max())


def free_routes(model: Path, batch: TensorBatch) -> torch.Tensor:
    """The routes a float32 forward of ``model`` over the batch chooses itself, ``[B, T, L, K]``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad(), moe.RouteRecorder(hf) as recorder:
        hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return recorder.take().reshape(*batch["input_ids"].shape, LAYERS, TOP_K)


def test_hf_routes_are_those_of_a_full_forward_in_float32(moe_model: Path) -> None:
    """The prefill's and the decoding steps' routes, recorded incrementally, are the experts a
    single forward over prompt + response chooses (float32: the same arithmetic)."""
    batch = rollout(moe_model)
    agreement = moe.routing_agreement(batch["routed_experts"], free_routes(moe_model, batch), batch["attention_mask"])
    assert torch.equal(agreement, torch.ones(LAYERS))


@pytest.mark.parametrize("source", ["bf16", "perturbed"])
def test_replay_uses_the_rollout_routes_and_brings_the_logprobs_closer(
    source: str, moe_model: Path, perturbed_model: Path
) -> None:
    batch = rollout(moe_model, "bfloat16") if source == "bf16" else rollout(perturbed_model)
    valid = batch["attention_mask"].bool() & (batch["routed_experts"] >= 0).all(-1).all(-1)
    own = moe.routing_agreement(batch["routed_experts"], free_routes(moe_model, batch), valid)
    assert own.mean() < 1.0, "the rollout must route some tokens differently from the trainer"

    gaps = {}
    for mode in ("none", "rollout"):
        engine = fsdp(moe_model, mode)
        try:
            logprobs = engine.compute_logprobs(batch)
            if mode == "rollout":  # the experts the replayed forward used are the rollout's
                routing = engine.runner.moe
                with routing.forward(batch["routed_experts"]), torch.no_grad():
                    engine.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                used = routing.replay.observed("used").reshape(batch["routed_experts"].shape)
                assert torch.equal(moe.routing_agreement(batch["routed_experts"], used, valid), torch.ones(LAYERS))
        finally:
            engine.close()
        gaps[mode] = mismatch(batch, logprobs)
    print(f"{source}: agreement without replay {own.tolist()}, |dlogp| mean/max off {gaps['none']}")
    print(f"{source}: |dlogp| mean/max with replay {gaps['rollout']}")
    assert gaps["rollout"][0] <= gaps["none"][0]
    if source == "bf16":  # replayed, bf16 rounding is all that is left (its flips sit at near-ties: small either way)
        assert gaps["rollout"][0] < 1e-2
    else:  # the flipped experts' share of the mismatch goes; the routing weights' difference stays
        assert own.mean() < 0.95
        assert gaps["rollout"][0] < 0.95 * gaps["none"][0]


def nll(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    return LossOutput(per_token_loss=-logprobs, token_metrics={})


def test_update_replays_logs_agreement_load_and_trains_the_router(moe_model: Path, perturbed_model: Path) -> None:
    batch = rollout(perturbed_model)
    batch["loss_weight"] = batch["response_mask"] / batch["response_mask"].sum()
    engine = fsdp(moe_model, "rollout", router_aux_loss_coef=0.01)
    try:
        before = [r.weight.detach().clone() for r in moe.find_routers(engine.model)]
        metrics = engine.train_step(batch, nll)
        after = [r.weight.detach() for r in moe.find_routers(engine.model)]
    finally:
        engine.close()
    assert 0.5 < metrics["moe/routing_agreement"] < 1.0
    assert {f"moe/routing_agreement/layer{i}" for i in range(LAYERS)} <= metrics.keys()
    assert metrics["moe/imbalance"] >= 1.0
    loads = [metrics[f"moe/expert_load/layer0/expert{e}"] for e in range(8)]
    assert sum(loads) == pytest.approx(1.0)
    assert metrics["moe/aux_loss"] >= 1.0 - 1e-6  # E * sum f P is 1 when balanced, more otherwise
    assert all(not torch.equal(b, a) for b, a in zip(before, after)), "replayed routes still train the routers"


def test_first_forward_records_routes_and_replays_them(moe_model: Path) -> None:
    batch = rollout(moe_model, "bfloat16")
    engine = fsdp(moe_model, "first_forward")
    try:
        engine.compute_logprobs(batch)
        recorded = batch["first_forward_routes"]
        assert recorded.shape == batch["routed_experts"].shape
        assert torch.equal(
            recorded[batch["attention_mask"].bool()], free_routes(moe_model, batch)[batch["attention_mask"].bool()]
        )
    finally:
        engine.close()


def test_router_float32_runs_under_autocast(moe_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_model)
    assert moe.router_float32(model) == LAYERS
    with torch.autocast("cpu", dtype=torch.bfloat16), moe.RouteReplay(model, observe=True) as seen:
        model(input_ids=torch.tensor([PROMPTS[0]]))
    assert all(logits.dtype == torch.float32 for logits in seen.logits.values())


def test_the_trained_moe_exports_a_directory_that_reloads(moe_model: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    batch = rollout(moe_model)
    batch["loss_weight"] = batch["response_mask"] / batch["response_mask"].sum()
    engine = fsdp(moe_model, "rollout", router_dtype="float32")
    try:
        engine.train_step(batch, nll)
        expected = engine.compute_logprobs(batch)
        engine.export_hf(tmp_path / "export")
    finally:
        engine.close()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    moe.router_float32(reloaded)
    with torch.no_grad(), moe.RouteReplay(reloaded) as replay:
        replay.routes = batch["routed_experts"].reshape(-1, LAYERS, TOP_K)
        logits = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    response = batch["response_mask"][:, 1:] > 0
    torch.testing.assert_close(logprobs[response], expected[:, 1:][response], atol=1e-5, rtol=1e-5)


def test_without_replay_the_packed_layout_trains_and_logs_load_but_no_agreement(moe_model: Path) -> None:
    from core_rl.config.schema import MicroBatchConfig
    from core_rl_fsdp.engine import FSDPEngine

    batch = rollout(moe_model, "bfloat16")
    batch["loss_weight"] = batch["response_mask"] / batch["response_mask"].sum()
    actor = ActorConfig(
        model_path=str(moe_model),
        engine=PluginSpec(name="fsdp"),
        optimizer=OptimizerConfig(name="sgd", lr=0.1),
        micro_batch=MicroBatchConfig(layout="packed"),
        moe=MoEConfig(router_aux_loss_coef=0.01),
    )
    engine = FSDPEngine(actor)
    try:
        assert engine.runner.base_layout == "packed"
        metrics = engine.train_step(batch, nll)
    finally:
        engine.close()
    assert "moe/routing_agreement" not in metrics  # the routers' tokens are not in [b, width] order
    assert metrics["moe/imbalance"] >= 1.0 and metrics["moe/aux_loss"] >= 1.0 - 1e-6


def test_routes_from_a_dense_model_are_refused_with_the_key_to_change(tmp_path: Path) -> None:
    from core_rl.errors import ConfigError
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine

    dense = build_tiny_model(tmp_path / "dense")
    with pytest.raises(ConfigError, match="no mixture-of-experts routers; set actor.moe.routing_replay: none"):
        HFRolloutEngine(dense, HFRolloutConfig(), return_routed_experts=True)
    with pytest.raises(ConfigError, match=r"actor.moe.routing_replay: .*LlamaForCausalLM has no mixture-of-experts"):
        fsdp(dense, "rollout")


def test_a_continued_sample_carries_routes_of_its_whole_context(moe_model: Path) -> None:
    """A sample interrupted by ``pause("abort")`` and continued after it takes the continuation's
    routes, whose prefill ran over the first part: still the routes of one full forward."""
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine

    engine = HFRolloutEngine(moe_model, HFRolloutConfig(seed=0), return_routed_experts=True)
    try:
        (first,) = engine.generate([PROMPTS[0]], SamplingParams(n=1, max_new_tokens=4, stop_token_ids=[]))[0]
        first.finish_reason = "abort"  # as an interrupted request leaves it
        again = engine._continue([first], SamplingParams(n=1, max_new_tokens=12, stop_token_ids=[]))
    finally:
        engine.close()
    assert again == [] and len(first.response_ids) > 4
    assert first.routed_experts.shape[0] == len(first.prompt_ids) + len(first.response_ids)
    batch = samples_to_batch([first], [0], 0)
    agreement = moe.routing_agreement(batch["routed_experts"], free_routes(moe_model, batch), batch["attention_mask"])
    assert torch.equal(agreement, torch.ones(LAYERS))


@pytest.fixture(scope="module")
def mixtral_model(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Mixtral (the second family: its routers always divide the weights by their
    sum, with no attribute saying so) with the tiny model's tokenizer, 3 layers of 8 experts, top 2."""
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(moe_model)
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    with torch.no_grad():
        for router in moe.find_routers(model):
            router.weight.normal_(0.0, 1.0)
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.1)
            layer.mlp.experts.down_proj.normal_(0.0, 0.1)
    out = tmp_path_factory.mktemp("mixtral") / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_fsdp_trains_a_mixtral_replaying_the_hf_engines_routes(mixtral_model: Path) -> None:
    """Mixtral end to end: the hf engine records its routes (those of a float32 forward), fsdp
    replays them with log-probs equal to the rollout's, and a replayed update trains the routers."""
    batch = rollout(mixtral_model)
    agreement = moe.routing_agreement(
        batch["routed_experts"], free_routes(mixtral_model, batch), batch["attention_mask"]
    )
    assert torch.equal(agreement, torch.ones(LAYERS))
    engine = fsdp(mixtral_model, "rollout")
    try:
        logprobs = engine.compute_logprobs(batch)
        assert mismatch(batch, logprobs)[1] < 1e-4  # float32 both sides, the same experts and weights
        batch["loss_weight"] = batch["response_mask"] / batch["response_mask"].sum()
        before = [r.weight.detach().clone() for r in moe.find_routers(engine.model)]
        metrics = engine.train_step(batch, nll)
        after = [r.weight.detach() for r in moe.find_routers(engine.model)]
    finally:
        engine.close()
    assert metrics["moe/routing_agreement"] == pytest.approx(1.0)
    assert all(not torch.equal(b, a) for b, a in zip(before, after))
