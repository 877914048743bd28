"""Saved rollouts (``rollout.dump``) and training from them (``rollout.replay_from``) with real
``core-rl train`` runs of the tiny model: a replay without rollout engine or reward ends bitwise
where the dumping run ended; another micro-batch budget trains the same losses; a step file is never
half written, and a leftover temporary file is never read; a bad replay directory or combination is
one line naming the key, exit status 2."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from core_rl.builtin.loggers import read_metrics
from core_rl.rollout import dump as rollout_dump
from core_rl.rollout.dump import FORMAT, dumped_steps, read_header, read_step, step_file, write_step
from core_rl.testing import preloaded
from core_rl.testing.faults import build_task, checkpoint, merged, run_dir, state_digest
from core_rl.testing.tiny import build_tiny_model
from fault_helpers import cli_command, cli_env, cli_train, write_config

for _plugin in ("core_rl_fsdp", "core_rl_hf", "core_rl_grpo", "core_rl_reward_match"):
    pytest.importorskip(_plugin)

STEPS = 3


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny task, 3 steps, one checkpoint at the end, metrics in metrics.jsonl."""
    root = tmp_path_factory.mktemp("replay")
    task = build_task(root)
    return merged(
        task,
        trainer={"total_steps": STEPS},
        saver={"every_n_steps": 0, "keep_last": 1, "export_hf": False},
        loggers=[{"name": "jsonl"}],
    )


@pytest.fixture(scope="module")
def dumped(base: dict) -> Path:
    """The task's run with its rollouts dumped every step; its run directory."""
    config = merged(base, rollout={"dump": {"every_n_steps": 1}})
    proc = cli_train(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir(config)


def _replay(base: dict, name: str, source: Path, rollout_weight_sync: str | None = None, **sections):
    """A replay of ``source``'s rollouts named ``name``, whose rollout engine could not be built on
    this machine (``device: cuda``) and whose reward would stop the run if it were called."""
    rollout = {
        **base["rollout"],
        "engine": {"name": "hf", "device": "cuda"},
        "replay_from": str(source / "rollouts"),
        **({"weight_sync": rollout_weight_sync} if rollout_weight_sync else {}),
    }
    reward = {"name": "misbehave", "mode": "wrong_count"}
    config = merged(base, experiment={"name": name}, rollout=rollout, reward=reward, **sections)
    return config, cli_train(config, faults=True)


def _losses(run: Path) -> dict[int, float]:
    return {row["step"]: row["actor/loss"] for row in read_metrics(run / "metrics.jsonl")}


def test_each_step_is_dumped_with_its_header(dumped: Path) -> None:
    root = dumped / "rollouts"
    assert sorted(p.name for p in root.iterdir()) == [step_file(root, s).name for s in range(1, STEPS + 1)]
    for step in range(1, STEPS + 1):
        header, generations = read_step(step_file(root, step))
        assert header["format"] == FORMAT and header["step"] == step and header["weight_version"] == step - 1
        assert header["tokenizer"]["vocab_size"] > 0 and header["config_hash"]["actor"]
        assert [len(g.samples) for g in generations] == [8]  # 2 prompts x 4 samples
        samples = generations[0].samples
        assert all(s.weight_version == step - 1 and len(s.logprobs) == len(s.response_ids) for s in samples)
        assert all(w.startswith(str(Path(dumped).parent.parent / "train.jsonl")) for w in generations[0].where)
        assert generations[0].group_index == [0, 0, 0, 0, 1, 1, 1, 1]
    rows = read_metrics(dumped / "metrics.jsonl")
    assert all(r["rollout_dump/bytes"] == step_file(root, r["step"]).stat().st_size for r in rows)


def test_a_replay_without_rollout_engine_or_reward_ends_bitwise_equal(base: dict, dumped: Path) -> None:
    config, proc = _replay(base, "replay", dumped, rollout_weight_sync="disk")
    assert proc.returncode == 0, proc.stderr[-3000:]
    replayed = run_dir(config)
    assert state_digest(checkpoint(replayed, STEPS)) == state_digest(checkpoint(dumped, STEPS))
    assert len(state_digest(checkpoint(dumped, STEPS))) >= 2  # weights and optimizer state compared
    assert _losses(replayed) == _losses(dumped)
    rows = read_metrics(replayed / "metrics.jsonl")
    original = read_metrics(dumped / "metrics.jsonl")
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in original]
    assert all("timing/replay_read_s" in r and "timing/generate_s" not in r for r in rows)
    assert "configuration differs from the dumping run's in reward, rollout" in proc.stderr
    assert not (replayed / "rollouts").exists()
    assert not (replayed / "weight_sync").exists()  # no weights sent to a rollout engine that is not there
    assert all("weight_sync/bytes" not in r for r in rows)


def test_a_replay_with_another_micro_batch_budget_trains_the_same_losses(base: dict, dumped: Path) -> None:
    actor = {**base["actor"], "micro_batch": {"max_tokens_per_mb": 8}}
    config, proc = _replay(base, "replay_mb", dumped, actor=actor)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = _losses(run_dir(config)), _losses(dumped)
    assert ours.keys() == theirs.keys() == set(range(1, STEPS + 1))
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], abs=1e-6, rel=0)
    assert ours != theirs  # the budget changed the micro-batches: their sums round differently


def test_a_failed_write_leaves_no_step_file(tmp_path: Path, dumped: Path, monkeypatch) -> None:
    header, generations = read_step(step_file(dumped / "rollouts", 1))

    def killed(src, dst) -> None:
        raise OSError("killed between write and rename")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(OSError, match="killed between"):
        write_step(step_file(tmp_path, 1), header, generations)
    assert list(tmp_path.iterdir()) == []  # neither the step file nor its temporary file
    monkeypatch.undo()
    assert write_step(step_file(tmp_path, 1), header, generations) > 0
    assert read_header(step_file(tmp_path, 1))["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001.parquet"]


