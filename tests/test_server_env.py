"""Server environments (core_rl.server_env) built for real, from a small spec: a venv, the steps run
with its interpreter, the fix-up, the check, the manifest and lock file, reuse while the spec is
unchanged, a new environment when it changes, errors naming the failed step, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from core_rl import server_env
from core_rl.cli import main
from core_rl.server_env import ServerEnvError, ServerEnvSpec


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CORE_RL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _spec(tmp_path: Path, marker: str = "one", fail: bool = False) -> ServerEnvSpec:
    req = tmp_path / "req.txt"
    if not req.exists():
        req.write_text("# nothing to install\n")

    def fixup(directory: Path) -> None:
        (directory / "fixed.txt").write_text(marker)

    step = ["-c", "import sys; sys.exit(4)"] if fail else ["-c", f"open('step.txt', 'w').write({marker!r})"]
    return ServerEnvSpec(
        name="toy",
        steps={"cpu": [step, ["-m", "pip", "install", "-q", "-r", str(req)]]},
        post_install=fixup,
        check="import json",
        description="a toy server environment",
    )


def test_create_records_and_reuses(tmp_path: Path, home: Path) -> None:
    spec = _spec(tmp_path)
    directory = server_env.create(spec, variant="cpu")
    assert directory.parent == home / "server-envs" and directory.name.startswith("toy-cpu-")
    manifest = json.loads((directory / server_env.MANIFEST).read_text())
    assert manifest["name"] == "toy" and manifest["variant"] == "cpu" and manifest["steps"] == spec.steps_for("cpu")
    assert "pip==" in (directory / server_env.LOCK_FILE).read_text()  # pip freeze --all
    assert (directory / "fixed.txt").read_text() == "one"
    python = server_env.env_python(directory)
    assert subprocess.run(
        [str(python), "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True
    ).stdout.strip() == str(directory)
    # unchanged spec: the same environment, not rebuilt
    stamp = (directory / server_env.MANIFEST).stat().st_mtime_ns
    assert server_env.create(spec, variant="cpu") == directory
    assert (directory / server_env.MANIFEST).stat().st_mtime_ns == stamp
    assert server_env.find(spec, variant="cpu") == directory


def test_changed_requirements_make_a_new_environment(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    first = server_env.env_dir(spec, "cpu")
    (tmp_path / "req.txt").write_text("# changed\n")
    assert server_env.env_dir(spec, "cpu") != first
    assert server_env.env_dir(_spec(tmp_path, marker="two"), "cpu") != server_env.env_dir(spec, "cpu")


def test_failed_step_is_named_and_unfinished_env_is_rebuilt(tmp_path: Path) -> None:
    bad = _spec(tmp_path, fail=True)
    with pytest.raises(ServerEnvError, match=r"step 1 of toy .* failed \(exit 4\)"):
        server_env.create(bad, variant="cpu")
    assert server_env.find(bad, variant="cpu") is None  # no manifest: not finished
    with pytest.raises(ServerEnvError, match="no 'cuda' variant"):
        server_env.create(bad, variant="cuda")


def test_remove(tmp_path: Path) -> None:
    directory = server_env.create(_spec(tmp_path), variant="cpu")
    assert server_env.remove("toy") == [directory]
    assert not directory.exists() and server_env.list_envs() == []


def test_cli_lists_real_plugins_and_reports_missing_env(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["server-env", "list"]) == 0
    out = capsys.readouterr().out
    if "vllm" not in out:
        pytest.skip("core-rl-vllm is not installed")
    assert "vllm:" in out and "sglang:" in out
    # in a fresh CORE_RL_HOME nothing is built: `path` says how to build it (exit 2, no traceback)
    assert main(["server-env", "path", "vllm", "--variant", "cpu"]) == 2
    assert "core-rl server-env create vllm" in capsys.readouterr().err
    assert main(["server-env", "create", "no_such_env"]) == 2
    assert "server environment 'no_such_env' is not installed" in capsys.readouterr().err


def test_real_specs_hash_their_requirement_files() -> None:
    specs = []
    for module in ("core_rl_vllm.env", "core_rl_sglang.env"):
        mod = pytest.importorskip(module)
        specs += [getattr(mod, name)() for name in dir(mod) if name.endswith("_env_spec")]
    for spec in specs:
        assert set(spec.steps) == {"cpu", "cuda"}
        version = ".".join(map(str, sys.version_info[:3]))
        assert len(server_env.spec_hash(spec, "cpu", version)) == 12
