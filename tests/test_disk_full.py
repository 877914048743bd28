"""A checkpoint save that fills a real, small file system (a 2.6 MB tmpfs mounted in a private
mount namespace by ``unshare``): the run stops with "no space left" naming the newest valid
checkpoint, and leaves no partial files behind. Skipped where mount namespaces are not allowed;
``test_faults_train.py::test_disk_full_during_a_save_injected`` covers the same path with an
injected ENOSPC everywhere."""

from __future__ import annotations

import shutil

import pytest
from core_rl.testing import preloaded
from fault_helpers import build_task, cli_command, cli_env, merged, write_config

pytest.importorskip("core_rl_fsdp")

SCRIPT = """
mount -t tmpfs -o size=2600k tmpfs "$1" || exit 97
shift
"$@"
rc=$?
cp -r "$MOUNTED_RUN" "$COPY" 2>/dev/null
exit $rc
"""


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = preloaded.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs tmpfs /mnt || exit 1"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _namespaces_work(), reason="no mount namespaces (unshare) on this machine")
def test_full_tmpfs_during_a_checkpoint(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    base = build_task(tmp_path / "task")
    config = merged(
        base,
        experiment={"name": "full", "output_dir": str(mount)},
        saver={"every_n_steps": 2, "keep_last": 1, "export_hf": False},
        trainer={"total_steps": 4},
    )
    path = write_config(config, tmp_path / "full.yaml")
    env = {**cli_env(), "MOUNTED_RUN": str(mount / "full"), "COPY": str(tmp_path / "copy")}
    proc = preloaded.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            SCRIPT,
            "sh",
            str(mount),
            *cli_command("train", str(path)),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    err = proc.stderr
    assert "Traceback" not in err, err[-4000:]
    newest = mount / "full" / "checkpoints" / "step_00000002"
    assert "core-rl: error: no space left on device while saving checkpoint" in err, err[-2000:]
    assert f"step_00000004 (its partial files were removed); the newest valid checkpoint is {newest}" in err
    checkpoints = tmp_path / "copy" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002"]
    assert (checkpoints / "latest").read_text() == "step_00000002"
    assert (checkpoints / "step_00000002" / "meta.json").is_file()
