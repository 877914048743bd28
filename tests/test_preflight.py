"""Preflight on real files: data, model and tokenizer directories (complete, corrupt, truncated),
the output directory and the machine, all checked before any model is loaded, every problem
reported at once with the key path or file position."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import ClassVar

import pytest
from core_rl.config import load_config
from core_rl.config.checks import MachineInfo
from core_rl.errors import DataError, PreflightError
from core_rl.hookspecs import hookimpl
from core_rl.interfaces import Reward
from core_rl.loops import train
from core_rl.loops.errors import RewardError
from core_rl.loops.preflight import check_model_dir, check_tokenizer_dir, preflight
from core_rl.plugins.host import PluginHost
from core_rl.testing.launch import write_grpo_config
from core_rl.testing.tiny import build_tiny_model

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

NO_GPU = MachineInfo(cuda_device_count=0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "m", alphabet="abc=", hidden_size=16, num_heads=2)


@pytest.fixture
def model(tiny_model: Path, tmp_path: Path) -> Path:
    """A fresh copy of the tiny model, free to corrupt."""
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s[::-1]}) + "\n" for s in ("ab", "ca", "bcb")))
    return path


def _config(tmp_path: Path, model: Path, data: Path, *overrides: str, host: PluginHost | None = None):
    path = write_grpo_config(tmp_path, model, [str(data)])
    return load_config(path, list(overrides), host=host or PluginHost())


def _problems(cfg, machine: MachineInfo = NO_GPU) -> list[str]:
    with pytest.raises(PreflightError) as info:
        preflight(cfg, machine=machine)
    return info.value.problems


def test_a_good_run_passes_and_hands_over_what_it_read(tmp_path, model, data):
    checked = preflight(_config(tmp_path, model, data), machine=NO_GPU)
    assert [r.row["prompt"] for r in checked.rows] == ["ab=", "ca=", "bcb="]
    assert checked.tokenizer("ab=")["input_ids"][1:] == [4, 5, 7]
    assert checked.model.vocab_size == 8 and checked.model.model_type == "llama"
    assert (tmp_path / "runs" / "run").is_dir()


def test_every_problem_at_once(tmp_path, model, data):
    with data.open("a") as f:
        f.write('{"prompt": "cc=", "answer": "cc"\n{"answer": "x"}\n')
    (tmp_path / "blocker").write_text("a file where a directory should be")
    cfg = _config(
        tmp_path,
        model,
        data,
        "experiment.output_dir=" + str(tmp_path / "blocker"),
        "rollout.engine.device=cuda",
        "actor.engine.backend=nccl",
        "rollout.sampling.stop_token_ids=[2,8]",
    )
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:-10])
    problems = _problems(cfg)
    assert problems == [
        f"{data}:4: not valid JSON (Expecting ',' delimiter at column 33) in "
        '\'{"prompt": "cc=", "answer": "c...\'; each line must be one JSON object',
        f"{data}:5: no column 'prompt' (columns: answer); set data.prompt_key to the column holding the prompt text",
        f"{model}/model.safetensors: not a complete safetensors file (SafetensorError: Error while deserializing "
        "header: incomplete metadata, file not fully covered); re-export or re-download the model",
        f"rollout.sampling.stop_token_ids[1]: 8 is outside the model's vocabulary (vocab_size 8 in "
        f"{model}/config.json)",
        f"experiment.output_dir: cannot create the run directory '{tmp_path}/blocker/run': Not a directory; choose a "
        "writable experiment.output_dir (or another experiment.name)",
        "actor.engine.backend: nccl needs CUDA GPUs and this machine has none (torch.cuda.is_available() is False); "
        "use auto or gloo",
        "rollout.engine.device: 'cuda' but this machine has no CUDA GPU (torch.cuda.is_available() is False); use "
        "'auto' or 'cpu'",
    ]


def test_missing_answer_column_fails_before_the_run(tmp_path, model, data):
    cfg = _config(tmp_path, model, data, "reward.answer_key=solution")
    assert _problems(cfg) == [
        f"{data}:1: no column 'solution' (or it is null) (also lines 2, 3), which reward 'exact_match' reads; add it "
        "to every row, or point the reward at the column that holds it"
    ]


@pytest.mark.parametrize(
    ("reward", "distribution", "column"),
    [("math", "core_rl_reward_math", "answer_key"), ("code", "core_rl_reward_code", "tests_key")],
)
def test_a_reward_plugins_data_column_is_checked_before_the_run(tmp_path, model, data, reward, distribution, column):
    """The ``math`` and ``code`` rewards declare the column they read (``required_columns``), so a
    misnamed one is a problem of the data before any model loads, not every item's error at step 1."""
    pytest.importorskip(distribution)
    cfg = _config(tmp_path, model, data, f"reward={{name: {reward}, {column}: solution}}")
    assert _problems(cfg) == [
        f"{data}:1: no column 'solution' (or it is null) (also lines 2, 3), which reward {reward!r} reads; add it "
        "to every row, or point the reward at the column that holds it"
    ]


