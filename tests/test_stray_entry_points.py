"""An installed plugin whose entry point sits in a misspelled group (``core_rl.environment`` for
``core_rl.environments``) is not loaded by anything: ``core-rl plugins``, ``train``, ``eval`` and
``config`` say so in one warning line naming the entry point, its distribution and the group meant,
instead of the plugin vanishing silently. A real installed distribution (its ``.dist-info`` on the
path), a real ``core-rl`` process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _install(site: Path, group: str) -> None:
    info = site / "stray_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: stray-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\ncalculator = stray_plugin.env\n")
    (site / "stray_plugin").mkdir()
    (site / "stray_plugin" / "__init__.py").write_text("")


def _core_rl(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "core_rl.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


def test_a_misspelled_group_is_named_with_the_group_meant(tmp_path: Path) -> None:
    _install(tmp_path, "core_rl.environment")
    listed = _core_rl(tmp_path, "plugins", "--json")
    assert listed.returncode == 0, listed.stderr[-2000:]
    warning = [line for line in listed.stderr.splitlines() if "stray-plugin" in line]
    assert warning == [
        "core-rl: warning: entry point 'calculator' (stray_plugin.env) of distribution stray-plugin is in group "
        "'core_rl.environment', which core-rl does not read, so it is ignored; did you mean 'core_rl.environments'?"
    ]
    validated = _core_rl(tmp_path, "config", "validate", "examples/tiny_grpo/grpo.yaml")
    assert validated.returncode == 0 and "did you mean 'core_rl.environments'?" in validated.stderr


def test_a_correct_group_and_other_projects_groups_give_no_warning(tmp_path: Path) -> None:
    _install(tmp_path / "right", "core_rl.environments")
    listed = _core_rl(tmp_path / "right", "plugins", "--json")
    assert "warning" not in listed.stderr
    _install(tmp_path / "other", "console_scripts")
    assert "warning" not in _core_rl(tmp_path / "other", "plugins", "--json").stderr
