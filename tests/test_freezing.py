"""``<role>.freeze`` (:mod:`core_rl.roles.freezing`): the patterns against a real model's parameter names,
a train step of each engine that applies it (frozen weights bitwise unchanged, the rest trained),
and the mistakes refused before the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from core_rl.config.schema import ActorConfig, PluginSpec
from core_rl.roles.freezing import freeze_parameters, freeze_problems, frozen_names
from core_rl.testing import preloaded

FROZEN = ["embed_tokens", r"layers\.0\."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from core_rl.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("freeze") / "model", seed=0)


def test_patterns_are_searched_in_the_parameter_names(model_dir: Path) -> None:
    from core_rl.roles.hf import empty_causal_lm

    model = empty_causal_lm(str(model_dir), dtype="float32")
    names = [n for n, _ in model.named_parameters()]
    found = frozen_names(names, FROZEN)
    assert "model.embed_tokens.weight" in found and "model.layers.0.mlp.up_proj.weight" in found
    assert not any(".layers.1." in n for n in found) and "lm_head.weight" not in found
    assert freeze_problems(model, FROZEN, "actor.freeze") == []
    (typo,) = freeze_problems(model, ["embed_token$", "lm_head"], "actor.freeze")
    assert typo.startswith("actor.freeze[0]: 'embed_token$' matches no parameter of the model (names look like")
    assert freeze_problems(model, ["."], "actor.freeze") == [
        "actor.freeze: ['.'] freeze every parameter, which leaves nothing to train"
    ]
    assert freeze_parameters(model, FROZEN) == found
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == set(found)


def _engine(name: str, actor: ActorConfig):
    if name == "fsdp":
        pytest.importorskip("core_rl_fsdp")
        from core_rl_fsdp.config import FSDPConfig
        from core_rl_fsdp.engine import FSDPEngine

        return FSDPEngine(actor, FSDPConfig(), trainable=True)
    pytest.importorskip("core_rl_deepspeed")
    from core_rl_deepspeed.config import DeepSpeedConfig
    from core_rl_deepspeed.engine import DeepSpeedEngine

    return DeepSpeedEngine(actor, DeepSpeedConfig(), trainable=True)


@pytest.mark.parametrize("engine_name", ["fsdp", "deepspeed"])
def test_a_train_step_leaves_the_frozen_parameters_as_they_were(model_dir: Path, engine_name: str) -> None:
    from core_rl.interfaces import LossOutput
    from core_rl.testing.helpers import make_rl_batch

    actor = ActorConfig(model_path=str(model_dir), engine=PluginSpec(name=engine_name), freeze=FROZEN)
    actor.optimizer.lr = 1e-2
    engine = _engine(engine_name, actor)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    batch = make_rl_batch(vocab_size=40, seed=1)
    batch["loss_weight"] = batch["loss_mask"] / batch["loss_mask"].sum()
    engine.train_step(batch, lambda b, logprobs, entropy: LossOutput(per_token_loss=-logprobs))
    after = engine.full_state_dict()
    frozen = set(frozen_names(list(before), FROZEN))
    assert frozen and before.keys() == after.keys()
    for name in before:
        same = torch.equal(before[name], after[name])
        assert same if name in frozen else not same, name


def _validate(tmp_path: Path, model_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    from core_rl.testing.launch import write_grpo_config

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "ab", "answer": "ba"}\n')
    path = write_grpo_config(tmp_path, model_dir, [str(data)])
    return preloaded.run(
        [sys.executable, "-m", "core_rl.cli", "config", "validate", "--preflight", str(path), *overrides],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.freeze=[embed_token$]"], "actor.freeze[0]: 'embed_token$' matches no parameter of the model"),
        (["actor.freeze=['(']"], "actor.freeze[0]: must be a regular expression"),
        (["actor.freeze=[embed]", "actor.lora.rank=4"], "actor.freeze: with actor.lora the base model is frozen"),
        (["actor.freeze=[embed]", "actor.engine.name=megatron"], "train engine 'megatron'"),
    ],
)
def test_mistakes_are_one_error_before_the_run(tmp_path: Path, model_dir: Path, overrides, message) -> None:
    if "megatron" in " ".join(overrides):
        pytest.importorskip("core_rl_megatron")
    out = _validate(tmp_path, model_dir, *overrides)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