def test_prompts_checked_against_the_tokenizer_and_model(tmp_path, model, data):
    assert _problems(_config(tmp_path, model, data, "data.max_prompt_tokens=4")) == [
        f"{data}:3: the prompt has 5 tokens, more than data.max_prompt_tokens=4; shorten it or raise "
        "data.max_prompt_tokens"
    ]
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 6}))
    problems = _problems(_config(tmp_path, model, data))
    assert problems[0] == (
        f"{data}:1: the prompt has token id 7, outside the model's vocabulary (vocab_size 6); the tokenizer does not "
        "match the model"
    )
    assert _problems(_config(tmp_path, model, data, "data.apply_chat_template=true")) == [
        "data.apply_chat_template: the tokenizer has no chat template; set data.apply_chat_template=false or use a "
        "tokenizer that has one"
    ]


def test_the_longest_prompt_and_max_new_tokens_fit_the_models_context(tmp_path, model, data):
    """The longest prompt, ``bcb=``, is 5 tokens with BOS; the tiny model has 256 positions."""
    preflight(_config(tmp_path, model, data, "rollout.sampling.max_new_tokens=251"), machine=NO_GPU)
    assert _problems(_config(tmp_path, model, data, "rollout.sampling.max_new_tokens=252")) == [
        "rollout.sampling.max_new_tokens: 252 tokens after the longest prompt of data.train_files (5 tokens) make "
        f"257, more than the model's context of 256 positions (max_position_embeddings in {model}/config.json); set "
        "it to at most 251, or use shorter prompts"
    ]
    # a loop that generates nothing is not held to it (an sft run keeps the default rollout section)
    pytest.importorskip("core_rl_sft")
    sft = _config(tmp_path, model, data, "algorithm.name=sft", "~reward", "rollout.sampling.max_new_tokens=252")
    preflight(sft, machine=NO_GPU)
    # a scaled RoPE extends the context by its factor (here written as transformers 4 did)
    config = json.loads((model / "config.json").read_text())
    del config["rope_parameters"]
    (model / "config.json").write_text(json.dumps({**config, "rope_scaling": {"type": "linear", "factor": 2.0}}))
    preflight(_config(tmp_path, model, data, "rollout.sampling.max_new_tokens=507"), machine=NO_GPU)
    (problem,) = _problems(_config(tmp_path, model, data, "rollout.sampling.max_new_tokens=508"))
    assert "make 513, more than the model's context of 512 positions" in problem


def test_lora_target_modules_are_checked_against_the_model(tmp_path, model, data):
    """peft's own check, on the model built on the meta device: before any weight is read."""
    preflight(_config(tmp_path, model, data, "actor.lora.rank=4", "actor.lora.target_modules=[q_proj]"), machine=NO_GPU)
    (problem,) = _problems(_config(tmp_path, model, data, "actor.lora.rank=4", "actor.lora.target_modules=[qproj]"))
    assert problem.startswith("actor.lora.target_modules: ['qproj']: peft: ") and "{'qproj'} not found" in problem
    assert problem.endswith("(name the model's linear layers, e.g. q_proj and v_proj, or all-linear)")


def _corrupt_config(model: Path) -> str:
    (model / "config.json").write_text('{\n  "model_type": "llama",\n  "vocab_size": 8,,\n}\n')
    return f"{model}/config.json:3:19: corrupt JSON (Expecting property name enclosed in double quotes)"


def _unknown_type(model: Path) -> str:
    (model / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    return f"{model}/config.json: transformers cannot read it: ValueError: "


def _no_config(model: Path) -> str:
    (model / "config.json").unlink()
    return f"actor.model_path: '{model}' has no config.json; it is not a Hugging Face model directory"


def _garbage_weights(model: Path) -> str:
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)
    return f"{model}/model.safetensors: not a complete safetensors file (SafetensorError: "


