"""``<role>.trust_remote_code``: a model that ships its own modelling code (``auto_map``) is refused
before the run without the switch (one line, exit 2) and trains, exports and loads again with it
(a real ``core-rl train`` on fsdp + hf); engines that cannot load such code are refused at
``config validate`` (:mod:`core_rl.roles.remote_code`)."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
import yaml
from core_rl.config.checks import MachineInfo
from core_rl.config.loader import load_config
from core_rl.errors import ConfigError, PreflightError
from core_rl.loops.preflight import preflight
from core_rl.plugins.host import PluginHost
from core_rl.roles.remote_code import auto_maps, keep_custom_code, untrusted_code_problem
from core_rl.testing.launch import run_train, write_grpo_config
from core_rl.testing.remote_code_model import AUTO_MAP, MODEL_CLASS, MODEL_TYPE, build_remote_code_model

SHAPE = {"alphabet": "ab=", "hidden_size": 16, "num_heads": 2, "intermediate_size": 32}
NO_GPU = MachineInfo(cuda_device_count=0)


@pytest.fixture(scope="module")
def remote_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_remote_code_model(tmp_path_factory.mktemp("remote") / "remote_code_tiny", **SHAPE)


def _config(tmp_path: Path, model: Path, **sections: object) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s}) + "\n" for s in ("ab", "ba")))
    return write_grpo_config(tmp_path, model, [str(data)], **sections)


def _refusal(model: Path, role: str) -> str:
    return (
        f"{role}.model_path: {str(model)!r} ships its own modelling code, which transformers would run (auto_map in "
        "config.json: AutoConfig -> configuration_tiny.py, AutoModelForCausalLM -> modeling_tiny.py, "
        "AutoModelForSequenceClassification -> modeling_tiny.py, AutoModelForTokenClassification -> modeling_tiny.py); "
        f"set {role}.trust_remote_code: true if you trust the code in that directory, or use a model transformers "
        "supports"
    )


def test_transformers_cannot_read_the_model_without_its_code(remote_model: Path) -> None:
    """The test model is what the feature is for: its model type is unknown to transformers."""
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoConfig.from_pretrained(remote_model, local_files_only=True)
    assert AutoConfig.from_pretrained(remote_model, local_files_only=True, trust_remote_code=True).model_type == (
        MODEL_TYPE
    )
    assert auto_maps(remote_model) == {
        "config.json": {
            "AutoConfig": ["configuration_tiny.py"],
            "AutoModelForCausalLM": ["modeling_tiny.py"],
            "AutoModelForSequenceClassification": ["modeling_tiny.py"],
            "AutoModelForTokenClassification": ["modeling_tiny.py"],
        }
    }
    assert untrusted_code_problem(remote_model, "actor.model_path", True) is None


def test_a_tokenizer_auto_map_is_read_in_both_forms(tmp_path: Path) -> None:
    """``tokenizer_config.json``'s ``auto_map`` lists a slow and a fast class (either may be null)."""
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}})
    )
    assert auto_maps(tmp_path) == {"tokenizer_config.json": {"AutoTokenizer": ["tokenization_x.py"]}}
    problem = untrusted_code_problem(tmp_path, "reward.tokenizer_path", False)
    assert problem is not None and "set reward.trust_remote_code: true" in problem