def _validate(config: dict, tmp_path: Path, *overrides: str):

    path = write_config(config, tmp_path / "check.yaml")
    return preloaded.run(
        cli_command("config", "validate", "--preflight", str(path), *overrides),
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=300,
    )


def _problem_lines(proc) -> list[str]:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [line.removeprefix("  - ") for line in proc.stderr.splitlines() if line.startswith("  - ")]


def test_a_leftover_temporary_file_is_never_replayed(base: dict, dumped: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(dumped / "rollouts", source / "rollouts")
    step2 = step_file(source / "rollouts", 2)
    data = step2.read_bytes()
    step2.unlink()
    (source / "rollouts" / f".{step2.name}.tmp").write_bytes(data[: len(data) // 2])  # a writer killed mid-way
    assert sorted(dumped_steps(source / "rollouts")) == [1, 3]
    config = merged(base, rollout={**base["rollout"], "replay_from": str(source / "rollouts")})
    assert _problem_lines(_validate(config, tmp_path)) == [
        f"rollout.replay_from: {source / 'rollouts'} holds no dump of step(s) 2 of the 3 this run trains "
        "(trainer.total_steps); lower trainer.total_steps to 1, or replay a run that dumped every step "
        "(rollout.dump.every_n_steps: 1)"
    ]


def test_bad_replay_directories_are_one_line_each(base: dict, dumped: Path, tmp_path: Path) -> None:
    source = dumped / "rollouts"
    replay = merged(base, rollout={**base["rollout"], "replay_from": str(source)})
    missing = tmp_path / "nowhere"
    assert _problem_lines(_validate(replay, tmp_path, f"rollout.replay_from={missing}")) == [
        f"rollout.replay_from: {missing} is not a directory; name the rollouts directory of a run that dumped them "
        "(rollout.dump.every_n_steps > 0; by default <run>/rollouts)"
    ]
    assert _problem_lines(_validate(replay, tmp_path, "trainer.total_steps=6")) == [
        f"rollout.replay_from: {source} holds no dump of step(s) 4-6 of the 6 this run trains (trainer.total_steps); "
        "lower trainer.total_steps to 3, or replay a run that dumped every step (rollout.dump.every_n_steps: 1)"
    ]
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    step_file(broken, 1).write_bytes(b"not parquet")
    lines = _problem_lines(_validate(replay, tmp_path, f"rollout.replay_from={broken}"))
    assert len(lines) == 1 and lines[0].startswith(f"rollout.replay_from: {step_file(broken, 1)} is not a readable")
    assert lines[0].endswith("; dump the step again")
    other = build_tiny_model(tmp_path / "other_model", alphabet="abcdxyz=", seed=0)
    lines = _problem_lines(_validate(replay, tmp_path, f"actor.model_path={other}"))
    assert len(lines) == 1 and lines[0].startswith(f"rollout.replay_from: step(s) 1-3 under {source} were generated ")
    assert lines[0].endswith("; set actor.model_path to the tokenizer that generated them")


def test_what_a_replay_cannot_combine_with(base: dict, dumped: Path, tmp_path: Path) -> None:
    replay = merged(base, rollout={**base["rollout"], "replay_from": str(dumped / "rollouts")})
    why = "a replay run (rollout.replay_from) builds no rollout engine and calls no reward"
    cases = {
        "rollout.dump.every_n_steps=1": f"rollout.dump.every_n_steps: {why}, so it has nothing new to dump; set 0",
        f"eval={{files: [{base['data']['train_files'][0]}]}}": f"eval: {why}, so it cannot evaluate; remove the "
        "eval: section",
    }
    for override, line in cases.items():
        [problem] = _problem_lines(_validate(replay, tmp_path, override))
        # the override and the file's replay_from disagree: the message says where each was set
        assert problem.startswith(f"{line} (values: ")
        sources = problem.partition("(values: ")[2].split("; ")  # a long value is cut short: its start, and where
        (replay_from,) = [part for part in sources if part.startswith("rollout.replay_from=/")]
        assert f" in {tmp_path / 'check.yaml'}:" in replay_from


def test_the_dump_header_round_trips(dumped: Path) -> None:
    header = read_header(step_file(dumped / "rollouts", 1))
    assert header["format_version"] == rollout_dump.FORMAT_VERSION
    assert json.loads(json.dumps(header)) == header


def test_an_asynchronous_run_replays_bitwise(base: dict) -> None:
    """Samples one version stale (``max_head_offpolicyness: 1``) keep their versions and behaviour
    log-probs in the dump; the replay builds no controller and trains them as the run did."""
    controller = {"max_head_offpolicyness": 1}
    config = merged(
        base,
        experiment={"name": "async"},
        rollout={**base["rollout"], "controller": controller, "dump": {"every_n_steps": 1}},
    )
    proc = cli_train(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    source = run_dir(config)
    versions = {s.weight_version for g in read_step(step_file(source / "rollouts", STEPS))[1] for s in g.samples}
    assert min(versions) < STEPS - 1  # some samples of the last step are stale
    replay_config, replayed = _replay(
        merged(base, rollout={**base["rollout"], "controller": controller}), "async_replay", source
    )
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    assert state_digest(checkpoint(run_dir(replay_config), STEPS)) == state_digest(checkpoint(source, STEPS))
    assert _losses(run_dir(replay_config)) == _losses(source)
