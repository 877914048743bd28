"""Server environments (core_rl_server_kit.env) built for real, from a small spec: a venv, the steps run
with its interpreter, the fix-up, the check, the manifest and lock file, reuse while the spec is
unchanged, a new environment when it changes, errors naming the failed step, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from core_rl.cli import main
from core_rl.interfaces.servers import ServerEnvError, ServerEnvSpec
from core_rl_server_kit import env as server_env


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

    marker_file = str(tmp_path / "step.txt")
    step = ["-c", "import sys; sys.exit(4)"] if fail else ["-c", f"open({marker_file!r}, 'w').write({marker!r})"]
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


def _wheel(directory: Path, name: str = "toypkg", version: str = "1.0") -> Path:
    """A minimal, valid pure-Python wheel (module ``name`` with ``VALUE = 42``)."""
    import base64
    import hashlib
    import zipfile

    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 42\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist_info}/RECORD"] = "\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def test_pip_settings_become_uv_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PIP_FIND_LINKS", f"{tmp_path / 'a'} {tmp_path / 'b'}")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///nowhere/simple")
    flags = server_env.pip_settings_as_uv_flags(sys.executable)
    pairs = list(zip(flags[::2], flags[1::2], strict=True))
    assert ("--find-links", str(tmp_path / "a")) in pairs and ("--find-links", str(tmp_path / "b")) in pairs
    assert ("--extra-index-url", "file:///nowhere/simple") in pairs


def test_pip_steps_translate_to_uv_and_others_run_as_written() -> None:
    py, uv = "/env/bin/python", "/bin/uv"
    install = ["-m", "pip", "install", "--disable-pip-version-check", "--no-deps", "-r", "req.txt"]
    cmd = server_env.installer_command(install, py, uv, ["--find-links", "/w"])
    assert cmd[:5] == [uv, "pip", "install", "--python", py]
    assert cmd[-5:] == ["--find-links", "/w", "--no-deps", "-r", "req.txt"]
    assert "--disable-pip-version-check" not in cmd and "unsafe-best-match" in cmd
    uninstall = ["-m", "pip", "uninstall", "-y", "triton"]
    assert server_env.installer_command(uninstall, py, uv, []) == [uv, "pip", "uninstall", "--python", py, "triton"]
    other = ["-c", "print(1)"]
    assert server_env.installer_command(other, py, uv, ["--find-links", "/w"]) == [py, *other]
    assert server_env.installer_command(install, py, None, []) == [py, *install]  # no uv: pip as written


@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_build_installs_through_either_installer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, installer: str
) -> None:
    if installer == "uv" and server_env.uv_binary() is None:
        pytest.skip("uv is not installed")
    monkeypatch.setenv(server_env.INSTALLER_ENV, installer)
    wheels = tmp_path / "wheels"
    _wheel(wheels)
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))  # reaches uv through pip's configuration
    spec = ServerEnvSpec(
        name="toywheel",
        steps={"cpu": [["-m", "pip", "install", "--no-index", "--no-deps", "toypkg==1.0"]]},
        check="import toypkg; assert toypkg.VALUE == 42",
    )
    directory = server_env.create(spec, variant="cpu")
    manifest = json.loads((directory / server_env.MANIFEST).read_text())
    assert manifest["installer"] == installer
    assert "toypkg==1.0" in (directory / server_env.LOCK_FILE).read_text()