def test_without_the_switch_train_refuses_before_the_run(tmp_path: Path, remote_model: Path) -> None:
    proc = run_train(_config(tmp_path, remote_model), expect=2, cpu=True)
    assert proc.stderr.count(_refusal(remote_model, "actor")) == 1  # the model's and the tokenizer's check: one line
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs" / "run" / "metrics.jsonl").exists()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 4, 5, 6, 4, 5]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_with_the_switch_a_grpo_run_trains_and_its_export_loads_again(tmp_path: Path, remote_model: Path) -> None:
    """fsdp + hf on the custom model; the export keeps its code and ``auto_map`` (it loads only with
    ``trust_remote_code``, as its own class) and gives the logits of the run's final weights (its
    checkpoint), which training changed."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = _config(tmp_path, remote_model, reward={"name": "char_match"}, trainer={"total_steps": 2})
    overrides = ["actor.trust_remote_code=true", "rollout.sampling.n=4", "actor.optimizer.lr=0.01"]
    proc = run_train(config, *overrides, cpu=True)
    assert "step 2/2" in proc.stdout + proc.stderr
    run = tmp_path / "runs" / "run"
    export = run / "final_hf"
    assert {"configuration_tiny.py", "modeling_tiny.py"} <= {p.name for p in export.iterdir()}
    assert json.loads((export / "config.json").read_text())["auto_map"] == AUTO_MAP
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    exported = AutoModelForCausalLM.from_pretrained(export, local_files_only=True, trust_remote_code=True)
    assert type(exported).__name__ == MODEL_CLASS
    trained = AutoModelForCausalLM.from_pretrained(remote_model, local_files_only=True, trust_remote_code=True)
    initial = _logits(trained)
    trained.load_state_dict(load_file(str(run / "checkpoints" / "step_00000002" / "model.safetensors")))
    torch.testing.assert_close(_logits(exported), _logits(trained), atol=1e-6, rtol=0)
    assert not torch.allclose(_logits(exported), initial, atol=1e-4)


def test_each_role_needs_its_own_switch_and_overrides_read_the_custom_config(
    tmp_path: Path, remote_model: Path
) -> None:
    """A trusted actor does not make a ``ref:`` on the same directory trusted; with both set,
    preflight passes, ``model_overrides`` included (checked against the custom configuration class:
    a misspelt key is named with it)."""
    config = _config(tmp_path, remote_model)
    trusted = ["actor.trust_remote_code=true", f"ref.model_path={remote_model}"]
    with pytest.raises(PreflightError) as info:
        preflight(load_config(config, trusted, host=PluginHost()), machine=NO_GPU)
    assert info.value.problems == [_refusal(remote_model, "ref")]
    misspelt = [*trusted, "ref.trust_remote_code=true", "actor.model_overrides={max_position_embedings: 128}"]
    with pytest.raises(PreflightError) as info:
        preflight(load_config(config, misspelt, host=PluginHost()), machine=NO_GPU)
    assert info.value.problems == [
        f"actor.model_overrides.max_position_embedings: not a setting of a {MODEL_TYPE} model's configuration "
        "(TinyRemoteConfig); check the name against its config.json"
    ]
    overrides = [*trusted, "ref.trust_remote_code=true", "actor.model_overrides={max_position_embeddings: 128}"]
    cfg = load_config(config, overrides, host=PluginHost())
    checked = preflight(cfg, machine=NO_GPU)
    assert checked.model.model_type == MODEL_TYPE and checked.model.max_position_embeddings == 128
    assert Path(cfg.actor.model_path) == tmp_path / "runs" / "run" / "model_overrides" / "actor"


def test_engines_that_cannot_load_custom_code_are_refused_at_config_validate(
    tmp_path: Path, host: PluginHost, minimal_config: dict
) -> None:
    minimal_config["actor"]["trust_remote_code"] = True
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(minimal_config))
    with pytest.raises(ConfigError) as info:
        load_config(path, [], host=host)
    assert [p for p in info.value.problems if "trust_remote_code" in p] == [
        "actor.trust_remote_code: true, but train engine 'eng' (distribution test-inline) cannot load a model's own "
        "code (its config class does not set loads_remote_code = True); set actor.engine.name to fsdp or deepspeed, "
        "or use a model transformers supports",
        "actor.trust_remote_code: true, but rollout engine 'gen' (distribution test-inline) cannot load a model's own "
        "code (its config class does not set loads_remote_code = True); set rollout.engine.name to hf, vllm or "
        "sglang, or use a model transformers supports",
    ]


@pytest.mark.skipif(find_spec("core_rl_megatron") is None, reason="core-rl-megatron is not installed")
def test_megatron_refuses_the_switch_with_one_line(
    tmp_path: Path, remote_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """megatron builds its own model from the config's shapes: it cannot run a model's code."""
    from core_rl.cli import main

    config = _config(tmp_path, remote_model)
    status = main(["config", "validate", str(config), "actor.engine.name=megatron", "actor.trust_remote_code=true"])
    assert status == 2
    err = capsys.readouterr().err
    assert (
        "actor.trust_remote_code: true, but train engine 'megatron' (distribution core-rl-megatron) cannot load a "
        "model's own code (its config class does not set loads_remote_code = True); set actor.engine.name to fsdp "
        "or deepspeed, or use a model transformers supports"
    ) in err
    assert "Traceback" not in err


def test_an_export_keeps_the_code_files_and_auto_map_transformers_left_out(tmp_path: Path, remote_model: Path) -> None:
    """:func:`keep_custom_code` on a directory written without them (as a model saved through a
    class that does not know its code would be); a source without code changes nothing."""
    target = tmp_path / "export"
    target.mkdir()
    config = json.loads((remote_model / "config.json").read_text())
    del config["auto_map"]
    (target / "config.json").write_text(json.dumps(config))
    assert keep_custom_code([tmp_path / "nothing_here"], target) == []
    assert sorted(keep_custom_code([remote_model, remote_model], target)) == [
        "configuration_tiny.py",
        "modeling_tiny.py",
    ]
    assert json.loads((target / "config.json").read_text())["auto_map"] == AUTO_MAP
    assert (target / "modeling_tiny.py").read_text() == (remote_model / "modeling_tiny.py").read_text()
    assert keep_custom_code([remote_model], target) == []  # already there


def test_a_value_model_on_a_custom_backbone_loads_with_the_switch(remote_model: Path) -> None:
    """A critic (or reward model) role on such a directory: the token classifier its code defines,
    built for real and on the meta device, with the head starting at zero."""
    from core_rl.roles.hf import empty_value_model, load_value_model

    model = load_value_model(str(remote_model), dtype="float32", trust_remote_code=True)
    assert type(model).__name__ == "TinyRemoteForTokenClassification"
    assert not model.score.weight.any()
    empty = empty_value_model(str(remote_model), dtype="float32", trust_remote_code=True)
    assert type(empty).__name__ == "TinyRemoteForTokenClassification" and empty.score.weight.is_meta
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_value_model(str(remote_model), dtype="float32")
