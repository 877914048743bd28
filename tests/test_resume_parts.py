"""The pieces of safe resuming, alone: which checkpoint is picked, what rotation deletes, how a
full disk is recognised, how metrics are cut back, and paths that cannot leave the run directory."""

from __future__ import annotations

import errno

import pytest
from core_rl.builtin.loggers import JsonlLoggerConfig, truncate_jsonl
from core_rl.checkpoint import store as checkpoints
from core_rl.checkpoint.files import CheckpointFormatError, partial_path
from core_rl.config import load_config
from core_rl.config.loader import structure
from core_rl.config.schema import ExperimentConfig
from core_rl.errors import ConfigError
from hypothesis import given, settings
from hypothesis import strategies as st


def make(run, *steps: int, latest: int | None = None) -> None:
    for step in steps:
        checkpoints.checkpoint_dir(run, step).mkdir(parents=True)
        (checkpoints.checkpoint_dir(run, step) / "ok").write_text("")
    if latest is not None:
        checkpoints.mark_latest(run, latest)


def needs_ok_file(path) -> None:
    if not (path / "ok").is_file():
        raise CheckpointFormatError(f"{path / 'ok'}: missing")


def test_latest_is_trusted_when_valid(tmp_path):
    make(tmp_path, 2, 4, 6, latest=4)  # a newer step 6 is not taken over what latest names
    found = checkpoints.find_resumable(tmp_path, needs_ok_file)
    assert (found.path, found.step, found.notes) == (checkpoints.checkpoint_dir(tmp_path, 4), 4, [])


def test_broken_checkpoints_are_skipped_with_reasons(tmp_path):
    make(tmp_path, 2, 4, 6, latest=6)
    (checkpoints.checkpoint_dir(tmp_path, 6) / "ok").unlink()
    (checkpoints.checkpoint_dir(tmp_path, 4) / "ok").unlink()
    found = checkpoints.find_resumable(tmp_path, needs_ok_file)
    assert found.path == checkpoints.checkpoint_dir(tmp_path, 2) and found.step == 2
    assert found.notes[0].endswith(
        "names step_00000006, which is not a valid checkpoint: "
        + str(checkpoints.checkpoint_dir(tmp_path, 6) / "ok")
        + ": missing"
    )
    assert found.notes[1].startswith("step_00000004 is not a valid checkpoint, skipped")
    assert found.notes[2] == "resuming from step_00000002, the newest valid checkpoint"


def test_nothing_to_resume(tmp_path):
    assert checkpoints.find_resumable(tmp_path, needs_ok_file).path is None
    make(tmp_path, 3)
    (checkpoints.checkpoint_dir(tmp_path, 3) / "ok").unlink()
    found = checkpoints.find_resumable(tmp_path, needs_ok_file)
    assert found.path is None and "latest is missing" in found.notes[0]


def test_prune_keeps_the_newest_valid_and_leaves_later_steps(tmp_path):
    make(tmp_path, 1, 2, 3, 4, 9, latest=4)
    stale = partial_path(checkpoints.checkpoint_dir(tmp_path, 5))
    stale.mkdir()
    removed = checkpoints.prune(tmp_path, keep_last=2)
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    # step 9 is newer than latest (left from another history): not ours to delete, and not kept as "newest"
    assert left == ["latest", "step_00000003", "step_00000004", "step_00000009"]
    assert stale in removed


@settings(deadline=None)  # file system work: a per-example deadline only measures the machine's load
@given(st.sets(st.integers(1, 40), min_size=1, max_size=8), st.integers(1, 5), st.data())
def test_prune_never_deletes_what_latest_names(tmp_path_factory, steps, keep_last, data):
    run = tmp_path_factory.mktemp("prune")
    latest = data.draw(st.sampled_from(sorted(steps)))
    make(run, *steps, latest=latest)
    checkpoints.prune(run, keep_last)
    kept = {s for s, _ in checkpoints.list_checkpoints(run)}
    older = sorted(s for s in steps if s < latest)
    newest_older = set(older[::-1][: keep_last - 1])  # the keep_last - 1 newest before latest
    assert latest in kept
    assert kept == {latest} | newest_older | {s for s in steps if s > latest}


def test_prune_does_nothing_without_a_valid_latest(tmp_path):
    make(tmp_path, 1, 2, 3)
    assert checkpoints.prune(tmp_path, keep_last=1) == []
    (tmp_path / "checkpoints" / "latest").write_text("step_00000007")
    assert checkpoints.prune(tmp_path, keep_last=1) == []
    assert len(checkpoints.list_checkpoints(tmp_path)) == 3


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left" })'),
    ],
)
def test_disk_full_is_recognised_in_the_error_or_its_cause(exc):
    assert checkpoints.is_disk_full(exc)
    try:
        try:
            raise exc
        except Exception as inner:
            raise RuntimeError("saving checkpoint failed") from inner
    except RuntimeError as outer:
        assert checkpoints.is_disk_full(outer)
    assert not checkpoints.is_disk_full(OSError(errno.EACCES, "Permission denied"))


def test_truncate_jsonl_keeps_earlier_steps_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a": 3}\n{"step": 4, "a"')
    assert truncate_jsonl(path, 2) == 2
    assert path.read_text() == '{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n'
    assert truncate_jsonl(path, 2) == 0 and truncate_jsonl(tmp_path / "missing.jsonl", 0) == 0


@pytest.mark.parametrize("name", ["../x", "../../etc/passwd", "/tmp/x", "a/../../b", "", "."])
def test_run_names_and_log_files_cannot_leave_the_output_directory(name):
    with pytest.raises(ConfigError, match=r"experiment\.name: must be a relative path that stays inside"):
        structure({"name": name}, ExperimentConfig, path="experiment")
    with pytest.raises(ConfigError, match=r"loggers\[0\]\.filename: must be a relative path that stays inside"):
        structure({"filename": name}, JsonlLoggerConfig, path="loggers[0]")


@pytest.mark.parametrize("name", ["run", "team/run-1", "a/./b"])
def test_names_inside_the_output_directory_are_fine(name):
    assert structure({"name": name}, ExperimentConfig).name == name


def test_a_logger_path_escape_is_a_config_error_naming_the_key(tmp_path, host, minimal_config):
    import yaml

    config = {**minimal_config, "loggers": [{"name": "jsonl", "filename": "../../x.jsonl"}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"loggers\[0\]\.filename: must be a relative path"):
        load_config(path, host=host)
    with pytest.raises(ConfigError, match=r"experiment\.name: must be a relative path"):
        load_config(path, ["experiment.name=../../x", "loggers=[]"], host=host)