def _header_only(model: Path) -> str:
    data = (model / "model.safetensors").read_bytes()
    header = int.from_bytes(data[:8], "little")
    (model / "model.safetensors").write_bytes(data[: 8 + header])
    return f"{model}/model.safetensors: not a complete safetensors file (SafetensorError: "


def _no_weights(model: Path) -> str:
    (model / "model.safetensors").unlink()
    return f"{model}: no model weights (model.safetensors, model.safetensors.index.json with its shards, or "


def _missing_shard(model: Path) -> str:
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return f"{model}/model-00002-of-00002.safetensors: missing, although model.safetensors.index.json lists it"


def _bad_torch_bin(model: Path) -> str:
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"PK\x03\x04 truncated")
    return f"{model}/pytorch_model.bin: not a complete PyTorch checkpoint (not a zip archive)"


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_config,
        _unknown_type,
        _no_config,
        _garbage_weights,
        _header_only,
        _no_weights,
        _missing_shard,
        _bad_torch_bin,
    ],
)
def test_model_directory_problems(model, corrupt):
    expected = corrupt(model)
    _, problems = check_model_dir(str(model), "actor.model_path")
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_missing_model_directory_and_the_offline_default(tmp_path):
    _, problems = check_model_dir("Qwen/Qwen2.5-0.5B", "actor.model_path")
    assert problems == [
        "actor.model_path: 'Qwen/Qwen2.5-0.5B' does not exist; it looks like a Hugging Face hub id, and core-rl does "
        "not download by default: run `hf download Qwen/Qwen2.5-0.5B --local-dir DIR` and set actor.model_path: DIR, "
        "or set experiment.offline=false to let core-rl download it into the Hugging Face cache"
    ]
    _, problems = check_model_dir(str(tmp_path / "nowhere"), "actor.model_path")
    assert problems == [f"actor.model_path: '{tmp_path}/nowhere' does not exist"]
    (tmp_path / "f").write_text("x")
    _, problems = check_model_dir(str(tmp_path / "f"), "actor.model_path")
    assert problems == [f"actor.model_path: '{tmp_path}/f' is a file; it must be a Hugging Face model directory"]


def test_hub_downloads_only_when_offline_is_false(tmp_path, tiny_model, data, monkeypatch):
    """No hub is reachable here: the download function is replaced to inject its outcomes."""
    import huggingface_hub

    asked: list[str] = []

    def fake_download(repo_id: str) -> str:
        asked.append(repo_id)
        if repo_id == "org/missing":
            raise ConnectionError("Failed to resolve 'huggingface.co'")
        return str(tiny_model)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert "does not download by default" in _problems(_config(tmp_path, Path("org/tiny"), data))[0]
    assert asked == []
    cfg = _config(tmp_path, Path("org/tiny"), data, "experiment.offline=false")
    assert preflight(cfg, machine=NO_GPU).model.path == str(tiny_model)
    assert cfg.actor.model_path == str(tiny_model) and asked == ["org/tiny"]
    problems = _problems(_config(tmp_path, Path("org/missing"), data, "experiment.offline=false"))
    assert problems[0] == (
        "actor.model_path: cannot download 'org/missing' from the Hugging Face hub: ConnectionError: Failed to "
        "resolve 'huggingface.co'"
    )


def test_tokenizer_problems(model, tmp_path):
    tokenizer, problems = check_tokenizer_dir(str(model), "actor.model_path")
    assert problems == [] and tokenizer is not None
    (model / "tokenizer.json").write_text('{"version": "1.0", "truncation": null,\n  "model": ')
    _, problems = check_tokenizer_dir(str(model), "actor.model_path")
    assert problems == [f"{model}/tokenizer.json:2:12: corrupt JSON (Expecting value)"]
    (model / "tokenizer.json").write_text('{"version": "1.0"}')
    _, problems = check_tokenizer_dir(str(model), "actor.model_path")
    assert problems[0].startswith(f"actor.model_path: transformers cannot load the tokenizer in '{model}': ")
    (model / "tokenizer.json").unlink()
    _, problems = check_tokenizer_dir(str(model), "actor.tokenizer_path")
    assert problems == [
        f"actor.tokenizer_path: '{model}' holds no tokenizer (none of tokenizer.json, tokenizer.model, spiece.model, "
        "vocab.json, vocab.txt); set actor.tokenizer_path to the directory of the model's tokenizer"
    ]


