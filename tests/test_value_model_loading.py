"""A value model (the critic) started from a causal LM's directory: the backbone's weights are the
LM's, the head starts at zero, and transformers' load report about the expected difference (the LM
head left out, the value head new) is not printed; a directory missing a backbone weight is refused
with the key named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_rl.roles.hf import load_value_model
from core_rl.testing.tiny import build_tiny_model
from safetensors.torch import load_file, save_file


@pytest.fixture
def lm_dir(tmp_path: Path) -> Path:
    return Path(build_tiny_model(tmp_path / "lm", alphabet="abc", seed=0))


def test_a_critic_from_a_causal_lm_starts_from_its_backbone_quietly(lm_dir: Path, capfd) -> None:
    capfd.readouterr()
    model = load_value_model(str(lm_dir), dtype="float32")
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err and "UNEXPECTED" not in out + err
    lm = load_file(lm_dir / "model.safetensors")
    params = dict(model.named_parameters())
    backbone = [k for k in lm if k in params]
    assert len(backbone) == len([k for k in params if k.startswith("model.")]) > 0
    for key in backbone:
        torch.testing.assert_close(params[key].detach(), lm[key], rtol=0, atol=0)
    head = [k for k in params if not k.startswith("model.")]
    assert head and all(not params[k].any() for k in head)


def test_a_directory_without_the_backbone_is_refused_naming_the_weight(lm_dir: Path) -> None:
    weights = load_file(lm_dir / "model.safetensors")
    dropped = next(k for k in weights if "layers.0." in k)
    del weights[dropped]
    save_file(weights, lm_dir / "model.safetensors", metadata={"format": "pt"})
    wanted = rf"critic\.model_path: .* does not hold the value model's backbone: {dropped}"
    with pytest.raises(ValueError, match=wanted):
        load_value_model(str(lm_dir), dtype="float32")
