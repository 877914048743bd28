"""``actor.optimizer.name``: adafactor, muon and class (a class_path), beside adamw and sgd: which
parameters Muon takes, that the combined Muon/AdamW optimizer steps as the two torch optimizers
would, keys that do not apply refused, class_path checked at ``config validate`` (exit 2), and the
engines refusing what they cannot run. Training and exact resume per optimizer: the engine
contract's ``test_optimizer_choice_trains_and_resumes_exactly`` (:mod:`core_rl.testing.engine_contracts`)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from core_rl import cli
from core_rl.config.checks import EnvironmentContext, MachineInfo, SectionContext, config_problems
from core_rl.config.optimizer_checks import APPLIES_TO, section_problems
from core_rl.config.schema import ActorConfig, LoraConfig, OptimizerConfig, PluginSpec, RunConfig
from core_rl.roles.hf import load_causal_lm, load_value_model
from core_rl_train_kit.muon import MUON_GROUP, MuonWithAdamW, embeddings_and_head, muon_split
from core_rl_train_kit.optim import build_optimizer, set_lr

LAYER_MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_MATRICES = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from core_rl.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _names(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]


@pytest.mark.parametrize("head", ["lm", "value"])
def test_muon_takes_exactly_the_hidden_matrices_of_the_tiny_model(tiny: Path, head: str) -> None:
    """The tiny Llama (2 layers): Muon gets the 7 projection matrices of each layer; the embedding,
    the output head (``lm_head``, or a value model's ``score``) and the norm scales go to AdamW."""
    model = (load_causal_lm if head == "lm" else load_value_model)(str(tiny), dtype="float32")
    hidden, others = muon_split(model.parameters(), embeddings_and_head(model))
    expected = [f"model.layers.{i}.{m}.weight" for i in range(2) for m in (*LAYER_MATRICES, *MLP_MATRICES)]
    assert _names(model, hidden) == expected
    head_names = ["lm_head.weight"] if head == "lm" else [n for n, _ in model.named_parameters() if "score" in n]
    norms = [f"model.layers.{i}.{n}.weight" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
    assert sorted(_names(model, others)) == sorted(
        ["model.embed_tokens.weight", *norms, "model.norm.weight", *head_names]
    )


def test_a_head_named_classifier_is_left_to_adamw() -> None:
    """Model families that name a token classifier's head ``classifier`` (GPT-2) keep it out of Muon."""
    from transformers import GPT2Config, GPT2ForTokenClassification

    model = GPT2ForTokenClassification(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, num_labels=1))
    excluded = {id(p) for p in embeddings_and_head(model)}
    assert id(model.classifier.weight) in excluded and id(model.transformer.wte.weight) in excluded
    hidden, _ = muon_split(model.parameters(), embeddings_and_head(model))
    assert all(id(p) not in excluded for p in hidden) and hidden


def test_muon_with_adamw_steps_as_the_two_torch_optimizers_do() -> None:
    """One step of the combined optimizer equals torch's Muon on the hidden matrix (at ``muon_lr``,
    ``muon_momentum``) plus torch's AdamW on the rest (at ``lr``, the spared group without decay),
    built separately on copies of the same parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 6), torch.nn.LayerNorm(6))
    twin = copy.deepcopy(model)
    config = OptimizerConfig(
        name="muon", lr=1e-2, muon_lr=5e-2, muon_momentum=0.9, weight_decay=0.1, implementation="for_loop"
    )
    combined = build_optimizer(model.parameters(), config, adamw_only=embeddings_and_head(model))
    assert isinstance(combined, MuonWithAdamW)
    embed, linear, norm = twin
    muon = torch.optim.Muon([linear.weight], lr=5e-2, momentum=0.9, weight_decay=0.1)
    adamw = torch.optim.AdamW(
        [{"params": [embed.weight]}, {"params": [linear.bias, *norm.parameters()], "weight_decay": 0.0}],
        lr=1e-2,
        weight_decay=0.1,
        foreach=False,
    )
    tokens = torch.tensor([1, 4, 9])
    for step in range(2):
        set_lr(combined, 1e-2)
        for m, optimizers in ((model, [combined]), (twin, [muon, adamw])):
            m(tokens).square().sum().backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=0, rtol=0, msg=f"step {step}: {name}")
    assert [g["lr"] for g in combined.param_groups if g[MUON_GROUP]] == [5e-2]


def test_a_loaded_muon_state_keeps_this_runs_muon_settings() -> None:
    """Resuming with another ``muon_lr``/``muon_momentum`` follows this run's configuration."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    saved = build_optimizer(model.parameters(), OptimizerConfig(name="muon", lr=1e-2, muon_lr=2e-2)).state_dict()
    config = OptimizerConfig(name="muon", lr=1e-2, muon_lr=4e-2, muon_momentum=0.8)
    resumed = build_optimizer(model.parameters(), config)
    resumed.load_state_dict(saved)
    set_lr(resumed, 0.5e-2)  # the schedule at half the rate: Muon's at half its own
    (muon_group,) = [g for g in resumed.param_groups if g[MUON_GROUP]]
    assert muon_group["lr"] == pytest.approx(2e-2) and muon_group["momentum"] == 0.8


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("adafactor", "betas", (0.8, 0.99)),
        ("adamw", "momentum", 0.9),
        ("sgd", "implementation", "fused"),
        ("adamw", "class_path", "torch.optim:RMSprop"),
        ("muon", "kwargs", {"foreach": True}),
        ("adamw", "muon_lr", 0.02),
        ("class", "muon_momentum", 0.9),
        ("sgd", "eps", 1e-6),
    ],
)
def test_keys_that_do_not_apply_are_refused(name: str, key: str, value: object) -> None:
    extra = {"class_path": "torch.optim:RMSprop"} if name == "class" else {}
    config = OptimizerConfig(name=name, **{**extra, key: value})
    (problem,) = section_problems(config, "actor.optimizer", lora=False)
    assert problem.startswith(f"actor.optimizer.{key}: applies to {' and '.join(APPLIES_TO[key])} only, not to ")
    assert f"actor.optimizer.name: {name}" in problem


