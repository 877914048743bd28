"""Resolving ``max_tokens_per_mb: auto`` at a run's start (core_rl.loops.auto_budget): the GPU
branch with injected free-memory figures (a CPU cannot produce them), the CPU figure, explicit
values, agreement between ranks, what ``<run>/config.yaml`` records and what a resume reports."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest
import torch
from core_rl.config.loader import to_yaml
from core_rl.config.schema import ActorConfig, CriticConfig, PluginSpec, RunConfig
from core_rl.loops import auto_budget
from core_rl.loops.auto_budget import Facts, choose, resolve_auto_budgets
from core_rl.loops.run_config import record_config, resume_note
from core_rl.roles.built_engines import BuiltEngine

GIB = 2**30
CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A Qwen2.5-0.5B-shaped config.json and a safetensors header of 360M values (no weights)."""
    shape = {"num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864, "vocab_size": 151936}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [360_000_000], "data_offsets": [0, 0]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return tmp_path


@attrs.define
class Bf16Engine:
    """An engine config that computes in bfloat16 (as fsdp with ``param_dtype: bfloat16``)."""

    def compute_dtype(self, section: ActorConfig) -> str:
        return "bfloat16"


def _actor(model_dir: Path, **kwargs) -> ActorConfig:
    return ActorConfig(model_path=str(model_dir), engine=PluginSpec(name="fsdp", config=Bf16Engine()), **kwargs)


def _engine(device: torch.device = CUDA0) -> SimpleNamespace:
    return SimpleNamespace(device=device)


def _free(monkeypatch: pytest.MonkeyPatch, gib: float) -> None:
    monkeypatch.setattr(auto_budget, "free_bytes", lambda device: int(gib * GIB))


def test_gpu_budget_from_free_memory_less_the_pending_optimizer_state(model_dir, monkeypatch):
    cfg = RunConfig(actor=_actor(model_dir))
    built = [
        BuiltEngine("actor", cfg.actor, _engine(), trainable=True, weight_bytes=GIB),
        BuiltEngine("ref", cfg.actor, _engine(), trainable=False, weight_bytes=GIB),  # the actor's section
    ]
    _free(monkeypatch, 40)
    out = io.StringIO()
    chosen = resolve_auto_budgets(cfg, built, out=out)
    # usable 40 - 3 x 1 (gradients + AdamW moments) = 37 GiB; per token in bfloat16 24 layers x
    # 53248 + the logits and their gradient 151936 x 2 x 2 = 1885696 B:
    # 0.5 x 37 GiB / 1885696 = 10534.2 tokens -> 10496
    assert out.getvalue() == (
        "core-rl: actor.micro_batch.max_tokens_per_mb: auto -> 10496 (cuda:0, 40.0 GiB free, 0.36B parameters)\n"
    )
    assert [r.key for r in chosen] == ["actor"] and cfg.actor.micro_batch.max_tokens_per_mb == 10496
    derived = cfg.derived["actor.micro_batch.max_tokens_per_mb"]
    assert derived.at_start and derived.written == "auto" and derived.value == 10496
    assert "max_tokens_per_mb: auto  # derived: 10496 = 0.5 x (free 40.00 GiB - gradients and optimizer state 3.00" in (
        to_yaml(cfg)
    )
    # an in-process restart on the same configuration chooses again, from the memory free then
    _free(monkeypatch, 20)  # 0.5 x 17 GiB / 1885696 = 4840.0 -> 4736
    assert resolve_auto_budgets(cfg, built, out=io.StringIO())[0].value == 4736
    assert cfg.actor.micro_batch.max_tokens_per_mb == 4736


def test_under_sequence_parallelism_the_line_says_what_a_group_splits(model_dir, monkeypatch):
    """The budget counts one rank's slice; a group of ``n`` ranks runs ``n`` times it a micro-batch."""

    @attrs.define
    class SequenceParallelEngine(Bf16Engine):
        sequence_parallel_size: int = 2

    cfg = RunConfig(
        actor=ActorConfig(model_path=str(model_dir), engine=PluginSpec(name="fsdp", config=SequenceParallelEngine()))
    )
    built = [BuiltEngine("actor", cfg.actor, _engine(), trainable=True, weight_bytes=GIB)]
    _free(monkeypatch, 40)
    out = io.StringIO()
    assert resolve_auto_budgets(cfg, built, out=out)[0].value == 10496  # as on one rank (first test)
    assert out.getvalue() == (
        "core-rl: actor.micro_batch.max_tokens_per_mb: auto -> 10496 (cuda:0, 40.0 GiB free, 0.36B parameters; "
        "a group of 2 ranks splits 20992 tokens)\n"
    )


def test_an_engine_that_says_what_its_first_step_allocates_is_taken_at_its_word(model_dir, monkeypatch):
    """An engine whose gradient buffers and master copies exist from its build (``megatron``) says
    what is still to come (``pending_state_bytes()``): that, not 3 x its build's memory."""
    cfg = RunConfig(actor=_actor(model_dir))
    engine = SimpleNamespace(device=CUDA0, pending_state_bytes=lambda: GIB)
    built = [BuiltEngine("actor", cfg.actor, engine, trainable=True, weight_bytes=5 * GIB)]
    _free(monkeypatch, 40)
    chosen = resolve_auto_budgets(cfg, built, out=io.StringIO())
    # usable 40 - 1 = 39 GiB: 0.5 x 39 GiB / 1885696 = 11103.6 tokens -> 11008 (with 3 x 5 GiB: 25 GiB -> 7040)
    assert chosen[0].value == 11008


def test_each_section_is_resolved_with_every_trained_role_on_its_device(model_dir, monkeypatch):
    cfg = RunConfig(actor=_actor(model_dir), critic=CriticConfig(model_path=str(model_dir)))
    built = [
        BuiltEngine("actor", cfg.actor, _engine(), trainable=True, weight_bytes=GIB),
        BuiltEngine("critic", cfg.critic, _engine(), trainable=True, head="value", weight_bytes=GIB),
    ]
    _free(monkeypatch, 40)
    out = io.StringIO()
    values = {r.key: r.value for r in resolve_auto_budgets(cfg, built, out=out)}
    # usable 40 - 6 = 34 GiB. actor (bfloat16): 0.5 x 34 GiB / 1885696 = 9680.0 -> 9600;
    # critic (float32, a value head): 24 x 26624 x 4 + 4 = 2555908 B -> 7141.7 -> 7040
    assert values == {"actor": 9600, "critic": 7040}
    assert "core-rl: critic.micro_batch.max_tokens_per_mb: auto -> 7040 (cuda:0" in out.getvalue()


def test_ranks_agree_on_the_least_usable_memory(model_dir):
    section = _actor(model_dir)
    engines = [BuiltEngine("actor", section, _engine(), trainable=True)]
    facts = [Facts("cuda:0", 40 * GIB, 3 * GIB), Facts("cuda:1", 20 * GIB, 3 * GIB)]
    resolved = choose("actor", section, engines, facts)
    assert resolved.value == 4736  # 0.5 x 17 GiB / 1885696 = 4840.0 -> 4736
    assert "(cuda:0, 20.0 GiB free (least of 2 ranks), 0.36B parameters)" in resolved.line


def test_on_a_cpu_the_budget_fills_256_mib_of_activations_within_768_and_2048(model_dir, tmp_path):
    cfg = RunConfig(actor=ActorConfig(model_path=str(model_dir)))
    out = io.StringIO()
    resolve_auto_budgets(cfg, [BuiltEngine("actor", cfg.actor, _engine(torch.device("cpu")), True)], out=out)
    # 0.5B, float32: 24 x (8 x 896 + 4 x 4864) x 4 + 2 x 151936 x 4 = 3,771,392 bytes a token -> 71 -> 768
    assert out.getvalue() == "core-rl: actor.micro_batch.max_tokens_per_mb: auto -> 768 (cpu, 0.36B parameters)\n"
    assert cfg.actor.micro_batch.max_tokens_per_mb == 768
    derived = cfg.derived["actor.micro_batch.max_tokens_per_mb"]
    assert (
        derived.source
        == "256 MiB / 3683.0 KiB of activations per token, a multiple of 128 in [768, 2048] (cpu, 0.36B parameters)"
    )
    # an engine that does not say where it computes counts as on the CPU
    cfg = RunConfig(actor=ActorConfig(model_path=str(model_dir)))
    assert resolve_auto_budgets(cfg, [BuiltEngine("actor", cfg.actor, object(), True)], out=out)[0].value == 768
    # a narrower model, float32: 6 x (8 x 512 + 4 x 1408) x 4 + 2 x 1000 x 4 = 241,472 bytes -> 1111 -> 1024
    (tmp_path / "narrow").mkdir()
    shape = {"num_hidden_layers": 6, "hidden_size": 512, "intermediate_size": 1408, "vocab_size": 1000}
    (tmp_path / "narrow" / "config.json").write_text(json.dumps(shape))
    cfg = RunConfig(actor=ActorConfig(model_path=str(tmp_path / "narrow")))
    assert resolve_auto_budgets(cfg, [BuiltEngine("actor", cfg.actor, object(), True)], out=out)[0].value == 1024
    assert out.getvalue().endswith("auto -> 1024 (cpu, ~19.8M parameters)\n")
    # the same in bfloat16 (the engine's compute dtype): half the bytes, 2223 tokens -> the most, 2048
    cfg = RunConfig(actor=_actor(tmp_path / "narrow"))
    assert resolve_auto_budgets(cfg, [BuiltEngine("actor", cfg.actor, object(), True)], out=out)[0].value == 2048


def test_a_model_without_a_shape_gets_the_cpu_figure_and_says_why(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    cfg = RunConfig(actor=ActorConfig(model_path=str(tmp_path)))
    _free(monkeypatch, 40)
    out = io.StringIO()
    resolve_auto_budgets(cfg, [BuiltEngine("actor", cfg.actor, _engine(), True)], out=out)
    assert cfg.actor.micro_batch.max_tokens_per_mb == 768
    assert "auto -> 768 (cuda:0; the CPU figure: " in out.getvalue() and "names no layer count" in out.getvalue()


def test_an_explicit_budget_wins(model_dir, monkeypatch):
    cfg = RunConfig(actor=_actor(model_dir))
    cfg.actor.micro_batch.max_tokens_per_mb = 16640
    _free(monkeypatch, 40)
    out = io.StringIO()
    assert resolve_auto_budgets(cfg, [BuiltEngine("actor", cfg.actor, _engine(), True)], out=out) == []
    assert out.getvalue() == "" and cfg.actor.micro_batch.max_tokens_per_mb == 16640 and not cfg.derived
    assert "max_tokens_per_mb: 16640\n" in to_yaml(cfg)


def test_a_resume_does_not_report_a_budget_chosen_anew(model_dir, monkeypatch, tmp_path):
    run_dir = tmp_path / "run"
    cfg = RunConfig(actor=_actor(model_dir))
    built = [BuiltEngine("actor", cfg.actor, _engine(), True, weight_bytes=GIB)]
    _free(monkeypatch, 40)
    resolve_auto_budgets(cfg, built, out=io.StringIO())
    record_config(run_dir, cfg, None)
    _free(monkeypatch, 30)  # the resumed run finds less free memory: 0.5 x 27 GiB / 1885696 = 7687.1 -> 7680
    resolve_auto_budgets(cfg, built, out=io.StringIO())
    found = record_config(run_dir, cfg, 2)
    assert resume_note(found, 2) is None and found.kept is None
    assert "max_tokens_per_mb: auto  # derived: 7680" in (run_dir / "config.yaml").read_text()
