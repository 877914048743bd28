"""Faults inside real training runs (fsdp + hf engines, grpo, in this process): misbehaving
rewards, non-finite losses, a crash restarted automatically, and every way resuming can go wrong
(``latest`` broken, a smaller ``total_steps``, metrics logged twice, the rollout engine's RNG, no
checkpoint at all). Resumed runs are compared with an uninterrupted one bit for bit."""

from __future__ import annotations

import errno
import json
import shutil

import pytest
from core_rl.checkpoint.files import load_tree
from core_rl.errors import CoreRLError
from core_rl.loops.errors import DiskFullError, NonFiniteError, RewardError
from core_rl.testing.faults import RELEASE, FaultPlugin
from fault_helpers import build_task, checkpoint, merged, run_dir, stable_metrics, state_digest, train_here

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    return build_task(tmp_path_factory.mktemp("faults"))


@pytest.fixture
def host(host):
    host.register_plugin(FaultPlugin(), distribution="core-rl-test-faults", version="0")
    return host


@pytest.fixture(scope="module")
def straight(base) -> dict:
    """An uninterrupted 4-step run with a checkpoint after every step."""
    from core_rl.plugins.host import PluginHost

    config = merged(base, experiment={"name": "straight"})
    train_here(config, PluginHost(environ={}))
    return config


def resume_copy(straight: dict, name: str, *, keep_until: int) -> dict:
    """A copy of the straight run as if it had crashed after step ``keep_until``'s checkpoint
    (later checkpoints gone, ``latest`` pointing at it; metrics of every step still logged)."""
    source, config = run_dir(straight), merged(straight, experiment={"name": name}, recover={"mode": "auto"})
    target = run_dir(config)
    shutil.copytree(source, target)
    for step in range(keep_until + 1, 5):
        shutil.rmtree(checkpoint(target, step))
    (target / "checkpoints" / "latest").write_text(checkpoint(target, keep_until).name)
    return config


def assert_same_run(a: dict, b: dict, last: int = 4) -> None:
    assert stable_metrics(run_dir(a)) == stable_metrics(run_dir(b))
    assert state_digest(checkpoint(run_dir(a), last)) == state_digest(checkpoint(run_dir(b), last))


# -- rewards --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "on_error", "kind"),
    [("nan", "value", "nonfinite"), ("raise", "drop", "exception"), ("hang", "value", "timeout")],
)
def test_misbehaving_reward_does_not_stop_the_run(base, host, mode, on_error, kind):
    RELEASE.clear()
    config = merged(
        base,
        experiment={"name": f"reward-{mode}"},
        reward={"name": "misbehave", "mode": mode, "every": 2},
        reward_runner={"items_per_call": 2, "timeout_s": 0.5, "on_error": on_error, "max_error_fraction": 1.0},
        trainer={"total_steps": 2},
        saver={"every_n_steps": 0},
    )
    try:
        train_here(config, host)
    finally:
        RELEASE.set()
    rows = stable_metrics(run_dir(config))
    assert sorted(rows) == [1, 2]
    # 8 samples per step in calls of 2: a hanging or raising call fails both its items, a NaN only the first
    failed = 4 if mode == "nan" else 8
    for step, row in rows.items():
        assert row["reward/errors"] == failed and row[f"reward/errors_{kind}"] == failed
        assert row["reward/errors_total"] == failed * step
        assert row["reward/dropped"] == (failed if on_error == "drop" else 0)
    logged = [json.loads(line) for line in (run_dir(config) / "reward_errors.jsonl").read_text().splitlines()]
    assert len(logged) == 2 * failed and {r["kind"] for r in logged} == {kind}
    assert all(r["prompt"].endswith("=") for r in logged)


def test_reward_stop_ends_the_run_naming_reward_and_item(base, host):
    config = merged(
        base,
        experiment={"name": "reward-stop"},
        reward={"name": "misbehave", "mode": "string", "every": 4},
        reward_runner={"on_error": "stop"},
    )
    with pytest.raises(RewardError) as err:
        train_here(config, host)
    assert "reward 'misbehave' (distribution core-rl-test-faults 0) failed on item 0 of step 1" in str(err.value)
    assert "score is not a number: str '0.5'" in str(err.value)
    assert err.value.exit_code == 1