def test_keys_that_apply_or_keep_their_defaults_pass() -> None:
    for config in (
        OptimizerConfig(name="muon", betas=(0.8, 0.9), eps=1e-6, muon_lr=0.02, muon_momentum=0.9),
        OptimizerConfig(name="sgd", momentum=0.9, betas=(0.9, 0.999)),  # betas at its default
        OptimizerConfig(name="adafactor", kwargs={"beta2_decay": -0.7}, weight_decay=0.1),
        OptimizerConfig(name="class", class_path="torch.optim:RMSprop", kwargs={"alpha": 0.9}, weight_decay=0.1),
    ):
        assert section_problems(config, "actor.optimizer", lora=False) == [], config


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({}, "actor.optimizer.class_path: required with actor.optimizer.name: class"),
        ({"class_path": "no_such_module_xyz:Opt"}, "actor.optimizer.class_path: cannot import 'no_such_module_xyz'"),
        ({"class_path": "torch.nn:Linear"}, "actor.optimizer.class_path: 'torch.nn:Linear' is <class "),
        ({"class_path": "torch.optim:Nope"}, "actor.optimizer.class_path: module 'torch.optim' has no 'Nope'"),
        (
            {"class_path": "torch.optim:RMSprop", "kwargs": {"betas": [0.9, 0.9]}},
            "actor.optimizer.kwargs.betas: RMSprop takes no argument 'betas'",
        ),
        ({"class_path": "torch.optim:RMSprop", "kwargs": {"lr": 1.0}}, "actor.optimizer.kwargs.lr: 'lr' is set by"),
        ({"class_path": "torch.optim:Rprop", "weight_decay": 0.1}, "actor.optimizer.weight_decay: 0.1, but Rprop"),
    ],
)
def test_a_bad_optimizer_class_is_one_line_naming_the_key(settings: dict, problem: str) -> None:
    (line,) = section_problems(OptimizerConfig(name="class", **settings), "actor.optimizer", lora=False)
    assert line.startswith(problem) and "\n" not in line


