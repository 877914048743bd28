"""Soft reference updates (``algorithm.reference_reset_alpha``; :mod:`core_rl.loops.rl.reference_mix`):
the mixed weights against the formula computed by hand (numpy float32 arithmetic, the reference's
dtype) from the two sets of safetensors files; in a real GRPO run the KL the loss sees right after a
soft reset lies between 0 (a hard reset) and the KL without resets, the export equals the hand mix of
the policy's export and the previous reference's, alpha 1 is the hard reset byte for byte, a resumed
run ends bitwise as an uninterrupted one; the configuration mistakes are one line each, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.checkpoint.hf_exports import export_dir, exported_steps
from core_rl.errors import CoreRLError
from core_rl.loops.rl.reference_mix import mismatch, mix_into, weight_files
from safetensors.torch import load_file, save_file


def hand_mix(policy: torch.Tensor, reference: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """The formula in numpy float32 (torch only casts): ``d(a * f32(p) + (1 - a) * f32(d(r)))``."""
    p = policy.to(torch.float32).numpy()
    r = reference.to(dtype).to(torch.float32).numpy()
    return torch.from_numpy(np.float32(alpha) * p + np.float32(1.0 - alpha) * r).to(dtype)


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_files(directory).values())):
        out.update(load_file(str(file)))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_mix_is_the_formula_per_tensor(tmp_path: Path, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    reference, policy = tmp_path / "reference", tmp_path / "policy"
    reference.mkdir()
    policy.mkdir()
    ref = {"w": torch.randn(5, 7, generator=gen), "b": torch.randn(7, generator=gen), "pos": torch.arange(4)}
    ref["lm_head.weight"] = torch.randn(3, 5, generator=gen)  # a weight the policy's export leaves out
    save_file(ref, str(reference / "model.safetensors"))
    pol = {"w": torch.randn(5, 7, generator=gen), "b": torch.randn(7, generator=gen), "pos": torch.arange(4) + 10}
    save_file({"w": pol["w"]}, str(policy / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file({"b": pol["b"], "pos": pol["pos"]}, str(policy / "model-00002-of-00002.safetensors"))
    index = {"metadata": {"total_size": 1}, "weight_map": {"w": "model-00001-of-00002.safetensors"}}
    index["weight_map"].update(dict.fromkeys(("b", "pos"), "model-00002-of-00002.safetensors"))
    (policy / "model.safetensors.index.json").write_text(json.dumps(index))
    mix_into(policy, reference, 0.3, dtype)
    mixed = _weights(policy)
    assert mixed.keys() == pol.keys()
    for name in ("w", "b"):
        assert mixed[name].dtype == dtype and mixed[name].equal(hand_mix(pol[name], ref[name], 0.3, dtype)), name
    assert mixed["pos"].equal(pol["pos"])  # not floating: the policy's
    total = json.loads((policy / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert total == sum(t.numel() * t.element_size() for t in mixed.values())
    assert not list(policy.glob(".*"))  # no temporary file left
    # alpha 1 in the policy's own dtype is the policy, bit for bit (the formula, not a shortcut)
    save_file(pol, str(tmp_path / "one.safetensors"))
    (tmp_path / "one").mkdir()
    (tmp_path / "one.safetensors").rename(tmp_path / "one" / "model.safetensors")
    mix_into(tmp_path / "one", reference, 1.0, torch.float32)
    assert all(_weights(tmp_path / "one")[k].equal(pol[k]) for k in pol)


def test_a_policy_weight_the_reference_lacks_or_shapes_differently_is_refused(tmp_path: Path) -> None:
    for name in ("reference", "policy"):
        (tmp_path / name).mkdir()
    save_file({"w": torch.zeros(2, 3)}, str(tmp_path / "reference" / "model.safetensors"))
    save_file({"w": torch.zeros(3, 2)}, str(tmp_path / "policy" / "model.safetensors"))
    with pytest.raises(CoreRLError, match=r"'w' has shape \(3, 2\), the reference's in .* \(2, 3\)"):
        mix_into(tmp_path / "policy", tmp_path / "reference", 0.5, torch.float32)
    save_file({"v": torch.zeros(2, 3)}, str(tmp_path / "policy" / "model.safetensors"))
    with pytest.raises(CoreRLError, match="weight 'v' is not in the reference"):
        mix_into(tmp_path / "policy", tmp_path / "reference", 0.5, torch.float32)
    with pytest.raises(CoreRLError, match="holds no safetensors weights"):
        weight_files(tmp_path)
    assert mismatch(tmp_path / "policy", tmp_path / "reference") == (
        f"the policy's weight 'v' is not in the reference {tmp_path / 'reference'}"
    )
    assert mismatch(tmp_path / "reference", tmp_path / "reference") is None


def test_a_reference_of_another_model_is_refused_when_the_run_starts(tmp_path: Path, capsys) -> None:
    """Soft updates mix the same model's weights: a ref: of another shape is one error when the
    trainer is built, not at the first reset."""
    from core_rl import cli
    from core_rl.testing.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "wide", alphabet="abcd=", hidden_size=32, num_heads=2)
    path = _config(tmp_path, "other", {"reference_reset_every_n_steps": 2, "reference_reset_alpha": 0.5})
    assert cli.main(["train", str(path), f"ref.model_path={other}", "trainer.total_steps=1"]) == 2
    assert "algorithm.reference_reset_alpha: the policy's weight" in capsys.readouterr().err


def _config(tmp_path: Path, name: str, algorithm: dict, **sections) -> Path:
    from core_rl.testing.faults import build_task, merged

    base = build_task(tmp_path)
    model = base["actor"]["model_path"]
    config = merged(
        base,
        experiment={"name": name},
        algorithm={"name": "grpo", "loss": {"name": "ppo_clip", "kl_coef": 0.5}, **algorithm},
        trainer={"total_steps": 6},
        saver={"every_n_steps": 1, "keep_last": 2, "export_hf_every_n_steps": 2, "export_hf_keep_last": 0},
        loggers=[{"name": "jsonl"}],
        ref={"model_path": model, "dtype": "bfloat16"},  # the mix is stored in the reference's dtype
        **sections,
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_soft_updates_in_a_grpo_run_and_a_resumed_run_agrees(tmp_path: Path) -> None:
    pytest.importorskip("core_rl_fsdp")
    pytest.importorskip("core_rl_hf")
    from core_rl import cli
    from core_rl.testing.faults import same_run

    runs = tmp_path / "runs"
    soft = _config(tmp_path, "soft", {"reference_reset_every_n_steps": 2, "reference_reset_alpha": 0.5})
    assert cli.main(["train", str(soft)]) == 0
    kl = {r["step"]: r["actor/kl"] for r in read_metrics(runs / "soft" / "metrics.jsonl")}
    plain = _config(tmp_path, "plain", {})
    assert cli.main(["train", str(plain), "trainer.total_steps=3"]) == 0
    unreset = read_metrics(runs / "plain" / "metrics.jsonl")[2]["actor/kl"]
    # step 3 starts from the policy of step 2, half of which the reference now is: some KL is left,
    # less than against the untouched reference (a hard reset leaves none)
    assert 1e-5 < kl[3] < unreset, (kl, unreset)
    assert exported_steps(runs / "soft", "reference") == [4, 6]
    mixed = _weights(export_dir(runs / "soft", 6, "reference"))
    policy = _weights(export_dir(runs / "soft", 6))
    before = _weights(export_dir(runs / "soft", 4, "reference"))
    assert mixed.keys() == policy.keys()
    for name, value in mixed.items():
        assert value.dtype == torch.bfloat16 and value.equal(hand_mix(policy[name], before[name], 0.5, value.dtype))
    # three steps, then three more from the checkpoint of step 3: the reference of step 2 is rebuilt,
    # and the mix of step 4 starts from it
    assert cli.main(["train", str(soft), "experiment.name=resumed", "trainer.total_steps=3"]) == 0
    assert cli.main(["train", str(soft), "experiment.name=resumed", "recover.mode=auto"]) == 0
    assert same_run(runs / "soft", runs / "resumed", 6)
    resumed = _weights(export_dir(runs / "resumed", 6, "reference"))
    assert all(resumed[k].equal(mixed[k]) for k in mixed)


def test_alpha_one_is_the_hard_reset_byte_for_byte(tmp_path: Path) -> None:
    pytest.importorskip("core_rl_fsdp")
    pytest.importorskip("core_rl_hf")
    from core_rl import cli

    runs = tmp_path / "runs"
    hard = _config(tmp_path, "hard", {"reference_reset_every_n_steps": 2, "reference_reset_alpha": 1.0})
    assert cli.main(["train", str(hard), "trainer.total_steps=2"]) == 0
    exported = export_dir(runs / "hard", 2, "reference") / "model.safetensors"
    assert exported.read_bytes() == (export_dir(runs / "hard", 2) / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        ({"reference_reset_every_n_steps": 2, "reference_reset_alpha": 0.0}, "algorithm.reference_reset_alpha: "),
        ({"reference_reset_every_n_steps": 2, "reference_reset_alpha": 1.5}, "algorithm.reference_reset_alpha: "),
        ({"reference_reset_alpha": 0.5}, "algorithm.reference_reset_every_n_steps is 0 (no resets)"),
    ],
)
def test_configuration_mistakes_are_one_line(tmp_path: Path, capsys, algorithm: dict, message: str) -> None:
    from core_rl import cli

    path = _config(tmp_path, "wrong", algorithm)
    assert cli.main(["config", "validate", str(path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "reference_reset_alpha" in line]
    assert len(err) == 1 and message in err[0], err