def test_the_machine_decides_devices_and_backends(tmp_path, model, data):
    two_gpus = MachineInfo(cuda_device_count=2, local_world_size=1)
    cfg = _config(tmp_path, model, data, "rollout.engine.device=cuda:1", "actor.engine.backend=nccl")
    assert preflight(cfg, machine=two_gpus).machine == two_gpus
    cfg = _config(tmp_path, model, data, "rollout.engine.device=cuda:2", "actor.engine.attn_implementation=eager")
    assert _problems(cfg, two_gpus) == [
        "rollout.engine.device: 'cuda:2' but this machine has 2 CUDA device(s), cuda:0 to cuda:1"
    ]
    crowded = MachineInfo(cuda_device_count=2, local_world_size=4)
    assert _problems(_config(tmp_path, model, data), crowded) == [
        "actor.engine: 4 processes on this node but only 2 CUDA devices; start at most one process per GPU (torchrun "
        "--nproc_per_node), or set device: cpu"
    ]
    preflight(_config(tmp_path, model, data, "actor.engine.device=cpu"), machine=crowded)  # CPU ranks need no GPU each
    for engine in ("deepspeed", "megatron"):  # every train engine checks it the same way
        (problem,) = _problems(_config(tmp_path, model, data, f"actor.engine={{name: {engine}}}"), crowded)
        assert problem.startswith("actor.engine: 4 processes on this node but only 2 CUDA devices"), problem
    assert _problems(_config(tmp_path, model, data, "actor.engine.device=cuda")) == [
        "actor.engine.device: cuda, but this machine has no CUDA GPU; use auto or cpu"
    ]
    flash = ("actor.engine.attn_implementation=flash_attention_2", "actor.engine.param_dtype=bfloat16")
    assert _problems(_config(tmp_path, model, data, *flash)) == [
        "actor.engine.attn_implementation: flash_attention_2 needs a CUDA GPU and this machine has none; use sdpa"
    ]
    assert _problems(_config(tmp_path, model, data, "rollout.engine.device=mps")) == [
        "rollout.engine.device: 'mps' but Apple MPS is not available here; use 'auto' or 'cpu'"
    ]


class RecordingEngine:
    """A train engine that records that it was built (then stops the run)."""

    built: ClassVar[list[str]] = []

    @hookimpl
    def core_rl_register_train_engines(self, register):
        def build(actor, config, *, trainable):
            self.built.append(actor.model_path)
            raise DataError("the recording engine stops here")

        register("recording", build, description="records that it was built")


class FailingReward:
    """A reward whose scoring fails, as a reward meeting an unexpected row would."""

    @hookimpl
    def core_rl_register_rewards(self, register):
        def build(config):
            class Failing(Reward):
                def score(self, items):
                    raise DataError("reward 'failing': this row has no 'x'")

            return Failing()

        register("failing", build, description="always fails")


def test_bad_data_stops_train_before_any_model_is_loaded(tmp_path, model, data):
    host = PluginHost()
    host.register_plugin(RecordingEngine(), distribution="test-recording")
    RecordingEngine.built.clear()
    data.write_text('{"prompt": "ab="}\n{"prompt": 7}\n')
    cfg = _config(tmp_path, model, data, "actor.engine.name=recording", "reward.name=char_match", host=host)
    with pytest.raises(PreflightError, match=r"train.jsonl:1: no column 'answer'"):
        train(cfg, host=host)
    assert RecordingEngine.built == []
    data.write_text('{"prompt": "ab=", "answer": "ba"}\n')
    with pytest.raises(DataError, match="the recording engine stops here"):
        train(_config(tmp_path, model, data, "actor.engine.name=recording", host=host), host=host)
    assert RecordingEngine.built == [str(model)]


def test_a_run_that_fails_at_its_first_step_can_be_run_again(tmp_path, model, data):
    """A failed run leaves no empty metrics file that would block the next one as 'already a run'."""
    host = PluginHost()
    host.register_plugin(FailingReward(), distribution="test-failing")
    quick = ["trainer.total_steps=1", "trainer.torch_threads=1", "saver.at_end=false", "saver.export_hf=false"]
    with pytest.raises(RewardError, match="this row has no 'x'"):  # every item failed: the reward is broken
        train(_config(tmp_path, model, data, "reward.name=failing", *quick, host=host), host=host)
    metrics = tmp_path / "runs" / "run" / "metrics.jsonl"
    assert not metrics.exists()
    train(_config(tmp_path, model, data, *quick), host=PluginHost())
    assert len(metrics.read_text().splitlines()) == 1


