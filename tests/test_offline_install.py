"""``scripts/offline``: a wheelhouse for a machine without a package index, built against what that
machine has (here: this environment), installed there with ``--no-index`` into a virtual
environment that sees the interpreter's own packages, leaving its torch alone; and a version on the
target that core-rl cannot use is named before anything is carried over.

Slow (builds wheels of the core and four plugins). Needs the package index only for the wheels'
build backend (hatchling), as any wheel build does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import packaging_utils as pu
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def _index(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Building a wheel fetches its build backend (hatchling) from the index, as any wheel build does."""
    problem = pu.registry_problem(tmp_path_factory.mktemp("probe"))
    if problem is not None:
        pytest.skip(f"pip cannot reach its package index ({problem}); wheels cannot be built")


ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "scripts" / "offline" / "build_wheelhouse.py"
INSTALL = ROOT / "scripts" / "offline" / "install.sh"
EXTRAS = "fsdp,hf,grpo,reward-match"


def _have(path: Path, **replace: str) -> Path:
    """This environment's ``pip list --format=freeze``, with some versions replaced."""
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    lines = [
        f"{line.split('==')[0]}=={replace[line.split('==')[0].lower()]}"
        if line.split("==")[0].lower() in replace
        else line
        for line in freeze
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _build(tmp_path: Path, have: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(BUILD), str(tmp_path / "wheelhouse"), "--have", str(have), "--extras", EXTRAS]
    return subprocess.run([*command, *extra], capture_output=True, text=True, timeout=900)


def test_the_wheelhouse_installs_without_an_index_and_leaves_torch_alone(tmp_path: Path) -> None:
    import torch

    built = _build(tmp_path, _have(tmp_path / "have.txt"))
    assert built.returncode == 0, built.stderr[-3000:]
    manifest = (tmp_path / "wheelhouse" / "manifest.txt").read_text().splitlines()
    files = sorted(line.split()[0] for line in manifest)
    # everything else is here already: only core-rl, the plugins the extras name (gspo etc. left out)
    # and the kit the engines build on
    assert files == [
        "core_rl-0.1.0-py3-none-any.whl",
        "core_rl_fsdp-0.1.0-py3-none-any.whl",
        "core_rl_grpo-0.1.0-py3-none-any.whl",
        "core_rl_hf-0.1.0-py3-none-any.whl",
        "core_rl_reward_match-0.1.0-py3-none-any.whl",
        "core_rl_train_kit-0.1.0-py3-none-any.whl",
    ]
    venv = tmp_path / "venv"
    env = {**os.environ, "PYTHON": sys.executable, "VENV": str(venv), "PIP_CONFIG_FILE": os.devnull}
    # a wheelhouse built from other sources than this checkout (core/ changed since) is refused, before pip
    sources = tmp_path / "wheelhouse" / "sources.txt"
    digest = sources.read_text()
    sources.write_text("0" * 64 + "\n")
    refused = subprocess.run(
        ["bash", str(INSTALL), str(tmp_path / "wheelhouse")], capture_output=True, text=True, env=env, timeout=300
    )
    assert refused.returncode == 2 and "was built from other sources than" in refused.stderr, refused.stderr
    assert not venv.exists()  # refused before anything was made
    sources.write_text(digest)
    installed = subprocess.run(
        ["bash", str(INSTALL), str(tmp_path / "wheelhouse")], capture_output=True, text=True, env=env, timeout=900
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert f"with torch {torch.__version__}" in installed.stdout
    listed = subprocess.run(
        [str(venv / "bin" / "core-rl"), "plugins", "--json"], capture_output=True, text=True, timeout=300
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    plugins = {(p["kind"], p["name"]): p for p in json.loads(listed.stdout)}
    assert {("train engine", "fsdp"), ("rollout engine", "hf"), ("algorithm", "grpo")} <= set(plugins)
    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import core_rl_fsdp, torch; print(core_rl_fsdp.__file__, torch.__file__)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout.split()
    assert where[0].startswith(str(venv))  # the plugin from the wheelhouse ...
    assert where[1] == torch.__file__  # ... torch the interpreter's own


def test_a_version_on_the_target_that_core_rl_cannot_use_is_named(tmp_path: Path) -> None:
    """... and so is one that a requirement carried with ``--with`` (as TRL for the GPU benchmark) cannot use."""
    built = _build(tmp_path, _have(tmp_path / "have.txt", transformers="4.40.0"), "--with", "packaging>=999")
    assert built.returncode == 2
    assert "the target has transformers 4.40.0, but core-rl requires transformers" in built.stderr
    assert "but --with requires packaging>=999" in built.stderr
    assert "Traceback" not in built.stderr


def test_every_extra_resolves_to_one_consistent_set(tmp_path: Path) -> None:
    """With no ``--have``, every extra (the loggers' protobuf and pillow bounds among them, which a
    first-come pick of versions broke) resolves for the target's Python: the set holds every
    requirement of core-rl and its plugins at a version that satisfies it, and none of ours."""
    out = tmp_path / "all"
    proc = subprocess.run(
        [sys.executable, str(BUILD), str(out), "--resolve-only"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing downloaded" in proc.stdout
    resolved = {}
    for line in (out / "requirements.txt").read_text().splitlines():
        name, version = line.split("==")
        resolved[name] = Version(version)
    script = _script()
    env = script.target_environment("3.12")
    ours = {script.file_name(w): w for w in out.glob("core_rl*.whl")}
    assert len(ours) > 20 and not set(ours) & set(resolved)
    for name, wheel in ours.items():
        _, requires = script.metadata_requirements(wheel)
        for text in requires:
            req = Requirement(text)
            wanted = canonicalize_name(req.name)
            if wanted in ours or not script.applies(req, env, {"all"} if name == "core-rl" else set()):
                continue
            assert wanted in resolved, f"{name} requires {req}: not resolved"
            assert req.specifier.contains(resolved[wanted], prereleases=True), f"{name} requires {req}"
    assert not list(out.glob("*.tar.gz")) and len(list(out.iterdir())) == len(ours) + 2  # .resolve, requirements.txt


def test_a_conflict_below_core_rls_own_requirements_is_explained(tmp_path: Path) -> None:
    """The target's version of a distribution core-rl needs only through another (tokenizers, through
    transformers) is held fixed: where nothing fits, the resolver's explanation names it, exit 2."""
    built = _build(tmp_path, _have(tmp_path / "have.txt", tokenizers="0.10.0"))
    assert built.returncode == 2, built.stderr[-2000:]
    assert "no set of versions satisfies core-rl's requirements" in built.stderr
    assert "tokenizers" in built.stderr and "Traceback" not in built.stderr
    assert not (tmp_path / "wheelhouse" / "manifest.txt").exists()


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_wheelhouse", BUILD)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_test_tools_are_requirements_dev_txts_own_requirements() -> None:
    """``--test-tools`` carries what the suite imports beyond core-rl (the OpenAI client of the proxy's
    tests among them: a GPU machine lacked it), from requirements-dev.txt: not its editable
    installs, not the linter."""
    tools = _script().test_tools()
    names = [Requirement(t).name for t in tools]
    assert {"pytest", "pytest-xdist", "hypothesis", "openai", "hatchling"} <= set(names)
    assert "ruff" not in names and not any(t.startswith("-") for t in tools)
    assert len(names) == len(set(names))


def test_wheels_build_without_isolation_only_where_the_backend_is_here(tmp_path: Path) -> None:
    """This environment has hatchling (requirements-dev.txt), so core-rl's wheels build in it rather
    than in a fresh isolated environment each; a project whose backend is absent or too old builds
    isolated."""
    script = _script()
    assert script.backends_installed(script.selected_projects({"fsdp", "grpo"}))
    for requires in ('["hatchling>=999"]', '["no-such-backend-core-rl"]'):
        project = tmp_path / requires.strip('[]"').replace(">=", "")
        project.mkdir()
        (project / "pyproject.toml").write_text(f"[build-system]\nrequires = {requires}\n")
        assert not script.backends_installed({"core-rl": ROOT, "other": project}), requires


def test_a_kept_wheel_is_reused_only_where_it_installs_on_the_target() -> None:
    """A rebuild keeps files already in the wheelhouse: only those the target's Python can install
    (a build for 3.12 left cp312 wheels that 3.11 cannot use)."""
    fits = _script().fits_target
    cases = {
        "numpy-2.3.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl": (False, True),
        "six-1.16.0-py2.py3-none-any.whl": (True, True),
        "cryptography-45.0.0-cp311-abi3-manylinux_2_34_x86_64.whl": (True, True),  # the stable ABI of 3.11 on
        "pydantic_core-2.50.5-cp312-abi3-manylinux_2_17_x86_64.whl": (False, True),
        "x-1.0-cp311-cp311-macosx_11_0_arm64.whl": (False, False),
        "deepspeed-0.19.8.tar.gz": (True, True),
    }
    for name, (on_311, on_312) in cases.items():
        assert (fits(Path(name), "3.11"), fits(Path(name), "3.12")) == (on_311, on_312), name


def test_what_torch_brings_is_left_to_the_target_and_nothing_else() -> None:
    """The target's torch brings its CUDA libraries and what only torch needs; a distribution named
    like them that a logger needs (nvidia-ml-py, swanlab's) is carried, as is one torch and another
    both need."""
    resolved = [
        ("torch", "2.13.0", "core-rl, deepspeed"),
        ("nvidia-cublas-cu12", "12.8.4.1", "torch"),
        ("nvidia-cudnn-cu12", "9.10.2.21", "torch"),
        ("cuda-bindings", "13.0.0", "cuda-toolkit"),
        ("cuda-toolkit", "13.0.0", "torch"),
        ("sympy", "1.14.0", "torch"),
        ("mpmath", "1.3.0", "sympy"),
        ("nvidia-ml-py", "13.580.82", "swanlab"),
        ("filelock", "3.20.0", "huggingface-hub, torch"),
        ("transformers", "5.24.0", "core-rl"),
    ]
    side = _script().torch_side(resolved)
    cuda = {"nvidia-cublas-cu12", "nvidia-cudnn-cu12", "cuda-bindings", "cuda-toolkit"}
    assert side == {"torch", "sympy", "mpmath", *cuda}