# -- non-finite steps -----------------------------------------------------------------------


def test_nonfinite_step_is_skipped_saved_and_counted(base, host):
    config = merged(
        base,
        experiment={"name": "nan-skip"},
        algorithm={"name": "grpo", "loss": {"name": "nan_pg", "nan_steps": [2]}},
        trainer={"total_steps": 3},
    )
    train_here(config, host)
    run = run_dir(config)
    rows = stable_metrics(run)
    assert [rows[s]["actor/nonfinite"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert [rows[s]["actor/nonfinite_total"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    # the skipped step changed neither weights nor optimizer state; the next one did
    assert state_digest(checkpoint(run, 2)) == state_digest(checkpoint(run, 1))
    assert (
        state_digest(checkpoint(run, 3))["model.safetensors"] != state_digest(checkpoint(run, 2))["model.safetensors"]
    )
    dumped = load_tree(run / "nonfinite" / "step_00000002", "rank0")
    assert dumped["batch"]["input_ids"].shape[0] == 8
    assert dumped["metrics"]["nonfinite"] == 1.0


@pytest.mark.parametrize("how", ["stop", "streak"])
def test_nonfinite_stop_ends_the_run(base, host, how):
    trainer = {"on_nonfinite": "stop"} if how == "stop" else {"max_consecutive_nonfinite": 2}
    config = merged(
        base,
        experiment={"name": f"nan-{how}"},
        algorithm={"name": "grpo", "loss": {"name": "nan_pg", "nan_steps": [1, 2, 3]}},
        trainer=trainer,
    )
    with pytest.raises(NonFiniteError) as err:
        train_here(config, host)
    step = 1 if how == "stop" else 2
    assert f"step {step}: the loss or gradient norm is not finite" in str(err.value)
    assert str(run_dir(config) / "nonfinite" / f"step_{step:08d}") in str(err.value)
    assert ("trainer.on_nonfinite=stop" if how == "stop" else "max_consecutive_nonfinite=2") in str(err.value)


# -- automatic restarts ---------------------------------------------------------------------


def test_crash_is_restarted_from_the_checkpoint_bitwise(base, host, straight, tmp_path):
    config = merged(
        straight,
        experiment={"name": "crash-once"},
        loggers=[{"name": "crash_once", "step": 3, "marker": str(tmp_path / "crashed")}],
        recover={"mode": "auto", "retries": 1},
    )
    train_here(config, host)
    assert (tmp_path / "crashed").exists()  # it did crash once
    assert_same_run(config, straight)


def test_crash_without_retries_propagates(base, host, tmp_path):
    config = merged(
        base,
        experiment={"name": "crash-no-retry"},
        loggers=[{"name": "crash_once", "step": 1, "marker": str(tmp_path / "crashed")}],
        recover={"mode": "auto", "retries": 0},
    )
    with pytest.raises(RuntimeError, match="crash_once: logger crashed at step 1"):
        train_here(config, host)


# -- resuming -------------------------------------------------------------------------------


def test_resume_after_a_crash_is_bitwise_and_logs_each_step_once(straight, host):
    config = resume_copy(straight, "crashed", keep_until=2)
    with (run_dir(config) / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "reward/me')  # a line cut short by the crash
    train_here(config, host)
    assert_same_run(config, straight)


@pytest.mark.parametrize("damage", ["latest_names_missing", "latest_garbage", "latest_missing", "truncated_weights"])
def test_broken_latest_falls_back_to_newest_valid(straight, host, damage, capfd):
    config = resume_copy(straight, f"broken-{damage}", keep_until=3)
    run = run_dir(config)
    latest = run / "checkpoints" / "latest"
    if damage == "latest_names_missing":
        latest.write_text("step_00000009")
    elif damage == "latest_garbage":
        latest.write_text("../../etc")
    elif damage == "latest_missing":
        latest.unlink()
        shutil.rmtree(checkpoint(run, 3))  # so the fallback has to skip nothing and take step 2
    else:
        weights = checkpoint(run, 3) / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    train_here(config, host)
    err = capfd.readouterr().err
    expected = {
        "latest_names_missing": "names step_00000009, which does not exist",
        "latest_garbage": "names '../../etc', which is not a checkpoint directory",
        "latest_missing": "checkpoints/latest is missing",
        "truncated_weights": "model.safetensors: cannot be read",
    }[damage]
    assert expected in err
    resumed_from = "step_00000002" if damage in ("latest_missing", "truncated_weights") else "step_00000003"
    assert f"resumed from {checkpoint(run, int(resumed_from[-1]))}" in err
    assert_same_run(config, straight)


def test_total_steps_below_the_checkpoint_is_refused(straight, host):
    config = resume_copy(straight, "shorter", keep_until=4)
    run = run_dir(config)
    before = {p.name: state_digest(p) for p in (run / "checkpoints").glob("step_*")}
    config["trainer"]["total_steps"] = 2
    with pytest.raises(CoreRLError) as err:
        train_here(config, host)
    assert "trainer.total_steps=2 is below the step of the checkpoint" in str(err.value)
    assert "step 4" in str(err.value) and err.value.exit_code == 2
    assert {p.name: state_digest(p) for p in (run / "checkpoints").glob("step_*")} == before
    assert (run / "checkpoints" / "latest").read_text() == "step_00000004"


def test_total_steps_reached_trains_nothing(straight, host):
    config = resume_copy(straight, "done", keep_until=4)
    result = train_here(config, host)
    assert result["checkpoint"] == checkpoint(run_dir(config), 4)
    assert_same_run(config, straight)


def test_recover_modes_without_a_checkpoint(base, host):
    config = merged(base, experiment={"name": "no-ckpt"}, trainer={"total_steps": 1}, recover={"mode": "resume"})
    run = run_dir(config)
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2}\n')
    with pytest.raises(CoreRLError, match="recover.mode=resume, but .* holds no valid checkpoint"):
        train_here(config, host)
    config["recover"]["mode"] = "disabled"
    with pytest.raises(CoreRLError, match="already holds a run; set recover.mode=auto"):
        train_here(config, host)
    config["recover"]["mode"] = "auto"  # starts from the beginning and drops the stale metrics
    train_here(config, host)
    assert sorted(stable_metrics(run)) == [1]


def test_rollout_engine_generator_is_checkpointed(base, host):
    seeded = merged(base, rollout={"engine": {"name": "hf", "seed": 11}}, trainer={"total_steps": 3})
    straight = merged(seeded, experiment={"name": "seeded-straight"})
    train_here(straight, host)
    config = merged(seeded, experiment={"name": "seeded-resumed"}, recover={"mode": "auto"})
    shutil.copytree(run_dir(straight), run_dir(config))
    shutil.rmtree(checkpoint(run_dir(config), 2))
    shutil.rmtree(checkpoint(run_dir(config), 3))
    (run_dir(config) / "checkpoints" / "latest").write_text("step_00000001")
    extra = load_tree(checkpoint(run_dir(config), 1), "extra")
    assert "generator" in extra["rollout"]
    train_here(config, host)
    assert_same_run(config, straight, last=3)


def test_checkpoints_hold_nothing_that_is_unpickled(straight):
    files = [p for p in (run_dir(straight) / "checkpoints").rglob("*") if p.is_file()]
    assert files and all(p.suffix in (".json", ".safetensors") or p.name == "latest" for p in files), files


# -- a full disk ----------------------------------------------------------------------------


def test_disk_full_during_a_save_injected(base, host, monkeypatch):
    """ENOSPC raised by the checkpoint writer on the second save (the tmpfs test in
    test_disk_full.py fills a real file system)."""
    import safetensors.torch

    config = merged(base, experiment={"name": "enospc"}, saver={"every_n_steps": 2}, trainer={"total_steps": 4})
    real_save, calls = safetensors.torch.save_file, []

    def save_file(tensors, filename, *args, **kwargs):
        calls.append(filename)
        if "step_00000004" in str(filename):
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with pytest.raises(DiskFullError) as err:
        train_here(config, host)
    run = run_dir(config)
    assert "no space left on device while saving checkpoint" in str(err.value)
    assert f"the newest valid checkpoint is {checkpoint(run, 2)}" in str(err.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000002"]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000002"