def test_config_validate_runs_the_preflight_on_request(tmp_path, model, data, capsys):
    """``core-rl config validate`` checks the config alone; ``--preflight`` adds the checks ``train``
    runs first (here: a missing model directory, named by its key), and creates no run directory."""
    from core_rl import cli

    cfg = _config(tmp_path, model, data)  # writes run.yaml
    path = str(tmp_path / "run.yaml")
    missing = f"actor.model_path={tmp_path / 'nowhere'}"
    assert cli.main(["config", "validate", path, missing]) == 0
    capsys.readouterr()
    assert cli.main(["config", "validate", "--preflight", path, missing]) == 2
    err = capsys.readouterr().err
    assert "actor.model_path" in err and "nowhere" in err and "Traceback" not in err
    assert cli.main(["config", "validate", "--preflight", path]) == 0
    assert "preflight passed" in capsys.readouterr().out
    assert not (Path(cfg.experiment.output_dir) / cfg.experiment.name).exists()
    (tmp_path / "runs").write_text("a file where the output directory should be")
    assert cli.main(["config", "validate", "--preflight", path]) == 2
    assert "experiment.output_dir: cannot create or write the run directory" in capsys.readouterr().err


def test_role_models_must_share_the_policys_tokenizer(tmp_path, model, data):
    """A teacher, critic or ref reads the policy's token ids: another vocabulary, or an embedding
    without a row for each of the policy's ids, stops the run before any model loads; a copy of
    the policy's model in another directory passes (compared by vocabulary, not by path)."""
    other = build_tiny_model(tmp_path / "other", alphabet="cba=", hidden_size=16, num_heads=2)
    same = Path(shutil.copytree(model, tmp_path / "same"))
    small = build_tiny_model(tmp_path / "small", alphabet="abc=", hidden_size=16, num_heads=2)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 5  # the actor's tokenizer has ids up to 7
    (small / "config.json").write_text(json.dumps(config))
    teacher = _problems(_config(tmp_path, model, data, f"teacher.model_path={other}"))
    assert len(teacher) == 1
    assert teacher[0].startswith(f"teacher.model_path: the tokenizer in {str(other)!r} is not the actor's ")
    assert "the teacher computes the distillation targets on the policy's token ids" in teacher[0]
    critic = _problems(_config(tmp_path, model, data, f"critic.model_path={small}"))
    assert critic == [
        "critic.model_path: its embedding has 5 rows, but the actor's tokenizer has ids up to 7; the critic values "
        "the policy's token ids"
    ]
    preflight(_config(tmp_path, model, data, f"ref.model_path={same}", f"teacher.model_path={same}"), machine=NO_GPU)


def test_activation_checkpointing_every_n_layers_needs_a_recent_transformers(tmp_path, model, data, monkeypatch):
    from transformers import PreTrainedModel

    cfg = _config(
        tmp_path, model, data, "actor.gradient_checkpointing=true", "actor.gradient_checkpointing_every_n_layers=2"
    )
    if hasattr(PreTrainedModel, "activation_checkpointing_enable"):
        preflight(cfg)  # this transformers can
        monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable")
    (problem,) = _problems(cfg)
    assert problem.startswith(
        "actor.gradient_checkpointing_every_n_layers / gradient_checkpointing_offload: need transformers >= 5.23"
    )


def test_the_trainer_takes_the_prompts_preflight_tokenised(tmp_path, model, data, monkeypatch):
    """Preflight tokenises every prompt to check it; the trainer's prompt source (with its own
    tokenizer, loaded from the same directory, as the trainer loads it) takes those items instead
    of tokenising them all again. Under other settings (another length bound) it tokenises anew."""
    import attrs
    from core_rl.data import prompts as data_module
    from core_rl.data.prompts import PromptSource
    from transformers import AutoTokenizer

    cfg = _config(tmp_path, model, data)
    checked = preflight(cfg, machine=NO_GPU)
    calls = []
    encode = data_module.encode_prompt
    monkeypatch.setattr(data_module, "encode_prompt", lambda *a, **k: calls.append(a[0]) or encode(*a, **k))
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.tokenizer_path or cfg.actor.model_path)
    source = PromptSource(cfg.data, tokenizer, seed=1, rows=checked.rows)
    assert calls == []
    assert [(i.text, i.prompt_ids) for i in source.items] == [
        (t, tokenizer(t)["input_ids"]) for t in ("ab=", "ca=", "bcb=")
    ]
    PromptSource(attrs.evolve(cfg.data, max_prompt_tokens=64), tokenizer, seed=1, rows=checked.rows)
    assert calls == ["ab=", "ca=", "bcb="]