def test_a_class_optimizer_gets_lr_weight_decay_and_kwargs() -> None:
    model = torch.nn.Linear(3, 2)
    config = OptimizerConfig(
        name="class", class_path="torch.optim:RMSprop", lr=0.05, weight_decay=0.1, kwargs={"alpha": 0.7}
    )
    optimizer = build_optimizer(model.parameters(), config)
    assert isinstance(optimizer, torch.optim.RMSprop)
    decayed, spared = optimizer.param_groups  # no_decay: biases_and_norms
    assert (decayed["lr"], decayed["weight_decay"], decayed["alpha"], spared["weight_decay"]) == (0.05, 0.1, 0.7, 0.0)
    assert isinstance(build_optimizer(model.parameters(), OptimizerConfig(name="adafactor")), torch.optim.Adafactor)


def _run_config(tmp_path: Path, tiny: Path, optimizer: dict) -> Path:
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "ab", "answer": "a"}\n')
    config = {
        "experiment": {"name": "opt", "output_dir": str(tmp_path / "runs")},
        "data": {"train_files": [str(data)], "batch_size": 2},
        "actor": {"model_path": str(tiny), "engine": {"name": "fsdp"}, "optimizer": optimizer},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 2, "max_new_tokens": 3}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "exact_match"},
        "trainer": {"total_steps": 2},
        "loggers": [{"name": "jsonl"}],
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_config_validate_exits_2_on_a_bad_class_path(tmp_path: Path, tiny: Path, capsys) -> None:
    path = _run_config(tmp_path, tiny, {"name": "class", "class_path": "torch.optim:RMSprop", "lr": 1e-4})
    assert cli.main(["config", "validate", str(path)]) == 0
    capsys.readouterr()
    assert cli.main(["config", "validate", str(path), "actor.optimizer.class_path=torch.nn:Linear"]) == 2
    err = capsys.readouterr().err
    assert "actor.optimizer.class_path: 'torch.nn:Linear' is <class 'torch.nn.modules.linear.Linear'>, not a" in err
    assert "Traceback" not in err


def _engine_problems(engine: str, optimizer: OptimizerConfig, machine: MachineInfo | None = None, **options) -> list:
    from core_rl.config.sections import validate_plugin_section
    from core_rl.plugins.host import PluginHost
    from core_rl.plugins.kinds import TRAIN_ENGINE

    spec = PluginSpec(name=engine, options=options)
    run = RunConfig(actor=ActorConfig(engine=spec, optimizer=optimizer))
    validate_plugin_section(PluginHost(environ={}), TRAIN_ENGINE, spec, "actor.engine", run=run)
    if machine is None:
        context = SectionContext(path="actor.engine", run=run, name=engine)
        return config_problems(spec.config, context)
    environment = EnvironmentContext(path="actor.engine", run=run, name=engine, machine=machine)
    return spec.config.check_environment(environment)


def test_engines_refuse_what_they_cannot_run() -> None:
    muon, adafactor = OptimizerConfig(name="muon"), OptimizerConfig(name="adafactor")
    rmsprop = OptimizerConfig(name="class", class_path="torch.optim:RMSprop")
    for optimizer in (muon, adafactor):
        (line,) = _engine_problems("deepspeed", optimizer)
        assert line.startswith(f"actor.optimizer.name: {optimizer.name} needs each weight matrix whole")
    assert _engine_problems("deepspeed", rmsprop) == []
    assert _engine_problems("fsdp", muon) == [] and _engine_problems("fsdp", adafactor) == []
    (line,) = _engine_problems("fsdp", muon, cpu_offload=True)
    assert line.startswith("actor.optimizer.name: muon needs whole weight matrices, but actor.engine.cpu_offload")
    two_processes = MachineInfo(local_world_size=2)
    assert any(p.startswith("actor.optimizer.name: muon") for p in _engine_problems("fsdp", muon, two_processes))
    two_nodes = MachineInfo(local_world_size=1, world_size=2)  # one process on each of two nodes
    assert any("over the 2 processes of this run" in p for p in _engine_problems("fsdp", muon, two_nodes))
    assert not any("optimizer" in p for p in _engine_problems("fsdp", adafactor, two_processes))


def test_muon_refuses_lora() -> None:
    (line,) = section_problems(OptimizerConfig(name="muon"), "critic.optimizer", lora=LoraConfig(rank=4).enabled)
    assert line.startswith("critic.optimizer.name: muon orthogonalises whole weight matrices, but critic.lora")
