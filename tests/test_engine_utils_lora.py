"""LoRA merging (core_rl/roles/lora.py) against peft's own ``merge_and_unload``, drawn lazily:
about one layer held at a time, never the whole model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from core_rl.config.schema import LoraConfig
from core_rl.roles import lora

pytest.importorskip("peft")


@pytest.fixture(scope="module", params=[False, True], ids=["lora", "rslora"])
def wrapped(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> torch.nn.Module:
    """A tiny model with adapters on q/v/down projections, B random (as after training); scaled by
    alpha / r, or alpha / sqrt(r) (rank-stabilised)."""
    from core_rl.testing.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(Path(tmp_path_factory.mktemp("lora")) / "model", seed=0)
    model = lora.apply_lora(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        LoraConfig(
            rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=request.param
        ),
    )
    assert lora.lora_scaling(model) == (8.0 / 2.0 if request.param else 8.0 / 4.0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return model


def test_lazy_merge_equals_peft_merge_and_holds_one_layer(wrapped: torch.nn.Module) -> None:
    state = {k: v.detach().clone() for k, v in wrapped.state_dict().items()}
    want = copy.deepcopy(wrapped).merge_and_unload().state_dict()
    outstanding, most = 0, 0

    def drawn():
        nonlocal outstanding, most
        for item in state.items():
            outstanding += 1
            most = max(most, outstanding)
            yield item

    got = {}
    config = wrapped.peft_config[lora.ADAPTER]
    for name, value in lora.merged_items(
        drawn(), adapted=lora.adapted_modules(wrapped), scaling=lora.lora_scaling(wrapped), fan_in_fan_out=False
    ):
        outstanding -= 3 if any(f"{m}.weight" in name for m in ("q_proj", "v_proj", "down_proj")) else 1
        got[name] = value
    assert not config.fan_in_fan_out and lora.adapted_modules(wrapped)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=key)
    assert most <= 3  # a base weight, its A and its B; never the model
    assert lora.merged_state_dict(state, scaling=lora.lora_scaling(wrapped)).keys() == want.keys()


def test_an_adapter_without_its_b_is_named(wrapped: torch.nn.Module) -> None:
    state = {
        k: v
        for k, v in wrapped.state_dict().items()
        if not k.endswith("layers.0.self_attn.q_proj.lora_B.default.weight")
    }
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj"):
        list(lora.merged_items(state.items(), adapted=lora.adapted_modules(wrapped), scaling=1.0))


def test_target_modules_the_model_lacks_name_their_key(tmp_path: Path) -> None:
    """On a real (meta-device) model: peft's refusal becomes a configuration error of the section."""
    from core_rl.errors import ConfigError
    from core_rl.roles.hf import empty_causal_lm, lora_problems
    from core_rl.testing.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", seed=0)
    bad = LoraConfig(rank=2, target_modules=["k_prj"])
    with pytest.raises(ConfigError, match=r"critic\.lora\.target_modules: \['k_prj'\]: peft: .*k_prj"):
        lora.apply_lora(empty_causal_lm(str(model_dir), dtype="float32"), bad, "critic.lora")
    assert lora_problems(str(model_dir), LoraConfig(rank=2, target_modules=["k_proj"]), "actor.lora") == []


def test_wrapping_a_model_prints_no_warning(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """peft reads transformers' renamed ``is_gradient_checkpointing`` while it wraps a model: no
    deprecation line reaches a run's stderr (every LoRA run wraps the policy at the start)."""
    import warnings

    from core_rl.roles.hf import load_causal_lm
    from core_rl.testing.tiny import build_tiny_model

    model = load_causal_lm(str(build_tiny_model(tmp_path / "m", seed=0)), dtype="float32")
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lora.apply_lora(model, LoraConfig(rank=2, target_modules=["q_proj"]))
    assert [str(w.message) for w in caught] == []
    assert capfd.readouterr().err == ""
